"""Norms computed in float32 and cast back, as diffusers' transformers compute them."""
from __future__ import annotations

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
