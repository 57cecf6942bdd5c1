"""The host's sampler program, described once (``ProgramSpec``).

Everything that lowers, compiles, measures or runs the sampler takes one spec instead of
loose arguments: the generator, ``compile_sampler`` and ``lower_sampler``, the sampling
function, the fit of ``--per-device-batch auto`` and the TPU check. It is built once from
a planned run's settings (``of``: every ``auto`` resolved, the plan's decision of whether
the run is guided) or, by a bench or a test, field by field; ``description`` is what the
executable cache's index is keyed on (with the checkpoint's configs), and a spec is a
dict key of its own (frozen), so processes that hold several programs tell them apart
by it.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """One sampler program: the image size, the sampler's steps and the per-device batch it
    is compiled for; the guidance rule and whether the program is the guided one (a
    guidance-free program never reads a negative prompt); whether it returns the final
    latents too; the attention implementation; the FSDP degree of the weights (1: a whole
    copy on each device); how many images the VAE decodes at a time (None: all at once).

    The model side (the checkpoint, its dtype, scheduler and timestep spacing, the text
    encoders' sequence length) comes with the model a program is lowered from; a spec
    built from settings (``of``) carries their names too, for ``description``."""
    width: int
    height: int
    steps: int
    per_device_batch: int
    guidance_rule: str = "diffusers"
    guided: bool = True
    latents: bool = False
    attention: str = "auto"
    fsdp: int = 1
    decode_batch: int | None = None
    # the model side, as the settings name it (``of``); None where the spec is built from a model alone
    model: str | None = None
    dtype: str | None = None
    scheduler: str | None = None
    timestep_spacing: str | None = None
    max_sequence_length: int | None = None

    @classmethod
    def of(cls, settings) -> ProgramSpec:
        """The program of a planned run's ``settings`` (``Settings``: sizes, steps, batch and
        FSDP degree resolved, ``guided`` decided by the plan)."""
        s = settings
        return cls(s.width, s.height, s.steps, s.per_device_batch, s.guidance_rule, s.guided, s.save_latents,
                   s.attention, s.fsdp, s.decode_batch, model=s.model, dtype=s.dtype, scheduler=s.scheduler,
                   timestep_spacing=s.timestep_spacing, max_sequence_length=s.max_sequence_length)

    def at(self, **changes) -> ProgramSpec:
        """This program with ``changes`` (e.g. another ``per_device_batch`` while a fit searches)."""
        return dataclasses.replace(self, **changes)

    def description(self) -> dict:
        """What the program is made of, for the executable cache's index
        (``compile_cache.index_key``): the checkpoint's configs and tokenizer files (never its
        weights: --unet and --lora change values, not shapes) and every field of the spec.
        ``max_sequence_length``, ``fsdp`` and ``decode_batch`` are there only where they are
        not their defaults, so such a program keeps the key it had before each was a setting."""
        from pipeline.model import load as model_lib

        if self.model is None:
            raise ValueError("a program spec built without its model's name has no description")
        return {"checkpoint": model_lib.program_digest(self.model), "dtype": self.dtype, "scheduler": self.scheduler,
                "timestep_spacing": self.timestep_spacing, "width": self.width, "height": self.height,
                "steps": self.steps, "per_device_batch": self.per_device_batch, "latents": self.latents,
                "guidance_rule": self.guidance_rule, "guided": self.guided, "attention": self.attention,
                **({"max_sequence_length": self.max_sequence_length} if self.max_sequence_length is not None else {}),
                **({"fsdp": self.fsdp} if self.fsdp != 1 else {}),
                **({"decode_batch": self.decode_batch} if self.decode_batch is not None else {})}
