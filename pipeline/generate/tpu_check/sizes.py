"""The TPU check of a run of several sizes (``check_sizes``): every size's host program on
the target, without a whole compile per size.

A whole real-size program takes 10 to 40 minutes to compile here, so nine sizes must not
mean nine. The sizes are ordered by what the parts of a step need at one image
(``step_parts.parts_memory``, buffer assignment only: seconds). The heaviest is checked
whole (with ``--per-device-batch auto``, searched as ``largest_batch`` searches: its
parts predict, the whole decides). What that whole program measured beyond its weights,
over its parts, scales every other size's parts into a prediction of its whole. A size
is settled by the parts when its prediction at its batch is no more than what the
heaviest's whole program was measured to need (and that one fits); any other is compiled
whole: that one decides, and under auto a size the parts cannot settle is searched whole.
"""
from __future__ import annotations

import math

from pipeline.core import buckets, logs
from pipeline.generate import fit
from pipeline.generate.tpu_check import chips
from pipeline.generate.tpu_check.chips import GIB
from pipeline.generate.tpu_check.context import Context
from pipeline.generate.tpu_check.errors import DoesNotFit
from pipeline.generate.tpu_check.messages import refusal
from pipeline.generate.tpu_check.report import check
from pipeline.generate.tpu_check.search import largest_batch
from pipeline.generate.tpu_check.step_parts import parts_memory


def size_settings(settings, name: str):
    """The settings of size ``name`` of a run of several, as a single-size run's."""
    width, height = buckets.parse_size(name)
    return settings.replace(width=width, height=height, sizes=(), bucket_batches=())


def check_sizes(settings, target: chips.Target, most: int = fit.MOST_PER_DEVICE) -> tuple[object, list[dict]]:
    """(``settings`` with each size's per-device batch, auto's choice or the one asked for;
    one report per size, in the run's order). Each report is a whole program's
    ``tpu_program`` report (``confirmed``: "whole program") or the parts' prediction
    (``confirmed``: "parts", ``total_gib`` estimated). DoesNotFit naming the first size
    that does not fit, with its figures."""
    names = list(settings.sizes)
    auto = settings.per_device_batch == "auto"
    limit, _ = chips.capacity(target)
    contexts = {name: Context.of(size_settings(settings, name).replace(per_device_batch=1), target)
                for name in names}
    at_one = {name: parts_memory(contexts[name], 1, limit) for name in names}
    heaviest = max(names, key=lambda name: (at_one[name], -names.index(name)))
    heavy = size_settings(settings, heaviest)
    asked = dict(zip(names, settings.bucket_batches or [settings.per_device_batch] * len(names)))
    if auto:
        batch, _ = largest_batch(heavy, target, most)
    else:
        batch = asked[heaviest]
    measured = check(heavy, target, batch)
    if not measured["fits"]:
        raise DoesNotFit(f"size {heaviest}: {refusal(measured, None)}")
    weights = contexts[heaviest].weights()
    total = int(measured["total_gib"] * GIB)
    beyond = parts_memory(contexts[heaviest], batch, limit)
    scale = (total - weights) / beyond if beyond > 0 and total > weights else 1.0
    reports, batches = {heaviest: {**measured, "size": heaviest, "confirmed": "whole program"}}, {heaviest: batch}
    for name in names:
        if name == heaviest:
            continue
        context = contexts[name]

        def needs(b: int, context=context) -> int:
            return context.weights() + math.ceil(scale * parts_memory(context, b, int((limit - weights) / scale)))

        if auto:
            try:
                chosen, predicted = fit.largest_batch(needs, limit, most)
            except fit.FitError:
                chosen, predicted = 1, {1: needs(1)}
        else:
            chosen = asked[name]
            predicted = {chosen: needs(chosen)}
        if predicted[chosen] <= total:  # no more than a program measured to fit: settled
            reports[name] = {**measured, "size": name, "width": context.width, "height": context.height,
                             "per_device_batch": chosen, "total_gib": round(predicted[chosen] / GIB, 3),
                             "argument_gib": None, "temp_gib": None, "compile_s": 0.0, "confirmed": "parts",
                             "fits": True}
            batches[name] = chosen
            continue
        sized = size_settings(settings, name)
        report = check(sized, target, chosen)
        if not report["fits"] and auto:
            chosen, _ = largest_batch(sized, target, most)
            report = check(sized, target, chosen)
        if not report["fits"]:
            raise DoesNotFit(f"size {name}: {refusal(report, None)}")
        reports[name], batches[name] = {**report, "size": name, "confirmed": "whole program"}, chosen
    ordered = [reports[name] for name in names]
    logs.event("tpu_sizes_checked", tpu_type=target.tpu_type, heaviest=heaviest, scale=round(scale, 4),
               sizes={r["size"]: {"per_device_batch": r["per_device_batch"], "total_gib": r["total_gib"],
                                  "confirmed": r["confirmed"]} for r in ordered},
               whole_programs=sum(r["confirmed"] == "whole program" for r in ordered))
    chosen = tuple(batches[name] for name in names)
    if auto:
        settings = settings.replace(per_device_batch=chosen[0], bucket_batches=chosen)
    return settings.validate(), ordered
