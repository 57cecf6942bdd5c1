"""Samplers compiled once per bench run.

Several parts of ``bench generator`` time the same sampler: the sweep at its first batch
size, the ``cfg`` recipe, ``auto`` in the attention part, the scoring part's ``cfg``.
``Programs`` keys each sampler by the text of its lowered program and the devices it
runs on, so two parts share an executable only when they run the same program; each
part still builds its own Generator (its own timing, its own params) on it. On a real
model that is minutes of compilation saved per repeated program.
"""
from __future__ import annotations

import hashlib

from pipeline.core.decode_batch import DECODE_BATCH


class Programs:
    """``decode_batch``: the VAE decode micro-batch of every sampler built here (the bench
    run's; default: what a new run decodes in, ``DECODE_BATCH``; None: whole)."""

    def __init__(self, decode_batch: int | None = DECODE_BATCH):
        self.decode_batch = decode_batch
        self._compiled: dict[str, object] = {}
        self.shared = 0  # Generators built on a program compiled for an earlier one

    @property
    def compiled(self) -> int:
        return len(self._compiled)

    def generator(self, model, width: int, height: int, steps: int, per_device_batch: int, devices, *,
                  guided: bool = True, params=None, attention: str = "auto"):
        """The ``Generator`` of that program (the "diffusers" guidance rule) on ``devices`` at
        this bench run's ``decode_batch``, its sampler compiled here only if no earlier call
        lowered the same program for the same devices."""
        from pipeline.generate.generator import Generator, compile_sampler, lower_sampler
        from pipeline.generate.spec import ProgramSpec

        spec = ProgramSpec(width, height, steps, per_device_batch, guided=guided, attention=attention,
                           decode_batch=self.decode_batch)
        lowered = lower_sampler(model, spec, devices)
        key = hashlib.sha256(repr([d.id for d in devices]).encode() + lowered.as_text().encode()).hexdigest()
        program = self._compiled.get(key)
        if program is None:
            program = self._compiled[key] = compile_sampler(model, spec, devices, lowered=lowered)
        else:
            self.shared += 1
        return Generator(model, spec, devices, params=params, program=program)
