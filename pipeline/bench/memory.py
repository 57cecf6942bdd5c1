"""Device memory of compiled programs, from XLA's own buffer assignment.

``compiled.memory_analysis()`` reports what XLA assigned to a program before it runs:
its arguments (weights and inputs), outputs, the bytes outputs share with arguments
(aliases), and temporaries (every intermediate buffer, at the most that are alive at
once). Temporaries are what attention's [queries x keys] matrices inflate, and what
decides whether a resolution or a batch fits on a device next to its weights.

``part_memory`` measures the two parts where attention lives, one UNet call and one VAE
decode, each as its own program at the sampler's per-device shapes (the UNet at 2B
when guided), lowered from shapes alone: no weights are needed, so the largest sizes
can be measured on any machine.
"""
from __future__ import annotations

from pipeline.generate import parts

from pipeline.generate.fit import GIB, program_memory  # noqa: F401 (the bench's memory figures)


def in_gib(memory: dict, digits: int = 3) -> dict:
    """The same figures in GiB, rounded, for reports."""
    return {name: round(value / GIB, digits) for name, value in memory.items()}


def part_memory(model, width: int, height: int, per_device_batch: int, guided: bool = True, *,
                attention: str | None = "auto", platform: str | None = None, **seam) -> dict:
    """``program_memory`` of one UNet call (at 2B when ``guided``, else B) and of one VAE
    decode (at B), for B = ``per_device_batch``: {"denoiser_call": {...}, "vae_decode": {...}}.

    ``attention``: the seam's implementation (``pipeline.model.layers.attention.use``), or None
    for none (every call then runs ``xla``, the whole matrix); ``platform`` and ``seam`` (``budget_bytes``,
    ``block_tokens``) are passed to ``use``. ``model`` needs ``unet``, ``vae``, ``params``
    (arrays or ShapeDtypeStructs), ``dtype``, ``latent_shape`` and ``tokenizer``, as
    ``load.Model`` has.
    """
    import contextlib

    from pipeline.model.layers import attention as attention_lib

    def seam_block():
        if attention is None:
            return contextlib.nullcontext()
        return attention_lib.use(attention, platform=platform, **seam)

    return {label: program_memory(parts.lowered(model, width, height, per_device_batch, guided, part,
                                                seam=seam_block).compile())
            for label, part in (("denoiser_call", "denoiser"), ("vae_decode", "vae_decode"))}
