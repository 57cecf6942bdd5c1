"""FLUX.1's rectified-flow transformer (diffusers' ``FluxTransformer2DModel``) as our own
Flax Linen modules (Linen, like the rest of promptmill's networks: ``pipeline.model.layers``).

The forward pass, as diffusers 0.39 computes it (checked against its PyTorch module and
its ``FluxPipeline`` with fixtures: tests/families/test_flux_nets.py):
- ``x_embedder`` (packed latents -> width) and ``context_embedder`` (T5 states -> width);
- ``time_text_embed``: the timestep (times 1000) as a 256-channel sinusoid through an
  MLP, plus the pooled CLIP embedding through an MLP, plus, with ``guidance_embeds``,
  the guidance (times 1000) through its own MLP: one conditioning vector per image;
- ``transformer_blocks`` (double stream): text and image tokens keep their own weights
  (AdaLN-zero modulation from the conditioning, q/k/v with RMS-normed q and k, a GELU-tanh
  feed-forward) but attend jointly over [text; image];
- ``single_transformer_blocks``: one stream over [text; image], attention and an MLP in
  parallel, one output projection;
- ``norm_out`` (a continuous AdaLN: scale then shift) and ``proj_out``, on image tokens.
Rotary embeddings over (t, h, w) position ids (``axes_dims_rope`` channels each, theta
10000) rotate every query and key. Each attention call goes through
``pipeline.model.layers.attention.compute`` (the seam: xla, chunked, flash or cuDNN), after the
rotation. Both block stacks are ``nn.scan``-ned over weights stacked on a leading layer
axis: one block is traced and compiled whatever the depth.

Parameter names are diffusers' PyTorch names split at the dots (``convert``), so
``from_torch`` loads a diffusers checkpoint by rule. The network computes in its dtype
(fp32 or bf16), the norms in float32, the rotation in float32, as diffusers does.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from pipeline.model.layers import attention
from pipeline.model.layers.embeddings import MLPEmbedding, timestep_embedding
from pipeline.model.layers.mmdit import MMDiTConfig, check_guidance
from pipeline.model.layers.mlp import MLP_RATIO, FeedForward, Indexed
from pipeline.model.layers.modulation import AdaLayerNormContinuous, AdaLayerNormZero
from pipeline.model.layers.norms import RMSNorm, layer_norm
from pipeline.model.layers.rotary import apply_rotary, grid_position_ids, rotary_tables
from pipeline.model.layers.scan import stacked
from pipeline.model.loading import convert

CLASS_NAME = "FluxTransformer2DModel"
_DEFAULTS = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                 pooled_projection_dim=768, guidance_embeds=False, axes_dims_rope=(16, 56, 56))


@dataclasses.dataclass(frozen=True)
class FluxConfig(MMDiTConfig):
    """What the transformer's output depends on; ``from_dict`` reads its config.json."""
    pooled_projection_dim: int
    diffusers_class, title, defaults = CLASS_NAME, "FLUX.1", _DEFAULTS

    @classmethod
    def own(cls, values) -> dict:
        values.ints(("pooled_projection_dim",))
        return {"pooled_projection_dim": values["pooled_projection_dim"]}


# ---- pure helpers: position ids, as FluxPipeline makes them

def latent_image_ids(height: int, width: int) -> np.ndarray:
    """float32 [height * width, 3] position ids of the packed image tokens, ``height`` x
    ``width`` the packed grid (the latents' halved): (0, row, column), row-major, as
    ``FluxPipeline._prepare_latent_image_ids``."""
    return grid_position_ids(height, width, 3)


def text_ids(length: int) -> np.ndarray:
    """float32 [length, 3] position ids of the text tokens: zeros, as FluxPipeline's."""
    return np.zeros((length, 3), np.float32)


# ---- modules

