"""The convolutional blocks the SD UNets and the VAE decoders share, as diffusers' PyTorch
modules compute them (``ResnetBlock2D``, ``Upsample2D``, ``Downsample2D``), on
channels-last (NHWC) arrays and named as PyTorch names them, so weights load by rule
(``pipeline.model.loading.convert``: a convolution's ``weight`` [out, in, kh, kw] is Flax's
``kernel`` [kh, kw, in, out]).

Also ``Numbered``: PyTorch's ``nn.ModuleList`` (or any module that only holds others) as a
Flax parent, its children named "0", "1", ... (or as the caller names them), so a
parameter's path is its PyTorch name split at the dots (``down_blocks/1/resnets/0/conv1/kernel``
for ``down_blocks.1.resnets.0.conv1.weight``).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from pipeline.model.layers.norms import GroupNorm


def conv(features: int, kernel: int, dtype, name: str, stride: int = 1, padding: int | None = None) -> nn.Conv:
    """PyTorch's ``nn.Conv2d(..., kernel, stride, padding)`` (default padding: the kernel's
    half, so a stride-1 convolution keeps the size)."""
    pad = (kernel - 1) // 2 if padding is None else padding
    return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding=((pad, pad), (pad, pad)),
                   dtype=dtype, name=name)


class Numbered(nn.Module):
    """A ``nn.ModuleList``: ``Numbered(name="resnets")(make, *args)`` runs ``make()``, a
    module built here with ``name=str(index)``, on ``args`` (blocks of several lists can
    be called in turn, as PyTorch's forwards interleave them). A PyTorch module that holds
    others and no weights of its own (CLIP's ``encoder`` and ``embeddings``, Z-Image's
    ``cap_embedder``) is
    one too, its children named as PyTorch names them."""

    @nn.compact
    def __call__(self, make, *args, **kwargs):
        return make()(*args, **kwargs)


class ResnetBlock2D(nn.Module):
    """diffusers' ``ResnetBlock2D`` with its defaults (SiLU, ``time_embedding_norm``
    "default", no up/down sampling inside): norm1, SiLU, conv1, plus the projected time
    embedding (``time_emb_proj`` of SiLU(temb), when ``temb`` is given), norm2, SiLU,
    conv2; the input through ``conv_shortcut`` (1x1) when the channels change; the sum
    divided by ``output_scale_factor``."""
    out_channels: int
    groups: int = 32
    eps: float = 1e-5
    output_scale_factor: float = 1.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, temb=None):
        h = nn.silu(GroupNorm(self.groups, self.eps, self.dtype, name="norm1")(x))
        h = conv(self.out_channels, 3, self.dtype, "conv1")(h)
        if temb is not None:
            h = h + nn.Dense(self.out_channels, dtype=self.dtype, name="time_emb_proj")(nn.silu(temb))[:, None, None]
        h = nn.silu(GroupNorm(self.groups, self.eps, self.dtype, name="norm2")(h))
        h = conv(self.out_channels, 3, self.dtype, "conv2")(h)
        if x.shape[-1] != self.out_channels:
            x = conv(self.out_channels, 1, self.dtype, "conv_shortcut")(x)
        out = x + h
        return out if self.output_scale_factor == 1 else out / self.output_scale_factor


def nearest(x, height: int, width: int):
    """``x`` [B, h, w, C] resized to [B, height, width, C] by PyTorch's "nearest"
    interpolation (output pixel i reads input pixel floor(i * h / height))."""
    h, w = x.shape[1], x.shape[2]
    if (height, width) == (2 * h, 2 * w):  # the common case, without a gather
        return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    rows = (jnp.arange(height) * h) // height
    cols = (jnp.arange(width) * w) // width
    return x[:, rows][:, :, cols]


class Upsample2D(nn.Module):
    """diffusers' ``Upsample2D(use_conv=True)``: nearest interpolation to twice the size
    (or to ``size``, (height, width), as the UNet asks when a skip connection's size is
    odd), then a 3x3 convolution ``conv``."""
    channels: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, size: tuple[int, int] | None = None):
        height, width = size or (2 * x.shape[1], 2 * x.shape[2])
        return conv(self.channels, 3, self.dtype, "conv")(nearest(x, height, width))


class Downsample2D(nn.Module):
    """diffusers' ``Downsample2D(use_conv=True)``: a 3x3 convolution ``conv`` of stride 2,
    padded by ``padding`` each side (0: one pixel at the bottom and right only, as
    diffusers pads it)."""
    channels: int
    padding: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        if self.padding == 0:
            x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        return conv(self.channels, 3, self.dtype, "conv", stride=2, padding=self.padding)(x)
