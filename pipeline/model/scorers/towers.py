"""CLIP's two towers as our own Flax modules, for the scorers: transformers' PyTorch
``CLIPModel`` (the CLIP scorer) and the ``CLIPVisionModel`` inside diffusers'
``StableDiffusionSafetyChecker``.

- The text tower is ``pipeline.model.layers.text.clip``'s (``TextModel``: pooled at the end
  token).
- The vision tower (``VisionModel``, transformers' ``CLIPVisionTransformer``): the image cut
  into patches by ``patch_embedding`` (a convolution of the patch's size and stride, no
  bias), a learned ``class_embedding`` before them, ``position_embedding`` added,
  ``pre_layrnorm``, the encoder layers of the text tower without the causal mask (quick-GELU
  or GELU from the config), and ``post_layernorm`` of the class token: the pooled output.
- ``ClipModel``: both towers, ``visual_projection`` and ``text_projection`` (no biases), and
  ``logit_scale`` (read, never used: the scores are cosines).

Parameter names are transformers' PyTorch names split at the dots (the layers stacked:
``vision_model.encoder.layers.{i}.…``), so a CLIP folder's safetensors load by rule
(``convert``), and transformers' Flax msgpack by ``convert.from_flax``. The attention cores
go through the attention seam (sites "text_encoder" and "vision"). Checked against
transformers' and diffusers' PyTorch models with stored fixtures: tests/model/test_scorers.py.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from pipeline.model.layers.norms import LayerNorm
from pipeline.model.layers.text import clip
from pipeline.model.loading import convert

# transformers 4.57's CLIPVisionConfig defaults
_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)


@dataclasses.dataclass(frozen=True)
class ClipVisionConfig:
    """What CLIP's image features depend on; ``from_dict`` reads a ``vision_config``."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ClipVisionConfig:
        def refuse(key, why):
            raise ValueError(f"CLIP vision config: {key}={config.get(key)!r} {why}")

        values = {key: config.get(key, default) for key, default in _VISION_DEFAULTS.items()}
        for key, value in values.items():
            if key not in ("hidden_act", "layer_norm_eps") and (isinstance(value, bool) or not isinstance(value, int)
                                                                 or value < 1):
                refuse(key, "must be a positive integer")
        if values["hidden_act"] not in clip.ACTIVATIONS:
            refuse("hidden_act", f"is not one of {', '.join(clip.ACTIVATIONS)}, the activations this module has")
        if values["hidden_size"] % values["num_attention_heads"]:
            refuse("num_attention_heads", f"does not divide hidden_size={values['hidden_size']}")
        if values["image_size"] % values["patch_size"]:
            refuse("patch_size", f"does not divide image_size={values['image_size']}")
        return cls(**{**values, "layer_norm_eps": float(values["layer_norm_eps"])})


@dataclasses.dataclass(frozen=True)
class ClipConfig:
    """A whole CLIP's config (``CLIPConfig``: a ``config.json`` of a CLIP folder or of a safety
    checker): its towers and the projections' width."""
    text: clip.ClipTextConfig | None
    vision: ClipVisionConfig
    projection_dim: int = 512

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], text: bool = True) -> ClipConfig:
        """ValueError naming what the towers do not do; ``text``: read the text tower too."""
        if config.get("model_type", "clip") != "clip":
            raise ValueError(f"CLIP config: model_type={config.get('model_type')!r} is not clip")
        projection = config.get("projection_dim", 512)
        if isinstance(projection, bool) or not isinstance(projection, int) or projection < 1:
            raise ValueError(f"CLIP config: projection_dim={projection!r} must be a positive integer")
        text_config = clip.ClipTextConfig.from_dict(config.get("text_config") or {}) if text else None
        return cls(text_config, ClipVisionConfig.from_dict(config.get("vision_config") or {}), projection)


