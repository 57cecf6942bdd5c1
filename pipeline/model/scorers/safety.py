"""diffusers' Stable Diffusion safety checker, as our own Flax module.

diffusers' ``FlaxStableDiffusionSafetyChecker`` does not run on our jax (its cosine
distance calls ``jnp.clip(a_min=...)``, gone from jax 0.10), so this is the checker
written again from what it is: a CLIP vision tower (transformers' Flax module), a
projection, and cosine similarities with 17 concept embeddings and 3 "special care"
ones, each against a threshold of its own (``*_embeds_weights``). Parameter names are
diffusers', so the checkpoint's ``safety_checker/`` loads as it is: PyTorch safetensors
(``StableDiffusionSafetyChecker``) by transformers' renaming rules, or the Flax
revision's msgpack as stored.

The decision is diffusers' (``StableDiffusionSafetyChecker.forward``): each special-care
score is ``round(cos - threshold + adjustment, 3)``, the adjustment becoming 0.01 once a
special-care score is > 0; each concept score is ``round(cos - threshold + adjustment, 3)``;
the image is flagged when a concept score is > 0. ``nsfw_score`` is the largest concept
score before that rounding, so users can choose their own threshold.
"""
from __future__ import annotations

import dataclasses
import os

from pipeline.model.scorers import preprocess
from pipeline.model.scorers.clip import ScorerError, load_params, normalized

CONCEPTS, SPECIAL_CARE = 17, 3  # as diffusers' checker has them
ADJUSTMENT = 0.01  # what a special-care hit adds to every concept score after it


def module_class():
    import flax.linen as nn
    import jax.numpy as jnp
    from transformers.models.clip.modeling_flax_clip import FlaxCLIPVisionModule

    class SafetyCheckerModule(nn.Module):
        """(projected image embeddings, cosines with the special-care concepts, with the concepts)."""
        config: object  # CLIPConfig
        dtype: object = jnp.float32

        def setup(self):
            self.vision_model = FlaxCLIPVisionModule(self.config.vision_config, dtype=self.dtype)
            self.visual_projection = nn.Dense(self.config.projection_dim, use_bias=False, dtype=self.dtype)
            width = self.config.projection_dim
            ones = nn.initializers.ones
            self.concept_embeds = self.param("concept_embeds", ones, (CONCEPTS, width))
            self.special_care_embeds = self.param("special_care_embeds", ones, (SPECIAL_CARE, width))
            self.concept_embeds_weights = self.param("concept_embeds_weights", ones, (CONCEPTS,))
            self.special_care_embeds_weights = self.param("special_care_embeds_weights", ones, (SPECIAL_CARE,))

        def __call__(self, pixels):
            from jax import lax

            pooled = self.vision_model(pixel_values=pixels, deterministic=True)[1]
            embeds = normalized(self.visual_projection(pooled).astype(jnp.float32))
            special = jnp.matmul(embeds, normalized(self.special_care_embeds).T, precision=lax.Precision.HIGHEST)
            concepts = jnp.matmul(embeds, normalized(self.concept_embeds).T, precision=lax.Precision.HIGHEST)
            return special, concepts

    return SafetyCheckerModule


@dataclasses.dataclass(frozen=True)
class SafetyChecker:
    path: str  # what named it: --safety-checker's value, or the model's safety_checker/
    directory: str  # the local folder with its config.json and weights
    config: object
    module: object
    preprocessing: preprocess.Preprocessing
    params: dict

    @property
    def image_size(self) -> int:
        return self.config.vision_config.image_size


def folder_of(path: str) -> str:
    """The checker's own folder in ``path``: ``path/safety_checker`` when ``path`` is a
    Stable Diffusion checkpoint, else ``path`` itself."""
    inner = os.path.join(path, "safety_checker")
    return inner if os.path.isfile(os.path.join(inner, "config.json")) else path


def param_shapes(module, image_size: int) -> dict:
    """The checker module's params as ShapeDtypeStructs (no initialiser runs)."""
    import jax
    import jax.numpy as jnp

    return jax.eval_shape(module.init, jax.ShapeDtypeStruct((2,), jnp.uint32),
                          jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32))["params"]


def load(directory: str, path: str, abstract: bool = False) -> SafetyChecker:
    """The checker in ``directory`` (a ``safety_checker/`` folder: config.json and
    weights); its preprocessing is the folder's ``preprocessor_config.json``, else the
    checkpoint's ``feature_extractor/`` beside it, else CLIP's at its image size."""
    from transformers import CLIPConfig

    flag = "--safety-checker"
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ScorerError(f"{flag} {path}: no config.json in {directory} (not a safety checker folder)")
    config = CLIPConfig.from_pretrained(directory)
    module = module_class()(config)
    size = config.vision_config.image_size
    shapes = param_shapes(module, size)
    sibling = os.path.join(os.path.dirname(os.path.abspath(directory)), "feature_extractor",
                           "preprocessor_config.json")
    pre, _ = preprocess.read(directory, size, (sibling,))
    params = shapes if abstract else load_params(directory, shapes, flag, base_model_prefix="safety_checker")
    return SafetyChecker(path=path, directory=directory, config=config, module=module, preprocessing=pre,
                         params=params)


def _round3(x):
    import jax.numpy as jnp

    return jnp.round(x * 1000) / 1000


def check(checker: SafetyChecker, params, pixels):
    """(nsfw_score float32 [B], nsfw bool [B]) of preprocessed pixels [B, S, S, 3]."""
    import jax.numpy as jnp

    special, concepts = checker.module.apply({"params": params}, pixels)
    batch = special.shape[0]
    adjustment = jnp.zeros((batch,), jnp.float32)
    for k in range(special.shape[1]):  # in order: a hit raises the scores after it, as diffusers' loop does
        score = _round3(special[:, k] - params["special_care_embeds_weights"][k] + adjustment)
        adjustment = jnp.where(score > 0, jnp.float32(ADJUSTMENT), adjustment)
    margins = concepts - params["concept_embeds_weights"][None, :] + adjustment[:, None]
    return jnp.max(margins, axis=-1), jnp.any(_round3(margins) > 0, axis=-1)
