"""The guidance rules, in one place: how each rule combines the denoiser's predictions,
whether an image asks for guidance, and whether a run compiles the guided program.

A run's ``guidance_rule`` (``Settings.guidance_rule``, its family's, kept by the run):

- ``diffusers``: classifier-free guidance, as diffusers' SD pipelines run it: an image whose
  guidance is above 1 takes ``uncond + g * (cond - uncond)``; at 1 or below, the
  conditional prediction alone (selected, not computed with g = 1);
- ``always``: classifier-free guidance on every image (runs planned before the rule above);
- ``zimage``: classifier-free guidance as ``ZImagePipeline`` runs it: an image whose
  guidance g is above 0 takes ``cond + g * (cond - uncond)``; at 0 (or below) the
  conditional prediction alone (selected);
- ``embedded``: the guidance is an input of the denoiser, one call per step (FLUX.1 [dev]);
- ``unused``: the model takes no guidance.

Whether a run's program is the guided one (the denoiser at twice the rows, negative prompts
encoded) is decided once, by its plan, from every record (``asks``); before the plan has
read the prompts (``--per-device-batch auto``, the TPU check before a submission), the
guess is ``guided_before_planning``, the same for every caller. A run whose records ask
for more than its ``--guidance-scale`` is guided after all: the plan says so, and a
submission checks the planned program again.
"""
from __future__ import annotations

from pipeline.core.settings import GUIDANCE_RULES as RULES, NO_CFG_RULES  # noqa: F401 (the rules' names)


def asks(rule: str, guidance: float) -> bool:
    """Whether an image of ``guidance`` under ``rule`` needs the guided program."""
    if rule == "always":
        return True
    if rule == "zimage":
        return guidance > 0
    return rule == "diffusers" and guidance > 1


def threshold(rule: str) -> float:
    """The guidance above which an image is guided under a classifier-free ``rule``: 0 for
    "zimage", 1 for the others (for people: refusals, the card)."""
    return 0 if rule == "zimage" else 1


def combine(rule: str, prediction, scale):
    """The guided program's prediction of each image from the denoiser's on [negative;
    positive] (``prediction``, float32, twice the batch) and each image's scale ([B, 1, ...]):
    ``uncond + g * (cond - uncond)``, for every image under "always" and, under "diffusers",
    for an image whose guidance is above 1 (at 1 or below the conditional prediction
    alone, selected: ``uncond + 1 * (cond - uncond)`` is not bit-equal to it); under
    "zimage", ``cond + g * (cond - uncond)`` above 0, else ``cond``."""
    import jax.numpy as jnp

    uncond, cond = jnp.split(prediction, 2)
    if rule == "zimage":
        return jnp.where(scale > 0, cond + scale * (cond - uncond), cond)
    guided = uncond + scale * (cond - uncond)
    return guided if rule == "always" else jnp.where(scale > 1, guided, cond)


def guided_before_planning(settings, model=None) -> bool:
    """Whether the run's program is the guided one, before its plan has read the prompts:
    the plan's decision when there is one; never for a model without classifier-free
    guidance (``Family.classifier_free``); else what ``--guidance-scale`` implies (left
    out: the family's default, which guides)."""
    if settings.guided is not None:
        return settings.guided
    family = None if model is None else model.family
    if family is not None and not family.classifier_free(model):
        return False
    rule = "diffusers" if family is None else family.guidance_rule(model)
    return settings.guidance_scale is None or asks(rule, settings.guidance_scale)
