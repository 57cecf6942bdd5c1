"""Feed-forward layers named as diffusers' PyTorch modules name theirs."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

MLP_RATIO = 4.0  # diffusers' FeedForward width, times the input's


class Indexed(nn.Module):
    """A Dense named by its index inside a module: PyTorch's ``to_out.0`` (FLUX.2's have no bias)."""
    features: int
    index: str
    dtype: Any = jnp.float32
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, dtype=self.dtype, use_bias=self.use_bias, name=self.index)(x)


class GeluProjection(nn.Module):
    """diffusers' ``GELU(approximate="tanh")``: ``proj``, then the activation."""
    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(self.features, dtype=self.dtype, name="proj")(x), approximate=True)


class FeedForwardNet(nn.Module):
    """``net.0`` (GELU-tanh projection), ``net.2`` (output; net.1 is dropout)."""
    dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        hidden = GeluProjection(int(self.dim * MLP_RATIO), self.dtype, name="0")(x)
        return nn.Dense(self.dim, dtype=self.dtype, name="2")(hidden)


class FeedForward(nn.Module):
    """diffusers' ``FeedForward(activation_fn="gelu-approximate")``."""
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        return FeedForwardNet(x.shape[-1], self.dtype, name="net")(x)
