"""SD 1.x/2.x's and SDXL's UNet as our own Flax module: diffusers' PyTorch
``UNet2DConditionModel``, built block by block from its config (``unet_config``).

What it computes, as diffusers 0.39's PyTorch module does (checked against it with stored
fixtures: tests/families/test_pipeline_parity.py):
- the timestep's sinusoid (``flip_sin_to_cos``, ``freq_shift``) through ``time_embedding``
  (linear, SiLU, linear); SDXL adds ``add_embedding`` of [pooled text, the sinusoids of its
  6 time ids] (``addition_embed_type`` "text_time");
- ``conv_in``; the down blocks (ResNet blocks, each followed by a ``Transformer2DModel`` in a
  cross-attention block, and a stride-2 downsampler but in the last), every output kept
  as a skip; the mid block (ResNet, transformers, ResNet); the up blocks (each ResNet on its
  input concatenated with the next skip, transformers, a nearest 2x upsampler to the
  skip's size); ``conv_norm_out``, SiLU, ``conv_out``;
- a ``Transformer2DModel``: group norm (eps 1e-6), ``proj_in`` (a 1x1 convolution, or a
  linear layer with ``use_linear_projection``, SD 2.x's and SDXL's), ``transformer_blocks``
  (layer norm, self-attention ``attn1``; layer norm, cross-attention ``attn2`` on the text
  states; layer norm, GEGLU feed-forward with the exact GELU, PyTorch's), ``proj_out``,
  added back.

Every attention's core goes through the attention seam (``attention.compute``, site
"unet"), whichever kernel the run chose; with ``upcast_attention`` (SD 2.1) it computes in
float32. The network computes in its dtype; the group and layer norms in float32.
Parameter names are diffusers' PyTorch names split at the dots (``down_blocks/1/attentions/
0/transformer_blocks/0/attn1/to_q/kernel``), so weights load by rule
(``pipeline.model.loading.convert``) and a LoRA finds its layers by their names.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from pipeline.model.families.sd.unet_config import Block, UNetConfig
from pipeline.model.layers import attention
from pipeline.model.layers.embeddings import MLPEmbedding, timestep_embedding
from pipeline.model.layers.norms import GroupNorm, LayerNorm
from pipeline.model.layers.resnet import Downsample2D, Numbered, ResnetBlock2D, Upsample2D, conv
from pipeline.model.loading import convert

TORCH_NAMES = convert.TorchNames(stacks=())


class Attention(nn.Module):
    """diffusers' ``Attention`` of a transformer block: ``to_q``, ``to_k``, ``to_v`` (no
    biases), the core through the seam, ``to_out.0``."""
    heads: int
    head_dim: int
    upcast: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, context=None):
        context = x if context is None else context
        batch, inner = x.shape[0], self.heads * self.head_dim

        def project(name, source):
            out = nn.Dense(inner, use_bias=False, dtype=self.dtype, name=name)(source)
            out = out.reshape(batch, -1, self.heads, self.head_dim)
            return out.astype(jnp.float32) if self.upcast else out

        out = attention.compute("unet", project("to_q", x), project("to_k", context), project("to_v", context),
                                self.head_dim ** -0.5)
        out = out.astype(self.dtype).reshape(batch, -1, inner)
        return Numbered(name="to_out")(lambda: nn.Dense(x.shape[-1], dtype=self.dtype, name="0"), out)


class _GEGLU(nn.Module):
    """diffusers' ``GEGLU``: ``proj`` to twice the width, the first half times the exact
    GELU of the second."""
    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        hidden, gate = jnp.split(nn.Dense(2 * self.features, dtype=self.dtype, name="proj")(x), 2, axis=-1)
        return hidden * nn.gelu(gate, approximate=False)


class FeedForward(nn.Module):
    """diffusers' ``FeedForward(activation_fn="geglu")``: ``net.0`` (GEGLU, 4x wide), ``net.2``."""
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        net = Numbered(name="net")
        hidden = net(lambda: _GEGLU(4 * x.shape[-1], self.dtype, name="0"), x)
        return net(lambda: nn.Dense(x.shape[-1], dtype=self.dtype, name="2"), hidden)


