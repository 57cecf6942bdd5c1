"""FLUX.2's rectified-flow transformer (diffusers' ``Flux2Transformer2DModel``, as FLUX.2
[klein] uses it) as our own Flax Linen modules, like FLUX.1's
(``pipeline.model.families.flux.transformer``).

The forward pass, as diffusers 0.39 computes it (checked against its PyTorch module with
fixtures: tests/families/test_flux2_transformer.py):
- ``x_embedder`` (packed latents -> width) and ``context_embedder`` (the text encoder's
  stacked hidden states -> width); no biases anywhere in the network;
- ``time_guidance_embed``: the timestep (times 1000) as a ``timestep_guidance_channels``
  sinusoid through an MLP, plus, with ``guidance_embeds`` ([dev], not [klein]), the
  guidance (times 1000) through its own MLP. No pooled text vector (unlike FLUX.1);
- modulation computed once per call, not per block: ``double_stream_modulation_img`` and
  ``double_stream_modulation_txt`` (two (shift, scale, gate) sets each: attention, MLP),
  ``single_stream_modulation`` (one set), each ``linear(silu(conditioning))``, shared by
  every block of their stack;
- ``transformer_blocks`` (double stream): text and image tokens keep their own weights
  (q/k/v with RMS-normed q and k, a SwiGLU feed-forward) but attend jointly over
  [text; image];
- ``single_transformer_blocks``: one stream over [text; image]; one fused projection
  gives q, k, v and the SwiGLU's input, one fused projection maps [attention; MLP] back;
- ``norm_out`` (continuous AdaLN: scale then shift) and ``proj_out``, on image tokens.
Rotary embeddings over 4-axis position ids (t, h, w, l) (``axes_dims_rope`` channels each,
``rope_theta`` 2000), adjacent channel pairs rotating together, rotate every query and
key. Each attention call goes through ``pipeline.model.layers.attention.compute`` (site
"flux2"). Both block stacks are ``nn.scan``-ned over weights stacked on a leading layer
axis.

Parameter names are diffusers' PyTorch names split at the dots (``convert``), so
``from_torch`` loads a diffusers checkpoint by rule. The network computes in its dtype,
norms and the rotation in float32, as diffusers does.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from pipeline.model.layers import attention
from pipeline.model.layers.embeddings import timestep_embedding
from pipeline.model.layers.mlp import Indexed
from pipeline.model.layers.mmdit import MMDiTConfig, check_guidance
from pipeline.model.layers.norms import RMSNorm, layer_norm
from pipeline.model.layers.rotary import apply_rotary, grid_position_ids, rotary_tables
from pipeline.model.layers.scan import stacked
from pipeline.model.loading import convert
from pipeline.model.loading.config_values import is_int, is_number

CLASS_NAME = "Flux2Transformer2DModel"
ATTENTION_SITE = "flux2"
_DEFAULTS = dict(patch_size=1, in_channels=128, out_channels=None, num_layers=8, num_single_layers=48,
                 attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360,
                 timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000,
                 eps=1e-6, guidance_embeds=True)


@dataclasses.dataclass(frozen=True)
class Flux2Config(MMDiTConfig):
    """What the transformer's output depends on; ``from_dict`` reads its config.json."""
    timestep_guidance_channels: int
    mlp_ratio: float
    rope_theta: float
    eps: float
    diffusers_class, title, defaults = CLASS_NAME, "FLUX.2", _DEFAULTS

    @property
    def mlp_hidden_dim(self) -> int:
        """The SwiGLU's width (its input projection is twice this): ``int(inner * ratio)``."""
        return int(self.inner_dim * self.mlp_ratio)

    @classmethod
    def own(cls, values) -> dict:
        channels, ratio = values["timestep_guidance_channels"], values["mlp_ratio"]
        if not is_int(channels) or channels < 2 or channels % 2:
            values.refuse("timestep_guidance_channels", "must be a positive even integer")
        if not is_number(ratio) or int(values["attention_head_dim"] * values["num_attention_heads"] * ratio) < 1:
            values.refuse("mlp_ratio", "must be a positive number (at least one MLP channel)")
        values.positive_numbers(("rope_theta", "eps"))
        return dict(timestep_guidance_channels=channels, mlp_ratio=float(ratio), rope_theta=float(values["rope_theta"]),
                    eps=float(values["eps"]))


