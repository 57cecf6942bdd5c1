"""Norms computed in float32 and cast back: LayerNorm and RMSNorm as diffusers' transformers
compute them, and PyTorch's affine LayerNorm and GroupNorm, as the UNets, the VAE decoder
and CLIP use them."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

NORM_EPS = 1e-6  # the transformers' LayerNorm and q/k RMSNorm


def layer_norm(x, eps: float = NORM_EPS):
    """LayerNorm without scale or bias, computed in float32, in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(variance + eps)).astype(x.dtype)


class RMSNorm(nn.Module):
    """PyTorch's ``nn.RMSNorm`` over the last axis: normalised in float32, cast back to x's
    dtype, then scaled."""
    eps: float = NORM_EPS

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        return normed * scale.astype(x.dtype)


class LayerNorm(nn.Module):
    """PyTorch's ``nn.LayerNorm`` with its weight and bias (``scale``, ``bias``) over the
    last axis: normalised in float32 (two passes, as PyTorch's), scaled and shifted in
    float32, cast to ``dtype``."""
    eps: float = 1e-5
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        return _affine(self, layer_norm(x.astype(jnp.float32), self.eps))


class GroupNorm(nn.Module):
    """PyTorch's ``nn.GroupNorm`` on channels-last input ([B, ..., C]): each group of
    ``C / groups`` channels normalised over its channels and every position, in float32
    (two passes: the mean, then the mean square of the deviations, as PyTorch), then
    scaled and shifted per channel (``scale``, ``bias``) and cast to ``dtype``."""
    groups: int
    eps: float = 1e-5
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        channels = x.shape[-1]
        grouped = x.astype(jnp.float32).reshape(x.shape[0], -1, self.groups, channels // self.groups)
        mean = jnp.mean(grouped, axis=(1, 3), keepdims=True)
        centred = grouped - mean
        variance = jnp.mean(jnp.square(centred), axis=(1, 3), keepdims=True)
        return _affine(self, (centred * jax.lax.rsqrt(variance + self.eps)).reshape(x.shape))


def _affine(module: nn.Module, normed):
    """``normed`` (float32, channels last) scaled and shifted per channel by ``module``'s
    ``scale`` and ``bias`` (PyTorch's weight and bias) in float32, cast to its dtype."""
    width = normed.shape[-1]
    scale = module.param("scale", nn.initializers.ones, (width,)).astype(jnp.float32)
    bias = module.param("bias", nn.initializers.zeros, (width,)).astype(jnp.float32)
    return (normed * scale + bias).astype(module.dtype)
