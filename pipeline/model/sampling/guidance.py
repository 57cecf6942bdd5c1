"""Guidance rules: how a run's guidance scale acts, one object a rule.

A run records its rule's name (``Settings.guidance_rule``), decided by its model's
family when planning and kept by the run. A ``Rule`` says everything the rest of
promptmill asks of it: whether an image of a given guidance asks for the guided program
(``asks``), how the guided program combines the denoiser's predictions (``combine``),
which negative prompts and which guidance scales go unused, what the scale means for
the dataset card, and how ``status`` shows it.

The rules shared by several families are here; a family with a rule of its own brings it
(``Family.rules``), and the family registry registers every rule its families bring
(``pipeline.model.families``), so nothing outside a family names one of its own.

- ``diffusers``: classifier-free guidance as diffusers' pipelines run it: an image whose
  guidance is above 1 takes ``uncond + g * (cond - uncond)``; at 1 or below, the
  conditional prediction alone (selected, not computed with g = 1);
- ``embedded``: the guidance is an input of the denoiser, one call per step;
- ``unused``: the model takes no guidance.

Whether a run's program is the guided one (the denoiser at twice the rows, negative prompts
encoded) is decided once, by its plan, from every record (``Rule.asks``); before the plan
has read the prompts (``--per-device-batch auto``, the TPU check before a submission), the
guess is ``guided_before_planning``, the same for every caller.
"""
from __future__ import annotations

import dataclasses


class UnknownRule(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Rule:
    """A guidance rule. ``classifier_free``: the guided program runs the denoiser on
    [negative; positive] prompts; ``above``: an image whose guidance is above it is guided
    (classifier-free rules); ``takes_guidance``: False for a model that takes none (any
    scale but 0 is unused); ``meaning``: what the scale does, for the dataset card;
    ``shown``: what ``status`` adds after the scale (None: "guidance-free" when unguided)."""
    name: str
    meaning: str
    classifier_free: bool = True
    above: float = 1.0
    takes_guidance: bool = True
    shown: str | None = None

    def asks(self, guidance: float) -> bool:
        """Whether an image of ``guidance`` needs the guided program."""
        return self.classifier_free and guidance > self.above

    def combine(self, prediction, scale):
        """The guided program's prediction of each image from the denoiser's on [negative;
        positive] (``prediction``, float32, twice the batch) and each image's scale ([B, 1,
        ...]): ``uncond + g * (cond - uncond)`` above ``above``, else the conditional
        prediction alone, selected (``uncond + 1 * (cond - uncond)`` is not bit-equal to it)."""
        import jax.numpy as jnp

        uncond, cond = jnp.split(prediction, 2)
        return jnp.where(scale > self.above, uncond + scale * (cond - uncond), cond)

    def negative_unused(self, guidance: float) -> bool:
        """Whether an image's negative prompt plays no part at ``guidance``."""
        return not self.asks(guidance)

    def guidance_unused(self, guidance: float) -> bool:
        """Whether an image's guidance scale plays no part (a model that takes none)."""
        return not self.takes_guidance and guidance != 0


DIFFUSERS = Rule("diffusers", "classifier-free guidance: an image whose guidance is above 1 runs the denoiser on its "
                              "negative and its prompt and mixes them; at 1 or below, the prompt alone")
EMBEDDED = Rule("embedded", "embedded guidance: each image's guidance scale is an input of the denoiser, one call per "
                            "step; negative prompts are not used", classifier_free=False, shown=" (embedded)")
UNUSED = Rule("unused", "none (the model takes no guidance): a guidance scale given plays no part, and neither do "
                        "negative prompts; both are counted below", classifier_free=False, takes_guidance=False,
              shown=" (not used)")
SHARED = (DIFFUSERS, EMBEDDED, UNUSED)
_RULES: dict[str, Rule] = {rule.name: rule for rule in SHARED}


def register(rule: Rule) -> None:
    """Make ``rule`` known by its name (the family registry does, for its families' rules)."""
    if _RULES.get(rule.name, rule) != rule:
        raise UnknownRule(f"two guidance rules are named {rule.name!r}: a family's rule needs a name of its own")
    _RULES[rule.name] = rule


def rule(name: str) -> Rule:
    """The registered rule ``name``; UnknownRule when no registered family brings it."""
    try:
        return _RULES[name]
    except KeyError:
        raise UnknownRule(f"guidance rule {name!r} is not one of the registered rules ({', '.join(sorted(_RULES))}): "
                          f"the family that brings it is not registered") from None


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
    found = DIFFUSERS if family is None else rule(family.guidance_rule(model))
    return settings.guidance_scale is None or found.asks(settings.guidance_scale)
