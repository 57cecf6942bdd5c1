"""Model families: what a checkpoint is made of, and how its images are made.

Each family is one module here with one object implementing ``base.Family``, and one
entry in ``FAMILIES``; ``detect`` finds a checkpoint's family from its
``model_index.json`` (the pipeline class diffusers saved it with) and refuses, naming
it, a pipeline no family takes.

- ``sd``: SD 1.x/2.x (``sd``) and SDXL (``sdxl``): diffusers' Flax UNet and VAE,
  transformers' Flax CLIP text encoders, classifier-free guidance, the SD samplers;
- ``flux``: FLUX.1 [schnell] and [dev]: promptmill's own Flax networks
  (``pipeline.model.nets``: the rectified-flow transformer, the T5 encoder, the
  16-channel VAE decode) with transformers' Flax CLIP, flow-matching Euler, and
  guidance embedded in the transformer ([dev]) or none ([schnell]).
"""
from __future__ import annotations

from pipeline.model.families.base import Described, Family, Model  # noqa: F401 (the seam's types)
from pipeline.model.families.flux import FLUX
from pipeline.model.families.sd import SD, SDXL

FAMILIES: tuple[Family, ...] = (SD, SDXL, FLUX)
BY_NAME = {family.name: family for family in FAMILIES}


class FamilyError(ValueError):
    pass


def detect(index: dict, where: str) -> Family:
    """The family of the checkpoint whose ``model_index.json`` is ``index``; FamilyError
    naming the pipeline class when no family takes it. A ``model_index.json`` without a
    class name is read as SD or SDXL by its components, as promptmill always read it."""
    for family in FAMILIES:
        if family.claims(index):
            return family
    class_name = index.get("_class_name")
    if not class_name:
        return SDXL if index.get("text_encoder_2", [None])[0] else SD
    known = ", ".join(c for family in FAMILIES for c in family.pipeline_classes)
    raise FamilyError(f"{where}: model_index.json names the pipeline {class_name!r}, which promptmill does not run; "
                      f"it runs {known}")