# ---- pure helpers: position ids, as Flux2KleinPipeline makes them

def latent_image_ids(height: int, width: int) -> np.ndarray:
    """float32 [height * width, 4] position ids of the packed image tokens, ``height`` x
    ``width`` the packed grid: (0, row, column, 0), row-major, as
    ``Flux2KleinPipeline._prepare_latent_ids``."""
    return grid_position_ids(height, width, 4)


def text_ids(length: int) -> np.ndarray:
    """float32 [length, 4] position ids of the text tokens: (0, 0, 0, i), as
    ``Flux2KleinPipeline._prepare_text_ids``."""
    ids = np.zeros((length, 4), np.float32)
    ids[:, 3] = np.arange(length)
    return ids


# ---- modules

def _linear(features: int, dtype, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=False, dtype=dtype, name=name)


def _swiglu(x):
    """diffusers' ``Flux2SwiGLU``: silu of the first half times the second."""
    gate, value = jnp.split(x, 2, axis=-1)
    return nn.silu(gate) * value


def _modulate(x, shift, scale, eps: float):
    """LayerNorm (no affine) of x [B, T, D], then ``(1 + scale) * x + shift`` ([B, D] each)."""
    return layer_norm(x, eps) * (1 + scale[:, None]) + shift[:, None]


class Embedding(nn.Module):
    """diffusers' ``TimestepEmbedding`` without biases: ``linear_1``, SiLU, ``linear_2``."""
    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        hidden = nn.silu(_linear(self.features, self.dtype, "linear_1")(x))
        return _linear(self.features, self.dtype, "linear_2")(hidden)


class TimestepGuidanceEmbedding(nn.Module):
    """diffusers' ``Flux2TimestepGuidanceEmbeddings``: the conditioning vector [B, inner]."""
    config: Flux2Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, timestep, guidance):
        cfg = self.config
        emb = Embedding(cfg.inner_dim, self.dtype, name="timestep_embedder")(
            timestep_embedding(timestep, cfg.timestep_guidance_channels).astype(self.dtype))
        if cfg.guidance_embeds:
            emb = emb + Embedding(cfg.inner_dim, self.dtype, name="guidance_embedder")(
                timestep_embedding(guidance, cfg.timestep_guidance_channels).astype(self.dtype))
        return emb


class Modulation(nn.Module):
    """diffusers' ``Flux2Modulation``: ``linear(silu(emb))``, [B, 3 * sets * inner], the
    (shift, scale, gate) of each set side by side (split by the blocks: ``_sets``)."""
    sets: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, emb):
        return _linear(3 * self.sets * emb.shape[-1], self.dtype, "linear")(nn.silu(emb))


def _sets(mod, sets: int):
    """[(shift, scale, gate)] * sets of a ``Modulation`` output."""
    parts = jnp.split(mod, 3 * sets, axis=-1)
    return [tuple(parts[3 * i:3 * i + 3]) for i in range(sets)]


class OutputNorm(nn.Module):
    """diffusers' ``AdaLayerNormContinuous`` as FLUX.2 builds it (no affine, no bias):
    ``linear(silu(emb))`` split into scale, then shift."""
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, emb):
        scale, shift = jnp.split(_linear(2 * x.shape[-1], self.dtype, "linear")(nn.silu(emb)), 2, axis=-1)
        return _modulate(x, shift, scale, self.eps)


class FeedForward(nn.Module):
    """diffusers' ``Flux2FeedForward``: ``linear_in`` (twice the hidden width), SwiGLU,
    ``linear_out``."""
    config: Flux2Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        hidden = _linear(2 * self.config.mlp_hidden_dim, self.dtype, "linear_in")(x)
        return _linear(x.shape[-1], self.dtype, "linear_out")(_swiglu(hidden))


def _attend(cfg: Flux2Config, q, k, v, cos, sin):
    """Rotate q and k, attend through the seam (scale 1/sqrt(head dim)): [B, T, inner]."""
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out = attention.compute(ATTENTION_SITE, q, k, v, cfg.attention_head_dim ** -0.5)
    return out.reshape(*out.shape[:2], cfg.inner_dim).astype(q.dtype)


