"""What the plan decides once the run is counted, before any slice is written: whether
its program is guided, how large its per-device batch is (when ``auto`` chose one for
this plan), and how many batches a slice holds (when ``auto``). Each decision is written
to run.json, as every setting is, so every later stage reads it back.
"""
from __future__ import annotations

import dataclasses

from pipeline.core import logs, slicing
from pipeline.core.settings import AUTO, MAX_BATCHES_PER_SLICE, Settings
from pipeline.io import runs
from pipeline.model import families
from pipeline.plan.layout import Layout, PlanError


def decide(layout: Layout, out: str, cap_hosts: int | None = None) -> Layout:
    """``decide_guidance``, ``decide_per_device_batch``, then ``decide_batches_per_slice``;
    the layout with the run's slice size, as run.json now holds it."""
    layout = decide_guidance(layout, out)
    decide_per_device_batch(layout, out, cap_hosts)
    settings = decide_batches_per_slice(layout, out)
    sizes = [slicing.slice_size(settings.devices_per_host, batch, settings.batches_per_slice)
             for _, _, batch in settings.buckets()]
    return dataclasses.replace(layout, slice_size=settings.slice_size, bucket_slice_sizes=sizes)


def decide_per_device_batch(layout: Layout, out: str, cap_hosts: int | None) -> Settings:
    """The run's settings, once ``out``'s run.json holds a per-device batch no larger than
    the run can fill on ``cap_hosts`` hosts (``slicing.most_per_device``), when the batch
    was chosen by ``--per-device-batch auto`` for this plan (``cap_hosts`` not None; a
    resumed run keeps the batch its slices were cut with). The batch recorded is logged
    (``per_device_batch_chosen``, beside the largest that fits), and as
    ``per_device_batch_capped`` where lowered."""
    run = runs.read(out)
    settings = run.settings
    if cap_hosts is None:
        return settings
    fits = [batch for _, _, batch in settings.buckets()]
    counts = layout.bucket_images or [layout.images]
    most = [slicing.most_per_device(images, cap_hosts, settings.devices_per_host) for images in counts]
    capped = [min(fit, top) for fit, top in zip(fits, most)]
    for (width, height, fit), chosen, images in zip(settings.buckets(), capped, counts):
        size = {"size": f"{width}x{height}"} if settings.sizes else {}
        if fit > chosen:
            logs.event("per_device_batch_capped", out=out, fits=fit, per_device_batch=chosen, images=images,
                       hosts=cap_hosts, devices_per_host=settings.devices_per_host, **size)
        logs.event("per_device_batch_chosen", out=out, per_device_batch=chosen, fits=fit, **size)
    if capped == fits:
        return settings
    settings = settings.replace(per_device_batch=capped[0],
                                bucket_batches=tuple(capped) if settings.bucket_batches else ()).validate()
    runs.write(out, run.with_settings(settings))
    return settings


def decide_batches_per_slice(layout: Layout, out: str) -> Settings:
    """The run's settings, once ``out``'s run.json holds its batches per slice: a run asking
    for ``auto`` gets ``slicing.auto_batches_per_slice`` of its images (every size's),
    logged as ``batches_per_slice_decided``; a number given, or kept by a resumed run, stays."""
    run = runs.read(out)
    settings = run.settings
    if settings.batches_per_slice != AUTO:
        return settings
    batches = slicing.auto_batches_per_slice(layout.images, settings.devices_per_host, settings.per_device_batch,
                                             MAX_BATCHES_PER_SLICE)
    settings = settings.replace(batches_per_slice=batches).validate()
    runs.write(out, run.with_settings(settings))
    logs.event("batches_per_slice_decided", out=out, batches_per_slice=batches, images=layout.images,
               slice_size=settings.slice_size)
    return settings


def decide_guidance(layout: Layout, out: str) -> Layout:
    """Record in ``out``'s run.json whether the run is guided (some kept record's guidance
    asks for it under the run's rule); returns the layout. A run that already recorded the other choice is refused: its images would
    mix two programs."""
    run = runs.read(out)
    settings = run.settings
    rule = families.guidance_rule(settings.guidance_rule)
    if not rule.classifier_free:  # a family without classifier-free guidance: decided when prepared
        return layout
    guided = layout.guided
    if guided and not rule.asks(settings.guidance_scale):
        layout = dataclasses.replace(layout, guided_by_records=True)  # the manifest and status say so
    if settings.guided is None:
        settings = settings.replace(guided=guided).validate()
        runs.write(out, run.with_settings(settings))
        logs.event("guidance_decided", out=out, guided=guided)
    elif settings.guided != guided:
        planned = "guided" if settings.guided else "guidance-free"
        now = f"some record's guidance is > {rule.above:g}" if guided else f"no record's guidance is > {rule.above:g}"
        raise PlanError(f"{out} holds a {planned} run, but now {now}: the run's images would mix two programs; "
                        "use another --out, or add --overwrite to start over")
    return layout