class BasicTransformerBlock(nn.Module):
    """Self-attention (on the text states too with ``only_cross``), cross-attention on the
    text states, feed-forward; each after a layer norm and added back."""
    heads: int
    head_dim: int
    only_cross: bool = False
    upcast: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, context):
        def norm(name):
            return LayerNorm(1e-5, self.dtype, name=name)

        def attend(name):
            return Attention(self.heads, self.head_dim, self.upcast, self.dtype, name=name)

        x = x + attend("attn1")(norm("norm1")(x), context if self.only_cross else None)
        x = x + attend("attn2")(norm("norm2")(x), context)
        return x + FeedForward(self.dtype, name="ff")(norm("norm3")(x))


class Transformer2D(nn.Module):
    """diffusers' ``Transformer2DModel`` on NHWC features (see the module's docstring)."""
    block: Block
    depth: int
    groups: int
    linear: bool
    upcast: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, context):
        batch, height, width, channels = x.shape
        head_dim = channels // self.block.heads
        inner = self.block.heads * head_dim
        h = GroupNorm(self.groups, 1e-6, self.dtype, name="norm")(x)
        if self.linear:
            h = nn.Dense(inner, dtype=self.dtype, name="proj_in")(h.reshape(batch, height * width, channels))
        else:
            h = conv(inner, 1, self.dtype, "proj_in")(h).reshape(batch, height * width, inner)
        blocks = Numbered(name="transformer_blocks")
        for i in range(self.depth):
            h = blocks(lambda i=i: BasicTransformerBlock(self.block.heads, head_dim, self.block.only_cross_attention,
                                                         self.upcast, self.dtype, name=str(i)), h, context)
        if self.linear:
            h = nn.Dense(channels, dtype=self.dtype, name="proj_out")(h).reshape(x.shape)
        else:
            h = conv(channels, 1, self.dtype, "proj_out")(h.reshape(batch, height, width, inner))
        return h + x


class _Blocks(nn.Module):
    """One down, mid or up block: its ResNets (each after its skip, in an up block) and, in a
    cross-attention block, a transformer after each; then its resampler."""
    config: UNetConfig
    block: Block
    kind: str  # "down" | "mid" | "up"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, temb, context, skips=(), size=None):
        cfg, block = self.config, self.block
        scale = cfg.mid_block_scale_factor if self.kind == "mid" else 1.0
        resnets, attentions = Numbered(name="resnets"), Numbered(name="attentions")
        outputs = []
        layers = len(block.depths) + (1 if self.kind == "mid" and block.cross else 0)

        def resnet(i, h):
            return resnets(lambda: ResnetBlock2D(block.channels, cfg.norm_num_groups, cfg.norm_eps, scale, self.dtype,
                                                 name=str(i)), h, temb)

        def transformer(i, h):
            return attentions(lambda: Transformer2D(block, block.depths[i], cfg.norm_num_groups,
                                                    cfg.use_linear_projection, cfg.upcast_attention, self.dtype,
                                                    name=str(i)), h, context)

        if self.kind == "mid":
            x = resnet(0, x)
            if block.cross:
                x = resnet(1, transformer(0, x))
            return x, ()
        for i in range(layers):
            if self.kind == "up":
                x = jnp.concatenate([x, skips[-1 - i]], axis=-1)
            x = resnet(i, x)
            if block.cross:
                x = transformer(i, x)
            outputs.append(x)
        if block.resample and self.kind == "down":
            x = Numbered(name="downsamplers")(lambda: Downsample2D(block.channels, cfg.downsample_padding, self.dtype,
                                                                   name="0"), x)
            outputs.append(x)
        elif block.resample:
            x = Numbered(name="upsamplers")(lambda: Upsample2D(block.channels, self.dtype, name="0"), x, size)
        return x, tuple(outputs)


