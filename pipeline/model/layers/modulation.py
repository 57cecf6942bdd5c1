"""Adaptive LayerNorm modulation from a conditioning vector (diffusers' AdaLN-zero and
continuous AdaLN)."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from pipeline.model.layers.norms import layer_norm


class AdaLayerNormZero(nn.Module):
    """``linear(silu(emb))`` in ``chunks`` parts, the first two (shift, scale) applied to
    the normed x: (x', the other parts). 6 parts in double blocks, 3 in single ones."""
    chunks: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, emb):
        parts = jnp.split(nn.Dense(self.chunks * x.shape[-1], dtype=self.dtype, name="linear")(nn.silu(emb)),
                          self.chunks, axis=1)
        shift, scale = parts[0], parts[1]
        return layer_norm(x) * (1 + scale[:, None]) + shift[:, None], parts[2:]


class AdaLayerNormContinuous(nn.Module):
    """diffusers' ``AdaLayerNormContinuous`` (``norm_out``): scale first, then shift."""
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, emb):
        scale, shift = jnp.split(nn.Dense(2 * x.shape[-1], dtype=self.dtype, name="linear")(nn.silu(emb)), 2, axis=1)
        return layer_norm(x) * (1 + scale[:, None]) + shift[:, None]