class TimeTextEmbedding(nn.Module):
    """diffusers' ``CombinedTimestep[Guidance]TextProjEmbeddings``: the conditioning vector."""
    config: FluxConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, timestep, guidance, pooled):
        width = self.config.inner_dim
        emb = MLPEmbedding(width, self.dtype, name="timestep_embedder")(timestep_embedding(timestep).astype(self.dtype))
        if self.config.guidance_embeds:
            emb = emb + MLPEmbedding(width, self.dtype, name="guidance_embedder")(
                timestep_embedding(guidance).astype(self.dtype))
        return emb + MLPEmbedding(width, self.dtype, name="text_embedder")(pooled)


class FluxAttention(nn.Module):
    """diffusers' ``FluxAttention`` and ``FluxAttnProcessor``: q, k, v (RMS-normed q and k)
    of the image (or joint) stream, with ``context`` the text stream's own (``add_*``),
    concatenated [text; image]; rotated; attention through the seam (scale 1/sqrt(head
    dim)). Returns the image part through ``to_out`` and the text part through
    ``to_add_out`` when there is a context (double blocks), else the joint output
    unprojected (single blocks: diffusers' ``pre_only``)."""
    config: FluxConfig
    dtype: Any = jnp.float32

    def _heads(self, x, name):
        cfg = self.config
        out = nn.Dense(cfg.inner_dim, dtype=self.dtype, name=name)(x)
        return out.reshape(*x.shape[:2], cfg.num_attention_heads, cfg.attention_head_dim)

    @nn.compact
    def __call__(self, x, cos, sin, context=None):
        cfg = self.config
        q = RMSNorm(name="norm_q")(self._heads(x, "to_q"))
        k = RMSNorm(name="norm_k")(self._heads(x, "to_k"))
        v = self._heads(x, "to_v")
        if context is not None:
            q = jnp.concatenate([RMSNorm(name="norm_added_q")(self._heads(context, "add_q_proj")), q], axis=1)
            k = jnp.concatenate([RMSNorm(name="norm_added_k")(self._heads(context, "add_k_proj")), k], axis=1)
            v = jnp.concatenate([self._heads(context, "add_v_proj"), v], axis=1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention.compute("flux", q, k, v, cfg.attention_head_dim ** -0.5)
        out = out.reshape(*out.shape[:2], cfg.inner_dim).astype(q.dtype)
        if context is None:
            return out
        text, image = out[:, :context.shape[1]], out[:, context.shape[1]:]
        image = Indexed(x.shape[-1], "0", self.dtype, name="to_out")(image)
        return image, nn.Dense(x.shape[-1], dtype=self.dtype, name="to_add_out")(text)


class DoubleBlock(nn.Module):
    """diffusers' ``FluxTransformerBlock``; the scan body: ((text, image), conditioning,
    cos, sin) -> ((text, image), None)."""
    config: FluxConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, carry, emb, cos, sin):
        context, x = carry
        normed, (gate_msa, shift_mlp, scale_mlp, gate_mlp) = AdaLayerNormZero(6, self.dtype, name="norm1")(x, emb)
        normed_context, (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp) = AdaLayerNormZero(
            6, self.dtype, name="norm1_context")(context, emb)
        attn, context_attn = FluxAttention(self.config, dtype=self.dtype, name="attn")(normed, cos, sin,
                                                                                      normed_context)
        x = x + gate_msa[:, None] * attn
        hidden = layer_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        x = x + gate_mlp[:, None] * FeedForward(self.dtype, name="ff")(hidden)
        context = context + c_gate_msa[:, None] * context_attn
        hidden = layer_norm(context) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        context = context + c_gate_mlp[:, None] * FeedForward(self.dtype, name="ff_context")(hidden)
        return (context, x), None


class SingleBlock(nn.Module):
    """diffusers' ``FluxSingleTransformerBlock`` over the joint [text; image] tokens; the
    scan body: (tokens, conditioning, cos, sin) -> (tokens, None). diffusers concatenates
    and splits the streams in every block; here once around the stack (the same values)."""
    config: FluxConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, emb, cos, sin):
        width = x.shape[-1]
        normed, (gate,) = AdaLayerNormZero(3, self.dtype, name="norm")(x, emb)
        mlp = nn.gelu(nn.Dense(int(width * MLP_RATIO), dtype=self.dtype, name="proj_mlp")(normed), approximate=True)
        attn = FluxAttention(self.config, dtype=self.dtype, name="attn")(normed, cos, sin)
        out = nn.Dense(width, dtype=self.dtype, name="proj_out")(jnp.concatenate([attn, mlp], axis=2))
        return x + gate[:, None] * out, None


