"""Rotary position embeddings over several position axes, as diffusers' FLUX transformers
rotate queries and keys: pairs of adjacent channels (even, odd) rotate together."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

ROPE_THETA = 10000  # diffusers' FluxPosEmbed(theta=10000)


def rotary_tables(ids, axes_dims: tuple[int, ...], theta: float = ROPE_THETA):
    """(cos, sin), each float32 [tokens, sum(axes_dims)], of position ids [tokens, axes]:
    per axis, angles position * theta^(-2j/dim) for j < dim/2, each repeated twice
    (pairs of channels rotate together), the axes side by side.

    Computed on the host in float64, as diffusers does, when ``ids`` is a numpy array
    (FluxPipeline's are, and a traced program folds the tables in as constants); in
    float32 on the device when it is traced."""
    host = isinstance(ids, np.ndarray)
    xp = np if host else jnp
    ids = ids.astype(np.float64 if host else jnp.float32)
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        angles = ids[:, axis, None] * (freqs if host else freqs.astype(np.float32))[None, :]
        cos.append(xp.repeat(xp.cos(angles), 2, axis=1))
        sin.append(xp.repeat(xp.sin(angles), 2, axis=1))
    return xp.concatenate(cos, axis=1).astype(np.float32), xp.concatenate(sin, axis=1).astype(np.float32)


def apply_rotary(x, cos, sin):
    """Rotate each (even, odd) channel pair of x [B, tokens, heads, head_dim] by its
    angle, in float32, the result in x's dtype (diffusers' ``apply_rotary_emb``); cos and
    sin [tokens, head_dim], or [B, tokens, head_dim] where each item has its own positions."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    if cos.ndim == 2:  # one table for every item of the batch
        cos, sin = cos[None], sin[None]
    out = x.astype(jnp.float32) * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def grid_position_ids(height: int, width: int, axes: int) -> np.ndarray:
    """float32 [height * width, axes] position ids of a grid of image tokens, row-major:
    the row on axis 1, the column on axis 2, every other axis 0 (FLUX.1's 3 axes, FLUX.2's 4)."""
    ids = np.zeros((height, width, axes), np.float32)
    ids[..., 1] = np.arange(height)[:, None]
    ids[..., 2] = np.arange(width)[None, :]
    return ids.reshape(height * width, axes)
