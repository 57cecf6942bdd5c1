"""The built-in random models, by ``--model`` name: SD-shaped ones (``pipeline.model.tiny``)
and FLUX.1-shaped ones (``pipeline.model.tiny_flux``), each built once per machine into
the cache and loaded like a user's checkpoint. Their images are noise.

Some are ``shapes_only``: real-size models whose weights are never written (the TPU
check, FLOP counts and memory benchmarks need their shapes alone); they cannot run.
"""
from __future__ import annotations

import os

from pipeline.model import tiny, tiny_flux
from pipeline.model.cache import cache_dir

PRESETS = {**tiny.PRESETS, **tiny_flux.PRESETS}
NAMES = tuple(PRESETS)


def ensure(name: str, shapes: bool = False) -> str:
    """The folder of the built-in model ``name`` (``shapes``: its configs alone will do)."""
    models = os.path.join(cache_dir(), "models")
    if name in tiny.PRESETS:
        return tiny.ensure(models, name, shapes=shapes)
    return tiny_flux.ensure(models, name, shapes=shapes)


def runnable() -> tuple[str, ...]:
    """The built-in models that have weights."""
    return tuple(name for name, preset in PRESETS.items() if not preset.get("shapes_only"))


def shapes_only() -> tuple[str, ...]:
    return tuple(name for name, preset in PRESETS.items() if preset.get("shapes_only"))
