"""Timestep embeddings: the sinusoid of a timestep and the MLP diffusers runs it through."""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

TIME_CHANNELS = 256  # the sinusoidal projection of a timestep (or guidance) in diffusers' transformers


def timestep_embedding(t, channels: int = TIME_CHANNELS, max_period: float = 10000.0):
    """float32 [B, channels]: [cos, sin] of t * max_period^(-j/(channels/2)), diffusers'
    ``get_timestep_embedding`` with ``flip_sin_to_cos=True`` and no frequency shift."""
    half = channels // 2
    # the exponents in float32 as torch makes them; their exp correctly rounded, as torch's
    # float32 exp nearly always is (numpy's float32 exp is off by an ulp in 53 of these 128,
    # which moves a sinusoid of t = 5000 by 4e-4)
    exponents = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32) / np.float32(half)
    freqs = np.exp(exponents.astype(np.float64)).astype(np.float32)
    args = t.astype(jnp.float32)[:, None] * jnp.asarray(freqs, jnp.float32)[None, :]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class MLPEmbedding(nn.Module):
    """``linear_1``, SiLU, ``linear_2``: diffusers' ``TimestepEmbedding`` and
    ``PixArtAlphaTextProjection(act_fn="silu")`` alike."""
    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.features, dtype=self.dtype, name="linear_1")(x)
        return nn.Dense(self.features, dtype=self.dtype, name="linear_2")(nn.silu(x))
