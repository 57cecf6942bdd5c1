"""diffusers' Stable Diffusion safety checker, as our own Flax module.

The checker written again from what it is: a CLIP vision tower (our own,
``pipeline.model.scorers.towers``), a projection, and cosine similarities with 17 concept
embeddings and 3 "special care" ones, each against a threshold of its own
(``*_embeds_weights``). Parameter names are the PyTorch module's
(``vision_model.vision_model.…``: its ``CLIPVisionModel``), so the checkpoint's
``safety_checker/`` loads as it is: PyTorch safetensors (``StableDiffusionSafetyChecker``)
by rule, or the Flax revision's msgpack (diffusers' Flax checker, whose vision tower is one
level less deep).

The decision is diffusers' (``StableDiffusionSafetyChecker.forward``): each special-care
score is ``round(cos - threshold + adjustment, 3)``, the adjustment becoming 0.01 once a
special-care score is > 0; each concept score is ``round(cos - threshold + adjustment, 3)``;
the image is flagged when a concept score is > 0. ``nsfw_score`` is the largest concept
score before that rounding, so users can choose their own threshold.
"""
from __future__ import annotations

import dataclasses
import os

import flax.linen as nn
import jax.numpy as jnp

from pipeline.model.loading import convert
from pipeline.model.scorers import preprocess, towers
from pipeline.model.scorers.clip import ScorerError, load_params, normalized, read_config

CONCEPTS, SPECIAL_CARE = 17, 3  # as diffusers' checker has them
ADJUSTMENT = 0.01  # what a special-care hit adds to every concept score after it


class _VisionHolder(nn.Module):  # transformers' CLIPVisionModel: its transformer under ``vision_model``
    config: object
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, pixels):
        return towers.VisionModel(self.config, self.dtype, name="vision_model")(pixels)


class SafetyCheckerModule(nn.Module):
    """(cosines with the special-care concepts, with the concepts) of preprocessed pixels."""
    config: object  # towers.ClipConfig
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, pixels):
        from jax import lax

        cfg = self.config
        width, ones = cfg.projection_dim, nn.initializers.ones
        pooled = _VisionHolder(cfg.vision, self.dtype, name="vision_model")(pixels)
        projected = nn.Dense(width, use_bias=False, dtype=self.dtype, name="visual_projection")(pooled)
        embeds = normalized(projected.astype(jnp.float32))
        concept = self.param("concept_embeds", ones, (CONCEPTS, width))
        special = self.param("special_care_embeds", ones, (SPECIAL_CARE, width))
        self.param("concept_embeds_weights", ones, (CONCEPTS,))  # thresholds, read by ``check``
        self.param("special_care_embeds_weights", ones, (SPECIAL_CARE,))
        return (jnp.matmul(embeds, normalized(special).T, precision=lax.Precision.HIGHEST),
                jnp.matmul(embeds, normalized(concept).T, precision=lax.Precision.HIGHEST))


_RAW = ("concept_embeds", "special_care_embeds", "concept_embeds_weights", "special_care_embeds_weights")
TORCH_NAMES = convert.TorchNames(stacks=("vision_model/vision_model/encoder/layers",),
                                 moved={"vision_model/vision_model/embeddings/class_embedding":
                                        "vision_model.vision_model.embeddings.class_embedding",
                                        **{name: name for name in _RAW}},
                                 ignored=("vision_model.vision_model.embeddings.position_ids",))


def _example(config):
    size = config.vision.image_size
    return (jnp.zeros((1, size, size, config.vision.num_channels)),), {}


NETWORK = convert.Network(SafetyCheckerModule, _example, TORCH_NAMES)


def from_flax(flat, config, where: str) -> dict:
    """Params from diffusers' Flax checker's (``flax_model.msgpack``): its vision tower's keys
    one level less deep (``vision_model/embeddings/...``)."""
    deeper = {(("vision_model",) + key if key[0] == "vision_model" else key): value for key, value in flat.items()}
    return convert.from_flax(deeper, NETWORK.param_shapes(config), TORCH_NAMES, where, joined=False)


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
        return self.config.vision.image_size


def folder_of(path: str) -> str:
    """The checker's own folder in ``path``: ``path/safety_checker`` when ``path`` is a
    Stable Diffusion checkpoint, else ``path`` itself."""
    inner = os.path.join(path, "safety_checker")
    return inner if os.path.isfile(os.path.join(inner, "config.json")) else path


def load(directory: str, path: str, abstract: bool = False) -> SafetyChecker:
    """The checker in ``directory`` (a ``safety_checker/`` folder: config.json and
    weights); its preprocessing is the folder's ``preprocessor_config.json``, else the
    checkpoint's ``feature_extractor/`` beside it, else CLIP's at its image size."""
    import jax.numpy as jnp

    flag = "--safety-checker"
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ScorerError(f"{flag} {path}: no config.json in {directory} (not a safety checker folder)")
    config = read_config(directory, path, flag, text=False)
    size = config.vision.image_size
    sibling = os.path.join(os.path.dirname(os.path.abspath(directory)), "feature_extractor",
                           "preprocessor_config.json")
    pre, _ = preprocess.read(directory, size, (sibling,))
    if abstract:
        params = convert.abstract_params({"safety": NETWORK.param_shapes(config)}, jnp.float32)["safety"]
    else:
        params = load_params(directory, flag, lambda state, where: NETWORK.from_torch(state, config, where),
                             lambda flat, where: from_flax(flat, config, where))
    return SafetyChecker(path=path, directory=directory, config=config, module=SafetyCheckerModule(config),
                         preprocessing=pre, params=params)


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
