"""The most images per chip whose host program fits (``largest_batch``): the parts of a
step predict, the whole program decides (``search_largest``); and, for a refusal, about
how many would fit (``estimated_fit``)."""
from __future__ import annotations

import math

from pipeline.core import logs
from pipeline.generate import fit
from pipeline.generate.tpu_check import chips
from pipeline.generate.tpu_check.chips import GIB
from pipeline.generate.tpu_check.context import Context
from pipeline.generate.tpu_check.errors import DoesNotFit
from pipeline.generate.tpu_check.messages import refusal
from pipeline.generate.tpu_check.remember import remembered
from pipeline.generate.tpu_check.report import program_report
from pipeline.generate.tpu_check.step_parts import parts_memory


def largest_batch(settings, target: chips.Target, most: int = fit.MOST_PER_DEVICE) -> tuple[int, dict]:
    """(the most images per chip whose host program fits ``target``, {batch: estimated or
    compiled total bytes} of the search); DoesNotFit when one image does not.

    The parts of a step predict, the whole program decides (``search_largest``): no whole
    program is compiled but at the batches the parts point to, each a confirmation, and
    what one measured corrects the next prediction."""
    def make():
        return search_largest(Context.of(settings, target), most)

    found, _ = remembered("largest", settings, target, None, make)
    if found["batch"] is None:
        raise DoesNotFit(found["message"])
    return found["batch"], {int(b): n for b, n in found["tried"].items()}


def search_largest(context: Context, most: int) -> dict:
    """The whole program at b needs about its weights + ``scale`` x parts(b), what its
    largest part needs beyond its own weights: the parts' figures come from XLA's buffer
    assignment (``compiling.assigned_figures``), a little under what the whole compile
    finds, and the whole holds what only it holds (the latents, the text embeddings, the
    images). Before any whole program is compiled ``scale`` is 1, a lower bound; each
    whole program compiled sets it to what that one measured beyond its weights, over its
    parts. ``fit.largest_batch`` predicts from the parts, below ``high``, the smallest
    batch known not to fit; the whole program at the prediction decides, and the search
    ends when the parts, so corrected, say ``low`` + 1 does not fit, ``low`` the largest
    known to fit. A whole program at one image is compiled only where the parts say
    nothing fits (the refusal's figures, or the answer). A whole program that does not
    compile halves the gap next: XLA's refusal corrects nothing, and a compiler crash
    (``tpu_compile_crashed``) is one the parts cannot foresee, so after one the rest of
    the search is bisected."""
    target = context.target
    limit, _ = chips.capacity(target)
    whole: dict[int, dict] = {}

    def whole_total(b: int) -> int:
        if b not in whole:
            whole[b] = program_report(context, b)
        report = whole[b]
        return int(report["total_gib"] * GIB) if report["compiled"] else limit + 1

    weights = context.weights()
    scale, low, high, tried, halve, crashed = 1.0, 0, most + 1, {}, False, False
    while high - low > 1:
        def needs(b: int, scale=scale) -> int:  # past the limit, a part's exact figure does not matter
            return weights + math.ceil(scale * parts_memory(context, b, int((limit - weights) / scale)))

        if halve or crashed:
            chosen = (low + high) // 2
        else:
            try:
                chosen, tried = fit.largest_batch(needs, limit, high - 1)
            except fit.FitError:
                # the parts say none: the whole at 1 says why
                chosen, tried = (1 if low == 0 and 1 not in whole else 0), {}
            if chosen <= low:  # the parts, corrected, point at or below what fits; they need not grow with the
                def above(b: int, low=low) -> int:  # batch everywhere, so above low they are asked again
                    if low + b not in tried:
                        tried[low + b] = needs(low + b)
                    return tried[low + b]

                try:
                    chosen = low + fit.largest_batch(above, limit, high - 1 - low)[0]
                except fit.FitError:  # nor does low + 1 fit: the search ends
                    break
        logs.event("tpu_batch_predicted", tpu_type=target.tpu_type, per_device_batch=chosen, low=low,
                   high=high if high <= most else None, scale=round(scale, 4), halved=halve or crashed,
                   estimated_gib=round(tried[chosen] / GIB, 3) if chosen in tried and not (halve or crashed) else None)
        total = whole_total(chosen)
        if total <= limit:
            low = chosen
        else:
            high = chosen
        # a whole program XLA refused says nothing the parts can be corrected by: the next batch halves the
        # gap; one that crashed the compiler, a crash the parts' buffer assignment cannot see: so does every next
        halve, crashed = not whole[chosen]["compiled"], crashed or bool(whole[chosen].get("crashed"))
        beyond = parts_memory(context, chosen, limit)
        if high - low > 1 and whole[chosen]["compiled"] and 0 < beyond <= limit and total > weights:
            scale = (total - weights) / beyond  # what the whole needs beyond its weights, measured
    if low == 0:
        return {"batch": None, "tried": {1: whole_total(1)}, "message": refusal(whole[1], None)}
    logs.event("tpu_batch_searched", tpu_type=target.tpu_type, chips=target.chips, per_device_batch=low,
               limit_gib=round(limit / GIB, 3), whole_compiled=sorted(whole),
               estimated_gib={b: round(n / GIB, 3) for b, n in sorted(tried.items())})
    return {"batch": low, "tried": {**tried, **{b: whole_total(b) for b in whole}}, "message": None}


def estimated_fit(settings, target: chips.Target, report: dict, most: int = fit.MOST_PER_DEVICE) -> int | None:
    """For a refusal: about how many images per chip fit, from the refused program's own
    total (``report``) and how the parts of a step grow with the batch (no other whole
    program compiled: ``largest_batch`` confirms an answer, this one only estimates it).
    None when not even one is predicted to fit."""
    context = Context.of(settings, target)
    limit, _ = chips.capacity(target)
    asked = report["per_device_batch"]
    total = int(report["total_gib"] * GIB)
    base = parts_memory(context, asked)
    cache: dict[int, int] = {}

    def needs(b: int) -> int:
        if b not in cache:
            cache[b] = total + parts_memory(context, b, limit - total + base) - base
        return cache[b]

    try:
        found, _ = fit.largest_batch(needs, limit, min(most, max(1, asked - 1)))
    except fit.FitError:
        return None
    return found
