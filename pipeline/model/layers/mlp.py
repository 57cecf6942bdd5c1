"""Feed-forward layers named as diffusers' and transformers' PyTorch modules name theirs."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
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


class SwiGLU(nn.Module):
    """A gated feed-forward without biases, ``down(silu(gate x) * up x)`` (Qwen3's MLP, Z-Image's
    feed-forward): ``hidden`` wide, ``features`` out; ``names``: its three layers' names in the
    checkpoint (gate, up, down)."""
    hidden: int
    features: int
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        def dense(size, name):
            return nn.Dense(size, use_bias=False, dtype=self.dtype, name=name)

        gate, up, down = self.names
        hidden = jax.nn.silu(dense(self.hidden, gate)(x)) * dense(self.hidden, up)(x)
        return dense(self.features, down)(hidden)


class FeedForward(nn.Module):
    """diffusers' ``FeedForward(activation_fn="gelu-approximate")``."""
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        return FeedForwardNet(x.shape[-1], self.dtype, name="net")(x)
