"""The registry of model families: what a checkpoint is made of, and how its images are made.

A family is one folder here (``families/<name>/``: its ``Family`` object, its denoiser,
its sampling, its built-in presets, its component table, its LoRA layer names), and
one line in ``BUILTIN``. Nothing outside its folder imports it: the rest of promptmill
asks this registry (``detect``, ``BY_NAME``, ``BUILTINS``) and calls the ``Family``
interface (``base``).

- ``sd``: SD 1.x/2.x (``sd``) and SDXL (``sdxl``): promptmill's own UNet (built from
  ``unet/config.json``), the shared CLIP text encoders and VAE decode, classifier-free
  guidance, the SD samplers;
- ``flux``: FLUX.1 [schnell] and [dev]: promptmill's own rectified-flow transformer,
  the shared T5 and CLIP-L encoders and 16-channel VAE decode (``pipeline.model.layers``),
  flow-matching Euler, and guidance embedded in the
  transformer ([dev]) or none ([schnell]);
- ``flux2``: FLUX.2 [klein], distilled and base: promptmill's own FLUX.2 transformer, the
  shared Qwen3 and the batch-norm VAE, guidance none (distilled) or classifier-free (base);
- ``zimage``: Z-Image (Turbo and base): promptmill's own single-stream transformer, the
  shared Qwen3 and 16-channel VAE, prompts of any length in one fixed-shape batch, its own
  guidance rule (above 0).

What families share lives once, beside them: ``base`` (the ``Family`` interface and the
defaults the built-in families share), ``qwen_text`` (FLUX.2's and Z-Image's plumbing and
sampling loop) and ``qwen_presets`` (their built-in checkpoints). None of them is a family.

A family that lives outside the package is registered without editing it, in every
process of a run (the hosts and Beam workers import this registry as the launcher
does): name its object as ``module:attribute`` in the ``PROMPTMILL_FAMILIES``
environment variable (comma-separated), or in the ``promptmill.families`` entry-point
group of an installed package. It is a ``Family`` whose name and pipeline classes no
other family has.
"""
from __future__ import annotations

import importlib
import os

from pipeline.model.families.base import Described, Family, Model  # noqa: F401 (the seam's types)
from pipeline.model.families.flux.family import FLUX
from pipeline.model.families.flux2.family import FLUX2
from pipeline.model.families.sd.family import SD, SDXL
from pipeline.model.families.zimage.family import ZIMAGE
from pipeline.model.sampling import guidance

BUILTIN: tuple[Family, ...] = (SD, SDXL, FLUX, FLUX2, ZIMAGE)
PLUGINS_ENV = "PROMPTMILL_FAMILIES"  # "module:attribute[,module:attribute...]": families outside the package
ENTRY_POINTS = "promptmill.families"  # the entry-point group of installed packages' families


class FamilyError(ValueError):
    pass


def _plugin(spec: str, where: str) -> Family:
    module, colon, attribute = spec.strip().partition(":")
    if not colon or not module or not attribute:
        raise FamilyError(f"{where}: {spec!r} must name a family as module:attribute")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise FamilyError(f"{where}: cannot import the family {spec!r}: {e}") from None
    if not isinstance(found, Family):
        raise FamilyError(f"{where}: {spec!r} is a {type(found).__name__}, not a promptmill Family")
    return found


def plugins() -> tuple[Family, ...]:
    """The families registered from outside the package: ``PLUGINS_ENV``, then the
    ``ENTRY_POINTS`` group."""
    from importlib import metadata

    found = [_plugin(spec, PLUGINS_ENV) for spec in os.environ.get(PLUGINS_ENV, "").split(",") if spec.strip()]
    for entry in metadata.entry_points(group=ENTRY_POINTS):
        found.append(_plugin(entry.value, f"entry point {entry.name} ({ENTRY_POINTS})"))
    return tuple(found)


def _registered() -> tuple[Family, ...]:
    families = list(BUILTIN)
    for family in plugins():
        if family in families:
            continue
        taken = {f.name for f in families}
        classes = {c for f in families for c in f.pipeline_classes}
        if family.name in taken or classes & set(family.pipeline_classes):
            raise FamilyError(f"the family {family.name!r} ({type(family).__module__}) takes a name or pipeline class "
                              f"that a registered family has")
        families.append(family)
    return tuple(families)


try:
    FAMILIES: tuple[Family, ...] = _registered()
    _BROKEN: FamilyError | None = None
except FamilyError as e:  # said by ``check`` (every command, ``detect``), not as a traceback at import
    FAMILIES, _BROKEN = BUILTIN, e


def check() -> None:
    """FamilyError, one line, when a family registered from outside the package could not be
    registered: nothing runs without a family that was asked for."""
    if _BROKEN is not None:
        raise _BROKEN
for _family in FAMILIES:  # each family's own guidance rules, beside the shared ones
    for _rule in _family.rules:
        guidance.register(_rule)