class UNet(nn.Module):
    """``UNet(config, dtype)(sample [B, C, h, w], timesteps [B], context [B, L, D],
    text_embeds [B, P] = None, time_ids [B, 6] = None) -> [B, out_channels, h, w]``:
    diffusers' ``UNet2DConditionModel`` forward (``encoder_hidden_states`` = ``context``;
    SDXL's ``added_cond_kwargs`` = ``text_embeds`` and ``time_ids``), float32 sample and
    result, the network in ``dtype``."""
    config: UNetConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, sample, timesteps, context, text_embeds=None, time_ids=None):
        cfg = self.config
        channels = cfg.block_out_channels[0]
        t = timestep_embedding(jnp.broadcast_to(timesteps, sample.shape[:1]), channels,
                               flip_sin_to_cos=cfg.flip_sin_to_cos, shift=cfg.freq_shift)
        temb = MLPEmbedding(cfg.time_embed_dim, self.dtype, name="time_embedding")(t.astype(self.dtype))
        if cfg.addition_embed_type == "text_time":
            if text_embeds is None or time_ids is None:
                raise ValueError("this UNet's added conditioning (SDXL's) needs text_embeds and time_ids")
            ids = timestep_embedding(time_ids.reshape(-1), cfg.addition_time_embed_dim,
                                     flip_sin_to_cos=cfg.flip_sin_to_cos, shift=cfg.freq_shift)
            added = jnp.concatenate([text_embeds.astype(jnp.float32), ids.reshape(sample.shape[0], -1)], axis=-1)
            temb = temb + MLPEmbedding(cfg.time_embed_dim, self.dtype, name="add_embedding")(added.astype(self.dtype))
        context = context.astype(self.dtype)
        x = sample.transpose(0, 2, 3, 1).astype(self.dtype)  # NHWC inside
        if cfg.center_input_sample:
            x = 2 * x - 1.0
        x = conv(channels, cfg.conv_in_kernel, self.dtype, "conv_in")(x)
        skips = [x]
        down = Numbered(name="down_blocks")
        for i, block in enumerate(cfg.down):
            x, outputs = down(lambda i=i, block=block: _Blocks(cfg, block, "down", self.dtype, name=str(i)),
                              x, temb, context)
            skips += outputs
        if cfg.mid is not None:
            x, _ = _Blocks(cfg, cfg.mid, "mid", self.dtype, name="mid_block")(x, temb, context)
        up = Numbered(name="up_blocks")
        for i, block in enumerate(cfg.up):
            taken = len(block.depths)
            mine, skips = skips[-taken:], skips[:-taken]
            size = tuple(skips[-1].shape[1:3]) if block.resample else None
            x, _ = up(lambda i=i, block=block: _Blocks(cfg, block, "up", self.dtype, name=str(i)),
                      x, temb, context, tuple(mine), size)
        x = nn.silu(GroupNorm(cfg.norm_num_groups, cfg.norm_eps, self.dtype, name="conv_norm_out")(x))
        x = conv(cfg.out_channels, cfg.conv_out_kernel, self.dtype, "conv_out")(x)
        return x.transpose(0, 3, 1, 2).astype(jnp.float32)


def _example(config: UNetConfig):
    added = {}
    if config.addition_embed_type == "text_time":
        added = dict(text_embeds=jnp.zeros((1, config.pooled_dim)), time_ids=jnp.zeros((1, 6)))
    side = 2 ** (len(config.block_out_channels) - 1)
    return (jnp.zeros((1, config.in_channels, side, side)), jnp.zeros((1,)),
            jnp.zeros((1, 1, config.cross_attention_dim))), added


@functools.lru_cache(maxsize=None)
def _network(dtype_name: str) -> convert.Network:
    return convert.Network(lambda config: UNet(config, jnp.dtype(dtype_name)), _example, TORCH_NAMES)


def param_shapes(config: UNetConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{flat param path: shape} of the UNet, from its config alone (traced once per config)."""
    return _network("float32").param_shapes(config)


def from_torch(state: Mapping[str, np.ndarray], config: UNetConfig, where: str = "unet") -> dict:
    """Params from a ``UNet2DConditionModel`` state dict by the naming rule, each array in its
    stored dtype; WeightsError naming any missing, misshapen or unknown weight."""
    return convert.from_torch(state, param_shapes(config), TORCH_NAMES, where)


def from_flax(flat: Mapping[tuple[str, ...], np.ndarray], config: UNetConfig, where: str = "unet") -> dict:
    """Params from the flat params of diffusers' ``FlaxUNet2DConditionModel`` (a
    ``diffusion_flax_model.msgpack``: ``down_blocks_0/resnets_0/...``, already in Flax's layout)."""
    return convert.from_flax(flat, param_shapes(config), TORCH_NAMES, where, joined=True)


def to_torch(params: Mapping) -> dict[str, np.ndarray]:
    """The ``UNet2DConditionModel`` state dict of ``params``: ``from_torch``'s inverse."""
    return convert.to_torch(params, TORCH_NAMES)
