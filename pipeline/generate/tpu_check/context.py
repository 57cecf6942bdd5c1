"""What one TPU check is of (``Context``): the run's settings, the target chips, the run's
model from its configs alone, the image size and whether the program is the guided one,
decided once, for every program the check lowers."""
from __future__ import annotations

import dataclasses

from pipeline.generate.spec import ProgramSpec
from pipeline.generate.tpu_check.chips import Target
from pipeline.model import sharding
from pipeline.model.sampling import decoding, guidance


def run_guided(settings, model=None) -> bool:
    """Whether the checked program is the guided one (``guidance.guided_before_planning``:
    records that carry their own guidance above 1 make a run guided, and ``submit`` checks
    again once the plan decided)."""
    return guidance.guided_before_planning(settings, model)


def size_of(settings, model) -> tuple[int, int]:
    return model.size(settings.width, settings.height)


@dataclasses.dataclass(frozen=True)
class Context:
    """One check's run on one target: ``settings``, ``target``, ``model`` (abstract: shapes
    and configs, no weight), and what they decide, ``width``, ``height`` and ``guided``.
    Built once a check (``of``); it pickles (the model as shapes), so a compiling child
    (``child``) gets it whole and loads nothing again."""
    settings: object
    target: Target
    model: object
    width: int
    height: int
    guided: bool

    @classmethod
    def of(cls, settings, target: Target, model=None) -> Context:
        """The context of ``settings`` on ``target``, of ``model`` or, when None, of the
        settings' model from its configs alone (``runtime.abstract_model``). A
        ``decode_batch`` left "auto" is the one planning resolves it to: the program checked
        is the run's."""
        if model is None:
            from pipeline.generate import runtime

            model = runtime.abstract_model(settings)
        width, height = size_of(settings, model)
        if settings.steps is None:  # left out: the model's default
            settings = settings.replace(steps=model.steps(None))
        settings = settings.replace(decode_batch=decoding.planned(settings.decode_batch))
        return cls(settings, target, model, width, height, run_guided(settings, model))

    def spec(self, per_device_batch: int) -> ProgramSpec:
        """The host program the check lowers, at ``per_device_batch`` images per chip: the
        run's (``ProgramSpec.of``), guided as decided here, its rule the family's where the
        plan has not named one yet."""
        settings, model = self.settings, self.model
        rule = settings.guidance_rule if settings.guided is not None else model.family.guidance_rule(model)
        return ProgramSpec.of(settings).at(width=self.width, height=self.height, per_device_batch=per_device_batch,
                                           guidance_rule=rule, guided=self.guided)

    def weights(self) -> int:
        """The bytes of the model's weights on each chip (its share under ``--fsdp``)."""
        return sharding.device_bytes(self.model.params, self.settings.fsdp, self.model.param_dtype)