class FluxTransformer(nn.Module):
    """``FluxTransformer(config, dtype)(hidden_states, encoder_hidden_states,
    pooled_projections, timestep, img_ids, txt_ids, *, guidance=None) -> [B, N, out_channels]``,
    diffusers' ``FluxTransformer2DModel.forward`` with the same arguments:

    - hidden_states [B, N, in_channels]: packed latents (``pack_latents``);
    - encoder_hidden_states [B, L, joint_attention_dim]: T5's last hidden state;
    - pooled_projections [B, pooled_projection_dim]: CLIP's pooled output;
    - timestep [B]: what FluxPipeline passes, its scheduler timestep / 1000 (sigma); the
      transformer multiplies it by 1000 in its dtype, as diffusers does;
    - img_ids [N, 3], txt_ids [L, 3]: position ids (``latent_image_ids``, ``text_ids``);
      numpy arrays get float64 rotary tables made on the host (``rotary_tables``);
    - guidance [B]: the embedded guidance scale, also multiplied by 1000; required with
      ``guidance_embeds`` and refused without (diffusers fails on either mismatch).
    Returns the velocity prediction in the module's dtype. ``unroll``: blocks per loop
    iteration of each scanned stack (``nn.scan``'s; the same arithmetic): at the stack's
    depth, XLA's cost analysis, which counts a loop's body once, counts every block."""
    config: FluxConfig
    dtype: Any = jnp.float32
    unroll: int = 1

    @nn.compact
    def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, *,
                 guidance=None):
        cfg = self.config
        check_guidance(cfg, guidance)
        x = nn.Dense(cfg.inner_dim, dtype=self.dtype, name="x_embedder")(hidden_states)
        timestep = timestep.astype(self.dtype) * 1000
        if guidance is not None:
            guidance = guidance.astype(self.dtype) * 1000
        emb = TimeTextEmbedding(cfg, self.dtype, name="time_text_embed")(timestep, guidance, pooled_projections)
        context = nn.Dense(cfg.inner_dim, dtype=self.dtype, name="context_embedder")(encoder_hidden_states)
        xp = np if isinstance(txt_ids, np.ndarray) and isinstance(img_ids, np.ndarray) else jnp
        cos, sin = rotary_tables(xp.concatenate([txt_ids, img_ids], axis=0), cfg.axes_dims_rope)
        cos, sin = jnp.asarray(cos), jnp.asarray(sin)
        if cfg.num_layers:
            (context, x), _ = stacked(DoubleBlock, cfg.num_layers, 3, min(self.unroll, cfg.num_layers))(
                cfg, self.dtype, name="transformer_blocks")(
                (context, x), emb, cos, sin)
        if cfg.num_single_layers:
            joint, _ = stacked(SingleBlock, cfg.num_single_layers, 3, min(self.unroll, cfg.num_single_layers))(
                cfg, self.dtype, name="single_transformer_blocks")(
                jnp.concatenate([context, x], axis=1), emb, cos, sin)
            x = joint[:, context.shape[1]:]
        x = AdaLayerNormContinuous(self.dtype, name="norm_out")(x, emb)
        return nn.Dense(cfg.out_channels, dtype=self.dtype, name="proj_out")(x)


TORCH_NAMES = convert.TorchNames(stacks=("transformer_blocks", "single_transformer_blocks"))


def _example(config: FluxConfig):
    ids = np.zeros((1, 3), np.float32)
    guidance = jnp.zeros((1,)) if config.guidance_embeds else None
    return ((jnp.zeros((1, 1, config.in_channels)), jnp.zeros((1, 1, config.joint_attention_dim)),
             jnp.zeros((1, config.pooled_projection_dim)), jnp.zeros((1,)), ids, ids), {"guidance": guidance})


NETWORK = convert.Network(FluxTransformer, _example, TORCH_NAMES)