BY_NAME = {family.name: family for family in FAMILIES}
# the built-in random models (``--model tiny``, ...), by name: the family whose presets hold each
BUILTINS: dict[str, Family] = {name: family for family in FAMILIES for name in family.builtins()}


def guidance_rule(name: str) -> guidance.Rule:
    """The guidance rule a run records by ``name``: a shared one, or one a registered family
    brings (``guidance.UnknownRule`` when none does)."""
    return guidance.rule(name)


def builtin_folder(name: str, shapes: bool = False) -> str:
    """The folder of the built-in model ``name``, built once per machine (``shapes``: its
    configs alone will do, for what needs its shapes only)."""
    return BUILTINS[name].ensure_builtin(name, shapes)


def runnable_builtins() -> tuple[str, ...]:
    """The built-in models that have weights."""
    return tuple(name for name, family in BUILTINS.items() if not family.builtins()[name].get("shapes_only"))


def shapes_only_builtins() -> tuple[str, ...]:
    """The built-in models that are shapes alone (the TPU check, FLOP counts, memory benchmarks)."""
    return tuple(name for name in BUILTINS if name not in runnable_builtins())


def titles() -> str:
    """The families' titles for people ("SD 1.x/2.x, SDXL, FLUX.1"), in registry order."""
    return ", ".join(family.title for family in FAMILIES)


def _by_family(texts: dict) -> str:
    """``{title: text}`` joined for a help text, one family or a group of titles per text."""
    grouped: dict[str, list[str]] = {}
    for title, text in texts.items():
        if text:
            grouped.setdefault(text, []).append(title)
    named = {text: ", ".join(titles[:-1]) + " and " + titles[-1] if len(titles) > 1 else titles[0]
             for text, titles in grouped.items()}
    return "; ".join(f"{who}: {text}" for text, who in named.items())


def size_rules() -> str:
    """Each family's size rule, for help texts ("SD 1.x/2.x and SDXL: 8; FLUX.1: 16")."""
    return _by_family({family.title: family.size_rule for family in FAMILIES})


def steps_help() -> str:
    """Each family's default steps, for help texts ("SD 1.x/2.x and SDXL: 20; ...")."""
    return _by_family({family.title: family.steps_help for family in FAMILIES})


def size_problem(settings, described, sizes: tuple[str, ...] | None = None) -> str | None:
    """What is wrong with a side of the images of a run's ``settings`` (``--width``,
    ``--height``, each of ``sizes``: its ``--sizes`` unless given), by the rule of its model's
    family as ``load.describe`` gave it (``described``): a multiple of its size unit, at most
    its largest; None when nothing is."""
    from pipeline.core import buckets

    sizes = settings.sizes if sizes is None else sizes
    family, size, multiple = BY_NAME.get(described.family), described.native_size, described.size_multiple
    # a side left to the model is one it must make too: refused when planning, never by the hosts
    sides = [(f"--{name}", getattr(settings, name)) if getattr(settings, name) is not None or sizes
             else (f"the default {name} (--{name} not given)", size) for name in ("width", "height")]
    sides += [(f"--sizes {name}: the {side}", value) for name in sizes
              for side, value in zip(("width", "height"), buckets.parse_size(name))]
    for what, value in sides:
        if value is not None and value % multiple:
            rule = f"{family.title}'s size unit: {family.size_rule}" if family else described.family
            return f"{what} {value}: {settings.model}'s images are multiples of {multiple} pixels each way ({rule})"
        if value is not None and value > described.max_size:
            return (f"{what} {value}: {described.family} images are at most {described.max_size} pixels each "
                    f"way ({described.max_size * described.max_size / size ** 2:g} times the model's native "
                    f"area, {size}x{size})")
    return None


def guidance_help() -> str:
    """What each family does with a guidance scale, for help texts."""
    return _by_family({family.title: family.guidance_help for family in FAMILIES})


def sequence_help() -> str:
    """The families whose text length is a setting, and its bounds, for help texts."""
    return _by_family({family.title: family.sequence_help for family in FAMILIES})


def detect(index: dict, where: str) -> Family:
    """The family of the checkpoint whose ``model_index.json`` is ``index``; FamilyError
    naming the pipeline class when no family takes it. A ``model_index.json`` without a
    class name is read as SD or SDXL by its components, as promptmill always read it."""
    check()
    for family in FAMILIES:
        if family.claims(index):
            return family
    class_name = index.get("_class_name")
    for family in FAMILIES:
        if class_name in family.not_yet:
            raise FamilyError(f"{where}: model_index.json names the pipeline {class_name!r}: "
                              f"{family.not_yet[class_name]}")
    if not class_name:
        return SDXL if index.get("text_encoder_2", [None])[0] else SD
    known = ", ".join(c for family in FAMILIES for c in family.pipeline_classes)
    raise FamilyError(f"{where}: model_index.json names the pipeline {class_name!r}, which promptmill does not run; "
                      f"it runs {known}")
