"""The attention parts of ``bench generator``: each ``--attention`` side by side.

- ``attention``: one generator per implementation at the bench's size and first
  per-device batch, all on one replicated copy of the weights, timed batch by batch in
  turns, each with its compiled program's memory (XLA's ``memory_analysis()``) and the
  kernels its attention calls ran; images/s relative to the first implementation
  listed (by default ``xla``: the whole attention matrix).
- ``memory``: the sampler program of each implementation at each of the square
  ``--memory-sizes``, compiled from shapes alone (no weights are read, so the largest
  sizes can be measured on any machine), with its temp per image and how temp grows
  from the smallest size to the largest, next to how the pixels grow.
"""
from __future__ import annotations

from pipeline.core import logs


def _kernels(model, width: int, height: int, per_device_batch: int, guided: bool, *, attention: str,
             platform: str) -> dict:
    """{kernel: attention calls} of one sampler step's UNet call and VAE decode, as the
    seam chooses them (traced from shapes; nothing compiles)."""
    import contextlib

    from pipeline.generate import parts
    from pipeline.model.layers import attention as attention_lib

    calls = []

    def seam():
        @contextlib.contextmanager
        def block():
            with attention_lib.use(attention, platform=platform) as traced:
                yield
            calls.extend(traced)
        return block()

    parts.parts(model, width, height, per_device_batch, guided, seam=seam)
    counted: dict[str, int] = {}
    for call in calls:
        counted[call.kernel] = counted.get(call.kernel, 0) + 1
    return counted


def run_speed(model, config, devices, width: int, height: int, programs=None) -> dict:
    """Images/s, program memory and kernels of each of ``config.attentions``, in turns.
    ``programs``: the bench run's compiled samplers (``pipeline.bench.programs``)."""
    from pipeline.bench.programs import Programs
    from pipeline.bench.timing import in_turns, ours_call
    from pipeline.generate.fit import program_memory
    from pipeline.generate.generator import replicate

    programs = programs or Programs(config.decode_batch)
    per_device_batch = config.per_device_batches[0]
    shared = replicate(model.params, devices)
    calls, rows = {}, {}
    for attention in config.attentions:
        generator = programs.generator(model, width, height, config.steps, per_device_batch, devices,
                                       guided=config.guided, params=shared, attention=attention)
        calls[attention] = ours_call(generator, config.guidance_scale)
        program = program_memory(generator.compiled)
        rows[attention] = {"batch_size": generator.batch_size, "memory": program,
                           "temp_per_image": program.get("temp", 0) / per_device_batch,
                           "kernels": _kernels(model, width, height, per_device_batch, config.guided,
                                               attention=attention, platform=devices[0].platform)}
    timings = in_turns(calls, {name: row["batch_size"] for name, row in rows.items()}, config.batches)
    first = config.attentions[0]
    for name, row in rows.items():
        row.update(timings[name])
        row["over_first"] = row["images_per_s"] / timings[first]["images_per_s"]
    logs.event("bench_attention", **{name: round(row["images_per_s"], 4) for name, row in rows.items()},
               relative_to=first)
    return {"per_device_batch": per_device_batch, "width": width, "height": height, "relative_to": first,
            "implementations": rows}


def run_memory(config, platform: str, speed: dict | None = None) -> dict:
    """Program memory of each of ``config.attentions`` at each of ``config.memory_sizes``.

    ``speed``: the attention part's result; its programs' memory is reused for its own
    size when that is one of the (square) sizes: a program compiled from shapes on one
    device has the memory of the host's program per device (``fit.sampler_memory``)."""
    from pipeline.generate.fit import sampler_memory
    from pipeline.generate.spec import ProgramSpec
    from pipeline.model import load as model_lib

    model = model_lib.load(config.model, dtype=config.dtype, scheduler=config.scheduler,
                           timestep_spacing=config.timestep_spacing, abstract=True)
    per_device_batch = config.per_device_batches[0]
    sizes = sorted(config.memory_sizes)
    rows = []
    known = {}
    if speed and speed["width"] == speed["height"] and speed["per_device_batch"] == per_device_batch:
        known = {(name, speed["width"]): row["memory"] for name, row in speed["implementations"].items()}
    for attention in config.attentions:
        for size in sizes:
            program = known.get((attention, size)) or sampler_memory(
                model, ProgramSpec(size, size, config.steps, per_device_batch, model.family.guidance_rule(model),
                                   config.guided, attention=attention, decode_batch=config.decode_batch), platform)
            rows.append({"attention": attention, "size": size, "memory": program,
                         "measured": "attention part" if (attention, size) in known else "from shapes",
                         "temp_per_image": program.get("temp", 0) / per_device_batch,
                         "total_per_image": program.get("total", 0) / per_device_batch})
            logs.event("bench_memory", attention=attention, size=size,
                       temp_gib=round(program.get("temp", 0) / 2 ** 30, 3))
    growth = {}
    if len(sizes) > 1:
        for attention in config.attentions:
            temp = {row["size"]: row["temp_per_image"] for row in rows if row["attention"] == attention}
            growth[attention] = temp[sizes[-1]] / temp[sizes[0]]
    return {"per_device_batch": per_device_batch, "sizes": sizes, "rows": rows,
            "pixel_growth": (sizes[-1] / sizes[0]) ** 2, "temp_growth": growth}
