"""Timestep embeddings: the sinusoid of a timestep and the MLP diffusers runs it through
(``TimestepEmbedding``: the transformers' and the UNets' alike)."""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

TIME_CHANNELS = 256  # the sinusoidal projection of a timestep (or guidance) in diffusers' transformers


def timestep_embedding(t, channels: int = TIME_CHANNELS, max_period: float = 10000.0, *, flip_sin_to_cos: bool = True,
                       shift: float = 0.0):
    """float32 [B, channels]: the sines and cosines of t * max_period^(-j/(channels/2 - shift)),
    diffusers' ``get_timestep_embedding``: [cos, sin] with ``flip_sin_to_cos`` (its
    transformers', and the SD UNets' ``Timesteps``), else [sin, cos]; an odd ``channels``
    gets a zero last column. ``t`` float or int [B]."""
    half = channels // 2
    # the exponents in float32 as torch makes them; their exp correctly rounded, as torch's
    # float32 exp nearly always is (numpy's float32 exp is off by an ulp in 53 of these 128,
    # which moves a sinusoid of t = 5000 by 4e-4)
    exponents = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32) / np.float32(half - shift)
    freqs = np.exp(exponents.astype(np.float64)).astype(np.float32)
    args = t.astype(jnp.float32)[:, None] * jnp.asarray(freqs, jnp.float32)[None, :]
    parts = [jnp.cos(args), jnp.sin(args)] if flip_sin_to_cos else [jnp.sin(args), jnp.cos(args)]
    if channels % 2:
        parts.append(jnp.zeros_like(args[:, :1]))
    return jnp.concatenate(parts, axis=-1)


class MLPEmbedding(nn.Module):
    """``linear_1``, SiLU, ``linear_2``: diffusers' ``TimestepEmbedding`` and
    ``PixArtAlphaTextProjection(act_fn="silu")`` alike."""
    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.features, dtype=self.dtype, name="linear_1")(x)
        return nn.Dense(self.features, dtype=self.dtype, name="linear_2")(nn.silu(x))
