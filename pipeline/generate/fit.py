"""What a sampler program needs of a device's memory, and the largest per-device batch
that fits (``--per-device-batch auto``).

The sampler is lowered and compiled from shapes alone (``load(abstract=True)``: no
weight is read), for the platform of the devices that plan, exactly as a host would
compile it: same model, size, steps, guidance and attention. XLA's buffer assignment
(``compiled.memory_analysis()``) then says what it needs before anything runs:
arguments (the weights and the batch's inputs), outputs, and temporaries, the most
intermediate bytes alive at once.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from pipeline.core import buckets, logs
from pipeline.generate.spec import ProgramSpec
from pipeline.model.sampling import decoding, guidance

GIB = 2 ** 30
# The share of a device's memory that a program may take: the rest is the runtime's,
# the allocator's fragmentation and the next batch's inputs
HEADROOM = 0.9
# The most images per device that ``auto`` considers
MOST_PER_DEVICE = 256


class FitError(ValueError):
    pass


def program_memory(compiled) -> dict:
    """Bytes of a compiled program, from XLA's ``memory_analysis()``: ``temp``,
    ``argument``, ``output``, ``alias`` (output bytes that reuse argument buffers),
    ``generated_code`` and ``total`` (argument + output - alias + temp: what the program
    needs on the device while it runs). Backends that report nothing give {}."""
    stats = compiled.memory_analysis()
    if isinstance(stats, (list, tuple)):  # one entry per program on some backends
        stats = stats[0] if stats else None
    if stats is None:
        return {}
    memory = {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in
              ("temp", "argument", "output", "alias", "generated_code")}
    memory["total"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    return memory




def sampler_memory(model, spec: ProgramSpec, platform: str | None = None, devices=None) -> dict:
    """``program_memory`` of one device's program of ``spec`` (at its ``per_device_batch``
    images), compiled from shapes (``model``'s params may be arrays or
    ``ShapeDtypeStruct``s). At ``spec.fsdp`` > 1: the FSDP program of one group of that
    many of ``devices`` (a device's memory is the same in a host of one group or of many);
    at 1, the per-device program every device of a host runs (``generator.per_device_program``)."""
    import jax
    import jax.numpy as jnp

    from pipeline.generate import sampler
    from pipeline.model.shapes import struct

    if spec.fsdp != 1:
        from pipeline.generate.generator import lower_sampler

        devices = list(devices or jax.local_devices())
        if len(devices) < spec.fsdp:
            raise FitError(f"--fsdp {spec.fsdp}: measuring its program needs {spec.fsdp} devices, this process has "
                           f"{len(devices)}")
        return program_memory(lower_sampler(model, spec, devices[:spec.fsdp]).compile())
    fn = sampler.make_sample_fn(model, spec, platform)
    params = struct(model.params, model.param_dtype)
    b = spec.per_device_batch
    ids = jax.ShapeDtypeStruct((b, *model.family.tokenize(model, [""]).shape[1:]), jnp.int32)
    words = jax.ShapeDtypeStruct((b,), jnp.uint32)
    lowered = jax.jit(fn).lower(params, ids, ids, jax.ShapeDtypeStruct((b,), jnp.float32), words, words, words)
    return program_memory(lowered.compile())


def fit_spec(settings, model, width: int, height: int, guided: bool) -> ProgramSpec:
    """The program a fit measures for ``settings`` (before planning: the model's own guidance
    rule and default steps, a ``decode_batch`` of "auto" as planning resolves it), at one
    image per device; the fit varies ``per_device_batch`` and ``fsdp``."""
    return ProgramSpec(width, height, model.steps(settings.steps), 1, model.family.guidance_rule(model), guided,
                       settings.save_latents, settings.attention,
                       settings.fsdp if isinstance(settings.fsdp, int) else 1,  # "auto": the fit of --fsdp varies it
                       decoding.planned(settings.decode_batch))


def largest_batch(needs: Callable[[int], int], capacity: int, most: int = MOST_PER_DEVICE) -> tuple[int, dict]:
    """(the largest b in 1..``most`` with ``needs(b) <= capacity``, {b: needs(b)} of every
    b tried); FitError when even b = 1 does not fit. Pure but for ``needs``.

    ``needs`` is taken to grow with b, as a program's memory does, and to be costly (a
    compilation): two lines predict the answer, each checked with the b after it, then the
    rest is bisected between the largest b known to fit and the smallest known not to.
    The first line runs through b = 1 and 2. The second runs through the two b that
    bound the answer, or, when every b tried fit, through 2 and the largest: a program
    whose first images cost more than the next ones (SD 1.5 at 512x512 on a v5e chip: its
    VAE decode's temporaries grow 1.1 GiB from one image to two, 10 GiB more by 29 images,
    then 0.5 GiB from 29 to 48) is found in a few steps, not by bisecting up to ``most``.
    """
    tried: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in tried:
            tried[b] = needs(b)
        return tried[b] <= capacity

    def reaches(a: int, b: int) -> int:  # where the line through a and b meets the capacity
        slope = (tried[b] - tried[a]) / (b - a)
        return most if slope <= 0 else a + int((capacity - tried[a]) // slope)

    if not fits(1):
        raise FitError(f"one image per device needs {tried[1] / GIB:.2f} GiB, more than the "
                       f"{capacity / GIB:.2f} GiB the device offers")
    if most == 1 or not fits(2):
        return 1, tried
    low, high = 2, most + 1  # low fits; high does not (most + 1: never tried)
    for line in ((1, 2), None):
        if high - low <= 1:
            break
        start, end = line or ((low, high) if high <= most else (2, low))
        guess = min(max(reaches(start, end), low + 1), high - 1)
        for b in (guess, guess + 1):
            if low < b < high:
                if fits(b):
                    low = b
                else:
                    high = b
                    break
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, tried


def device_capacity(devices, device_memory_gib: float | None = None, devices_on_machine: int | None = None
                    ) -> tuple[int, str]:
    """(bytes one device's program may take, where that figure came from).

    ``device_memory_gib`` (``--device-memory``) wins; else the device's own allocator
    limit (``memory_stats()["bytes_limit"]``, on GPU and TPU); else, for CPU devices, the
    machine's physical memory shared by the ``devices_on_machine`` devices that run on
    it (default: this process's). ``HEADROOM`` of it is offered.
    """
    if device_memory_gib is not None:
        total, source = device_memory_gib * GIB, "--device-memory"
    else:
        stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
        if stats and stats.get("bytes_limit"):
            total, source = stats["bytes_limit"], f"{devices[0].device_kind} bytes_limit"
        else:
            machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            total = machine / (devices_on_machine or len(devices))
            source = f"machine memory / {devices_on_machine or len(devices)} devices"
    return int(total * HEADROOM), source


def choose_per_device_batch(settings, devices=None, devices_on_machine: int | None = None) -> int:
    """The largest per-device batch whose sampler program (weights, inputs, outputs and
    temporaries) fits one device of ``devices`` (default: this process's local devices),
    for ``settings``' model, size, steps, dtype, guidance and attention; logged as the
    ``per_device_batch_fits`` event (the plan may record a smaller one: ``plan.decide``)."""
    import jax

    from pipeline.model import load as model_lib

    devices = devices or jax.local_devices()
    capacity, source = device_capacity(devices, settings.device_memory, devices_on_machine)
    model = model_lib.load(model_lib.LoadRequest.of(settings), abstract=True)
    width, height = model.size(settings.width, settings.height)
    guided = guidance.guided_before_planning(settings, model)  # the one rule, as the TPU check's
    platform = devices[0].platform

    spec = fit_spec(settings, model, width, height, guided)

    def needs(b: int) -> int:
        return sampler_memory(model, spec.at(per_device_batch=b), platform, devices)["total"]

    try:
        chosen, tried = largest_batch(needs, capacity)
    except FitError as e:
        raise FitError(f"--per-device-batch auto: {e} ({source}) for {settings.model} at "
                       f"{width}x{height}, {settings.dtype}, --attention {settings.attention}") from e
    logs.event("per_device_batch_fits", per_device_batch=chosen, capacity_gib=round(capacity / GIB, 3),
               capacity_from=source, platform=platform,
               tried_gib={b: round(n / GIB, 3) for b, n in sorted(tried.items())})
    return chosen


def resolve_per_device_batch(settings, overwrite: bool = False, devices_on_machine: int | None = None):
    """``settings`` with ``--fsdp auto`` (``resolve_fsdp``, first) and ``--per-device-batch
    auto`` made numbers: the one of the run already in OUT, which a resumed run keeps
    (unless ``overwrite``), else ``choose_per_device_batch``'s at the run's FSDP degree.
    Other settings are returned as they are."""
    from pipeline.core.settings import AUTO

    settings = resolve_sizes(settings.validate())  # bad settings fail first
    if AUTO in (settings.per_device_batch, settings.fsdp):
        _check_sizes(settings)  # before compiling at them
    settings = resolve_fsdp(settings, overwrite, devices_on_machine)
    if settings.per_device_batch != AUTO:
        return settings
    if settings.sizes:  # each size its own: a smaller image may fit more
        return _kept_or_chosen(settings, overwrite, ("per_device_batch", "bucket_batches"),
                               lambda: choose_bucket_batches(settings, devices_on_machine=devices_on_machine))
    return _kept_or_chosen(settings, overwrite, "per_device_batch",
                           lambda: choose_per_device_batch(settings, devices_on_machine=devices_on_machine))


def _check_sizes(settings) -> None:
    """ValueError unless the run's sizes are ones its model's family makes, as the plan
    checks them (``families.size_problem``)."""
    from pipeline.model import families, load as model_lib

    problem = families.size_problem(settings, model_lib.describe(model_lib.LoadRequest.of(settings)))
    if problem:
        raise ValueError(problem)


def resolve_sizes(settings):
    """``settings`` with ``--sizes common`` made the preset's sizes for the model's family
    (``buckets.preset_sizes``: scaled to its native area, rounded to its size unit), as
    planning makes them; other settings as they are."""
    if settings.sizes != (buckets.PRESET,):
        return settings
    from pipeline.model import load as model_lib

    described = model_lib.describe(model_lib.LoadRequest.of(settings))
    sizes = buckets.preset_sizes(described.native_size, described.size_multiple)
    return settings.replace(sizes=sizes, width=None, height=None).validate()


def choose_bucket_batches(settings, devices=None, devices_on_machine: int | None = None) -> dict:
    """``--per-device-batch auto`` for a run of several sizes: each size's largest batch
    (``choose_per_device_batch`` at its width and height); {per_device_batch: the first
    size's, bucket_batches: every size's}."""
    chosen = []
    for name in settings.sizes:
        width, height = buckets.parse_size(name)
        chosen.append(choose_per_device_batch(settings.replace(width=width, height=height, sizes=(),
                                                               bucket_batches=()), devices, devices_on_machine))
    return {"per_device_batch": chosen[0], "bucket_batches": tuple(chosen)}


def _kept_or_chosen(settings, overwrite: bool, name: str | tuple[str, ...], choose):
    """``settings`` with the setting ``name`` (asked for as auto) the run's already in OUT
    (a resumed run keeps it, logged as ``<name>_kept``) unless ``overwrite``, else ``choose()``.
    ``name`` may be several settings that ``choose()`` returns together, as a dict."""
    from pipeline.io import runs

    names = (name,) if isinstance(name, str) else name
    if not overwrite and runs.exists(settings.out):
        planned = runs.read(settings.out).settings
        kept = {n: getattr(planned, n) for n in names}
        logs.event(f"{names[0]}_kept", **kept, out=settings.out)
        return settings.replace(**kept).validate()
    chosen = choose()
    return settings.replace(**(chosen if isinstance(chosen, dict) else {name: chosen})).validate()


def choose_fsdp(settings, devices=None, devices_on_machine: int | None = None) -> int:
    """``--fsdp auto``: the smallest N dividing the devices per host whose program fits one
    image per device (weights, inputs and temporaries, as ``choose_per_device_batch``
    measures them); logged as ``fsdp_chosen``. FitError when none does."""
    import jax

    from pipeline.model import load as model_lib, sharding

    devices = devices or jax.local_devices()
    capacity, source = device_capacity(devices, settings.device_memory, devices_on_machine)
    model = model_lib.load(model_lib.LoadRequest.of(settings), abstract=True)
    # the weights are sharded once a run: the size of the most pixels decides (one image per device)
    width, height = max((buckets.parse_size(n) for n in settings.sizes), key=lambda wh: wh[0] * wh[1]) \
        if settings.sizes else model.size(settings.width, settings.height)
    guided = guidance.guided_before_planning(settings, model)
    spec = fit_spec(settings, model, width, height, guided)
    tried = {}
    for n in sharding.divisors(settings.devices_per_host):
        if n > len(devices):
            break
        tried[n] = sampler_memory(model, spec.at(fsdp=n), devices[0].platform, devices)["total"]
        if tried[n] <= capacity:
            logs.event("fsdp_chosen", fsdp=n, capacity_gib=round(capacity / GIB, 3), capacity_from=source,
                       tried_gib={k: round(v / GIB, 3) for k, v in tried.items()})
            return n
    raise FitError(f"--fsdp auto: one image per device needs "
                   f"{', '.join(f'{v / GIB:.2f} GiB at --fsdp {k}' for k, v in tried.items())}, more than the "
                   f"{capacity / GIB:.2f} GiB a device offers ({source}), for {settings.model} at {width}x{height}, "
                   f"{settings.dtype}")


def resolve_fsdp(settings, overwrite: bool = False, devices_on_machine: int | None = None):
    """``settings`` with ``--fsdp auto`` made a number: the run's already in OUT (a resumed
    run keeps it, unless ``overwrite``), else ``choose_fsdp``'s. Resolved before the
    per-device batch, which is then the largest that fits at that N."""
    from pipeline.core.settings import AUTO

    if settings.fsdp != AUTO:
        return settings
    return _kept_or_chosen(settings, overwrite, "fsdp", lambda: choose_fsdp(settings, devices_on_machine=devices_on_machine))


def cap_hosts(asked, hosts: int, overwrite: bool = False) -> int | None:
    """``hosts`` when ``asked`` (the settings as given) has ``--per-device-batch auto``
    chosen afresh for this plan, else None (a number was given, or a resumed run keeps the
    batch its slices were cut with). The plan then lowers auto's choice, the most that fits
    a device, to the most the run can fill on ``hosts`` hosts
    (``pipeline.plan.decide.decide_per_device_batch``): a larger batch would only run
    padding rows."""
    from pipeline.core.settings import AUTO
    from pipeline.io import runs

    if asked.per_device_batch != AUTO or (not overwrite and runs.exists(asked.out)):
        return None
    return hosts