class JointAttention(nn.Module):
    """diffusers' ``Flux2Attention`` and ``Flux2AttnProcessor`` (double blocks): q, k, v
    (RMS-normed q and k) of the image stream and of the text stream (``add_*``),
    concatenated [text; image], rotated, attended; the image part through ``to_out.0``,
    the text part through ``to_add_out``."""
    config: Flux2Config
    dtype: Any = jnp.float32

    def _heads(self, x, name):
        cfg = self.config
        return _linear(cfg.inner_dim, self.dtype, name)(x).reshape(*x.shape[:2], cfg.num_attention_heads,
                                                                   cfg.attention_head_dim)

    @nn.compact
    def __call__(self, x, context, cos, sin):
        cfg = self.config
        q = jnp.concatenate([RMSNorm(cfg.eps, name="norm_added_q")(self._heads(context, "add_q_proj")),
                             RMSNorm(cfg.eps, name="norm_q")(self._heads(x, "to_q"))], axis=1)
        k = jnp.concatenate([RMSNorm(cfg.eps, name="norm_added_k")(self._heads(context, "add_k_proj")),
                             RMSNorm(cfg.eps, name="norm_k")(self._heads(x, "to_k"))], axis=1)
        v = jnp.concatenate([self._heads(context, "add_v_proj"), self._heads(x, "to_v")], axis=1)
        out = _attend(cfg, q, k, v, cos, sin)
        text, image = out[:, :context.shape[1]], out[:, context.shape[1]:]
        return (Indexed(x.shape[-1], "0", self.dtype, use_bias=False, name="to_out")(image),
                _linear(context.shape[-1], self.dtype, "to_add_out")(text))


class ParallelAttention(nn.Module):
    """diffusers' ``Flux2ParallelSelfAttention`` and its processor (single blocks):
    ``to_qkv_mlp_proj`` gives q, k, v and the SwiGLU's input; attention (RMS-normed q and
    k, rotated) and the SwiGLU side by side; ``to_out`` maps [attention; MLP] back."""
    config: Flux2Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin):
        cfg = self.config
        inner, heads = cfg.inner_dim, (*x.shape[:2], cfg.num_attention_heads, cfg.attention_head_dim)
        fused = _linear(3 * inner + 2 * cfg.mlp_hidden_dim, self.dtype, "to_qkv_mlp_proj")(x)
        q, k, v = (fused[..., i * inner:(i + 1) * inner].reshape(heads) for i in range(3))
        q, k = RMSNorm(cfg.eps, name="norm_q")(q), RMSNorm(cfg.eps, name="norm_k")(k)
        out = _attend(cfg, q, k, v, cos, sin)
        mlp = _swiglu(fused[..., 3 * inner:])
        return _linear(x.shape[-1], self.dtype, "to_out")(jnp.concatenate([out, mlp], axis=-1))


class DoubleBlock(nn.Module):
    """diffusers' ``Flux2TransformerBlock``; the scan body: ((text, image), image
    modulation, text modulation, cos, sin) -> ((text, image), None). Its norms
    (``norm1``, ``norm2``, ``*_context``) have no weights."""
    config: Flux2Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, carry, mod_img, mod_txt, cos, sin):
        cfg = self.config
        context, x = carry
        (shift, scale, gate), (shift_mlp, scale_mlp, gate_mlp) = _sets(mod_img, 2)
        (c_shift, c_scale, c_gate), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = _sets(mod_txt, 2)
        attn, context_attn = JointAttention(cfg, self.dtype, name="attn")(
            _modulate(x, shift, scale, cfg.eps), _modulate(context, c_shift, c_scale, cfg.eps), cos, sin)
        x = x + gate[:, None] * attn
        x = x + gate_mlp[:, None] * FeedForward(cfg, self.dtype, name="ff")(
            _modulate(x, shift_mlp, scale_mlp, cfg.eps))
        context = context + c_gate[:, None] * context_attn
        context = context + c_gate_mlp[:, None] * FeedForward(cfg, self.dtype, name="ff_context")(
            _modulate(context, c_shift_mlp, c_scale_mlp, cfg.eps))
        return (context, x), None


class SingleBlock(nn.Module):
    """diffusers' ``Flux2SingleTransformerBlock`` over the joint [text; image] tokens;
    the scan body: (tokens, modulation, cos, sin) -> (tokens, None)."""
    config: Flux2Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mod, cos, sin):
        cfg = self.config
        ((shift, scale, gate),) = _sets(mod, 1)
        out = ParallelAttention(cfg, self.dtype, name="attn")(_modulate(x, shift, scale, cfg.eps), cos, sin)
        return x + gate[:, None] * out, None