class _VisionEmbeddings(nn.Module):
    config: ClipVisionConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels):  # [B, S, S, C]
        cfg = self.config
        patches = nn.Conv(cfg.hidden_size, (cfg.patch_size, cfg.patch_size), strides=(cfg.patch_size,) * 2,
                          padding="VALID", use_bias=False, dtype=self.dtype, name="patch_embedding")(pixels)
        patches = patches.reshape(pixels.shape[0], -1, cfg.hidden_size)
        cls = self.param("class_embedding", nn.initializers.normal(0.02), (cfg.hidden_size,))
        tokens = jnp.concatenate([jnp.broadcast_to(cls.astype(self.dtype), (pixels.shape[0], 1, cfg.hidden_size)),
                                  patches], axis=1)
        positions = nn.Embed(cfg.patches + 1, cfg.hidden_size, dtype=self.dtype, name="position_embedding")(
            jnp.arange(tokens.shape[1])[None])
        return (tokens + positions).astype(self.dtype)


class VisionModel(nn.Module):
    """transformers' ``CLIPVisionTransformer``: preprocessed pixels [B, S, S, C] -> the
    pooled output [B, hidden] (the class token after ``post_layernorm``)."""
    config: ClipVisionConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels):
        cfg = self.config
        x = _VisionEmbeddings(cfg, self.dtype, name="embeddings")(pixels.astype(self.dtype))
        x = LayerNorm(cfg.layer_norm_eps, self.dtype, name="pre_layrnorm")(x)  # transformers' own spelling
        x, _ = clip.encoder(clip.LayerSpec.of(cfg, False, "vision"), cfg.num_hidden_layers, x, self.dtype)
        return LayerNorm(cfg.layer_norm_eps, self.dtype, name="post_layernorm")(x[:, 0])


class ClipModel(nn.Module):
    """transformers' ``CLIPModel``'s features: ``image_features(pixels)`` and
    ``text_features(ids)``, each projected [B, projection_dim]."""
    config: ClipConfig
    dtype: Any = jnp.float32

    def setup(self):
        cfg = self.config
        self.text_model = clip.TextModel(cfg.text, cfg.text.num_hidden_layers, True, self.dtype)
        self.vision_model = VisionModel(cfg.vision, self.dtype)
        self.visual_projection = nn.Dense(cfg.projection_dim, use_bias=False, dtype=self.dtype)
        self.text_projection = nn.Dense(cfg.projection_dim, use_bias=False, dtype=self.dtype)
        self.logit_scale = self.param("logit_scale", nn.initializers.constant(np.log(1 / 0.07)), ())

    def image_features(self, pixels):
        return self.visual_projection(self.vision_model(pixels))

    def text_features(self, ids):
        return self.text_projection(self.text_model(jnp.asarray(ids, jnp.int32)).pooled)

    def __call__(self, pixels, ids):
        return self.image_features(pixels), self.text_features(ids), self.logit_scale


MODEL_TORCH_NAMES = convert.TorchNames(
    stacks=("text_model/encoder/layers", "vision_model/encoder/layers"),
    moved={"vision_model/embeddings/class_embedding": "vision_model.embeddings.class_embedding",
           "logit_scale": "logit_scale"},
    ignored=("text_model.embeddings.position_ids", "vision_model.embeddings.position_ids"))


def _example(config: ClipConfig):
    size = config.vision.image_size
    return (jnp.zeros((1, size, size, config.vision.num_channels)), jnp.zeros((1, 2), jnp.int32)), {}


NETWORK = convert.Network(ClipModel, _example, MODEL_TORCH_NAMES)


def from_flax(flat: Mapping[tuple[str, ...], np.ndarray], config: ClipConfig, where: str) -> dict:
    """``ClipModel`` params from transformers' ``FlaxCLIPModel`` params (``flax_model.msgpack``)."""
    return convert.from_flax(flat, NETWORK.param_shapes(config), MODEL_TORCH_NAMES, where, joined=False)

