"""The check's results kept in the compile cache's folder (``compile_cache.remember``),
keyed by what the program is made of and the target (``compile_cache.index_key``), so an
unchanged submission does not compile again."""
from __future__ import annotations

from pipeline.generate import compile_cache
from pipeline.generate.tpu_check import chips


def description(settings, target: chips.Target, per_device_batch, scorers: bool = False) -> dict:
    """What a remembered result is of; ``scorers``: with the scoring program's models (the
    sampler and its parts are the same programs with scores or without). A ``decode_batch``
    left "auto" is described as the one planning resolves it to (``Context.of``)."""
    from pipeline.generate.spec import ProgramSpec
    from pipeline.model.sampling import decoding

    described = ProgramSpec.of(settings.replace(
        per_device_batch=per_device_batch if per_device_batch is not None else 1,
        decode_batch=decoding.planned(settings.decode_batch))).description()
    if scorers and settings.scores:
        from pipeline.model.scorers import models

        described["scorers"] = models.program_description(settings)
    described.update({"per_device_batch": per_device_batch, "guided": settings.guided,
                      "guidance_scale": settings.guidance_scale,
                      "tpu_type": target.tpu_type, "chips": target.chips, "libtpu": chips.libtpu_version(),
                      "check": 2})
    return described


def remembered(kind: str, settings, target: chips.Target, per_device_batch, make, usable=lambda found: True):
    """(``make()`` (a JSON-able dict), or what it gave the last time for the same program
    on the same target, where ``usable`` says it will do; whether it was remembered)."""
    described = {"kind": kind, **description(settings, target, per_device_batch, kind in ("scorer", "largest"))}
    if kind == "largest":  # a compiled program's figures are the chip's; what fits depends on its memory
        described.update(hbm_gib=target.hbm_gib, usable_gib=target.usable_gib)
    key = compile_cache.index_key(described, chips.host_devices(target))
    found = compile_cache.recall(key)
    if found is not None and usable(found):
        return found, True
    value = make()
    compile_cache.remember(key, value)
    return value, False