def _ids(ids):
    """[T, axes] position ids; a leading batch axis, as diffusers accepts, is dropped."""
    return ids[0] if ids.ndim == 3 else ids


class Flux2Transformer(nn.Module):
    """``Flux2Transformer(config, dtype)(hidden_states, encoder_hidden_states, timestep,
    img_ids, txt_ids, *, guidance=None) -> [B, N, out_channels]``, diffusers'
    ``Flux2Transformer2DModel.forward`` with the same arguments:

    - hidden_states [B, N, in_channels]: packed latents;
    - encoder_hidden_states [B, L, joint_attention_dim]: the text encoder's states;
    - timestep [B]: the pipeline's scheduler timestep / 1000 (sigma); multiplied by 1000
      in the module's dtype, as diffusers does;
    - img_ids [N, 4] (``latent_image_ids``: (0, h, w, 0)), txt_ids [L, 4] (``text_ids``:
      (0, 0, 0, i)); numpy arrays get float64 rotary tables made on the host;
    - guidance [B]: the embedded guidance scale (times 1000), required with
      ``guidance_embeds`` and refused without. diffusers instead ignores a guidance the
      model does not embed and, given none, leaves the guidance term out: both are
      mistakes of the caller that would go unnoticed, so they are errors here.
    Returns the velocity prediction in the module's dtype. ``unroll``: blocks per loop
    iteration of each scanned stack (the same arithmetic)."""
    config: Flux2Config
    dtype: Any = jnp.float32
    unroll: int = 1

    @nn.compact
    def __call__(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, *, guidance=None):
        cfg = self.config
        check_guidance(cfg, guidance)
        timestep = timestep.astype(self.dtype) * 1000
        if guidance is not None:
            guidance = guidance.astype(self.dtype) * 1000
        emb = TimestepGuidanceEmbedding(cfg, self.dtype, name="time_guidance_embed")(timestep, guidance)
        mod_img = Modulation(2, self.dtype, name="double_stream_modulation_img")(emb)
        mod_txt = Modulation(2, self.dtype, name="double_stream_modulation_txt")(emb)
        mod_single = Modulation(1, self.dtype, name="single_stream_modulation")(emb)
        x = _linear(cfg.inner_dim, self.dtype, "x_embedder")(hidden_states)
        context = _linear(cfg.inner_dim, self.dtype, "context_embedder")(encoder_hidden_states)
        img_ids, txt_ids = _ids(img_ids), _ids(txt_ids)
        xp = np if isinstance(txt_ids, np.ndarray) and isinstance(img_ids, np.ndarray) else jnp
        cos, sin = rotary_tables(xp.concatenate([txt_ids, img_ids], axis=0), cfg.axes_dims_rope, cfg.rope_theta)
        cos, sin = jnp.asarray(cos), jnp.asarray(sin)
        if cfg.num_layers:
            (context, x), _ = stacked(DoubleBlock, cfg.num_layers, 4, min(self.unroll, cfg.num_layers))(
                cfg, self.dtype, name="transformer_blocks")((context, x), mod_img, mod_txt, cos, sin)
        if cfg.num_single_layers:
            joint, _ = stacked(SingleBlock, cfg.num_single_layers, 3, min(self.unroll, cfg.num_single_layers))(
                cfg, self.dtype, name="single_transformer_blocks")(
                jnp.concatenate([context, x], axis=1), mod_single, cos, sin)
            x = joint[:, context.shape[1]:]
        x = OutputNorm(cfg.eps, self.dtype, name="norm_out")(x, emb)
        return _linear(cfg.out_channels, self.dtype, "proj_out")(x)


TORCH_NAMES = convert.TorchNames(stacks=("transformer_blocks", "single_transformer_blocks"))


def _example(config: Flux2Config):
    ids = np.zeros((1, len(config.axes_dims_rope)), np.float32)
    guidance = jnp.zeros((1,)) if config.guidance_embeds else None
    return ((jnp.zeros((1, 1, config.in_channels)), jnp.zeros((1, 1, config.joint_attention_dim)),
             jnp.zeros((1,)), ids, ids), {"guidance": guidance})


NETWORK = convert.Network(Flux2Transformer, _example, TORCH_NAMES)
