"""What the parts of a step (``parts.parts``: the text encoders, one denoiser call, the
VAE decode) need on one chip, each compiled only up to XLA's buffer assignment in a
compiling child of its own: what predicts the largest batch (``search``)."""
from __future__ import annotations

import contextlib

from pipeline.generate import compile_process, parts
from pipeline.generate.tpu_check import chips, child, compiling
from pipeline.generate.tpu_check.errors import TpuCheckError
from pipeline.generate.tpu_check.messages import describe_settings
from pipeline.generate.tpu_check.program import nbytes
from pipeline.generate.tpu_check.remember import remembered


def parts_memory(context, per_device_batch: int, enough: int | None = None) -> int:
    """The most bytes any part of a step of ``context``'s run needs beyond its own weights,
    at ``per_device_batch`` images per chip, compiled for one of its target's chips: the
    text encoders (2B rows when guided), one denoiser call, the VAE decode (B, or the run's
    decode micro-batch when it is smaller: ``lowered_parts``), each with
    the run's attention on the TPU platform. Remembered like a whole program's figures, so
    a search that was stopped goes on where it was, compiling again none of the parts it
    had compiled.

    ``enough``: bytes past which the answer no longer matters (the program would not fit).
    The parts are then compiled from the last, the VAE decode (the one that needs the most
    at large batches), and the first part past ``enough`` ends it: what is returned and
    remembered is a lower bound, used again only where it still says "too much".

    A part that crashes libtpu's compiler does not compile: past any ``enough`` (the
    batch cannot run), and a TpuCheckError where the figure itself is needed."""
    def make():
        try:
            beyond, complete = _compiled_parts_memory(context, per_device_batch, enough)
        except compile_process.Crashed as e:
            child.note_crash(e, context, per_device_batch, "the parts of a step")
            return {"beyond": None, "crashed": e.signal_name}
        return {"beyond": beyond} if complete else {"beyond": beyond, "at_least": True}

    def usable(found):
        return (not found.get("at_least") or found.get("crashed") is not None
                or (enough is not None and found["beyond"] > enough))

    found, _ = remembered("parts", context.settings, context.target, per_device_batch, make, usable)
    if found.get("crashed"):
        if enough is None:
            raise TpuCheckError(f"libtpu's compiler crashed ({found['crashed']}) on a part of a step of "
                                f"{describe_settings(context.settings)} at {per_device_batch} image(s) per "
                                f"{context.target.tpu_type} chip, so what the batch needs cannot be estimated: try "
                                f"another attention or size")
        return enough + 1
    return found["beyond"]


def _compiled_parts_memory(context, per_device_batch: int, enough: int | None = None) -> tuple[int, bool]:
    """(the most bytes a part needs beyond its weights, whether every part was compiled):
    each part in a compiling child of its own (``assigned_part``), from the last, the VAE
    decode, up to the first."""
    most, index, count = 0, 1, None
    while count is None or index <= count:
        beyond, count = child.compiled(assigned_part, context, per_device_batch, -index)
        most = max(most, beyond)
        if enough is not None and most > enough:
            return most, index == count
        index += 1
    return most, True


def assigned_part(context, per_device_batch: int, index: int) -> tuple[int, int]:
    """(the bytes part ``index`` of a step (``parts.parts``' order) of ``context``'s run
    needs beyond its own weights on one of its target's chips, by XLA's buffer assignment
    (``compiling.assigned_figures``); how many parts there are): a compiling child's call."""
    programs = lowered_parts(context, per_device_batch)
    _, components, lowered = programs[index]
    found = compiling.assigned_figures(lowered, context.target)
    weights = sum(nbytes(context.model.params[name]) for name in components)
    return (found["refused_temp"] if "refused_temp" in found else found["total"] - weights), len(programs)


def lowered_parts(context, per_device_batch: int) -> list:
    """``parts.parts`` of ``context``'s run, lowered for one of its target's chips with the
    run's attention on the TPU platform; the VAE decode at the run's decode micro-batch
    where it is smaller than ``per_device_batch`` (the program decodes that many at a
    time: ``pipeline.model.sampling.decoding``)."""
    import jax

    from pipeline.model.layers import attention

    single = jax.sharding.SingleDeviceSharding(chips.host_devices(context.target)[0])

    @contextlib.contextmanager
    def seam():
        with attention.use(context.settings.attention, platform="tpu"):
            yield

    found = parts.parts(context.model, context.width, context.height, per_device_batch, context.guided, seam=seam,
                        sharding=single)
    micro = context.settings.decode_batch
    if micro is None or micro >= per_device_batch:
        return found
    decode = parts.lowered(context.model, context.width, context.height, micro, context.guided, "vae_decode",
                           seam=seam, sharding=single)
    return [(label, components, decode if label == "vae_decode" else program)
            for label, components, program in found]
