"""Seeds and PRNG keys: the one place where randomness is derived.

The contract: the key of an image depends only on
(record seed, image index) and is ``fold_in(PRNGKey(seed), image_index)``.
Initial latents are ``jax.random.normal(key, (C, H/f, W/f), float32)``; the noise a
stochastic sampler (Euler ancestral, LCM) adds at step ``i`` is
``jax.random.normal(fold_in(key, i), (C, H/f, W/f), float32)``.

Seeds are 63-bit. In JAX's default 32-bit mode ``PRNGKey(seed)`` silently keeps
only the low 32 bits of a larger seed, which would make distinct records share
noise. We therefore build the threefry key data ``[seed >> 32, seed & 0xffffffff]``
ourselves; that is exactly ``PRNGKey(seed)`` under ``jax_enable_x64`` and, for
seeds below 2**32, exactly ``PRNGKey(seed)`` in either mode.
"""
from __future__ import annotations

import hashlib

import numpy as np

MAX_SEED = 2**63  # seeds live in [0, MAX_SEED)
PRNG_IMPL = "threefry2x32"


def record_seed(run_seed: int, record_id: str) -> int:
    """Stable 63-bit seed of a record that has no explicit seed."""
    digest = hashlib.sha256(f"{int(run_seed)}\x00{record_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & (MAX_SEED - 1)


def seed_words(seed: int) -> tuple[int, int]:
    """The two uint32 words of the threefry key of ``seed`` (high, low)."""
    seed = int(seed)
    if not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed >> 32, seed & 0xFFFFFFFF


def fold_keys(seed_hi, seed_lo, image_index):
    """Per-image keys from uint32 seed words and indices (traceable, vectorised).

    ``seed_hi``, ``seed_lo`` and ``image_index`` are uint32 arrays of one shape
    ``(N,)``; returns N typed keys, the n-th being
    ``fold_in(PRNGKey(seed_n), image_index_n)``.
    """
    import jax
    import jax.numpy as jnp

    def one(hi, lo, idx):
        base = jax.random.wrap_key_data(jnp.stack([hi, lo]).astype(jnp.uint32), impl=PRNG_IMPL)
        return jax.random.fold_in(base, idx)

    return jax.vmap(one)(seed_hi, seed_lo, image_index)


def image_key(seed: int, image_index: int):
    """The key of one image: ``fold_in(PRNGKey(seed), image_index)``."""
    hi, lo = seed_words(seed)
    keys = fold_keys(np.array([hi], np.uint32), np.array([lo], np.uint32),
                     np.array([image_index], np.uint32))
    return keys[0]


def initial_latents(key, shape):
    """The initial latents of one image, drawn from its own key."""
    import jax
    import jax.numpy as jnp

    return jax.random.normal(key, shape, dtype=jnp.float32)


def step_noise(key, step, shape):
    """The fresh noise a stochastic sampler adds at ``step`` to one image: drawn from
    ``fold_in(image key, step)``, so it depends on the image alone, never on its batch."""
    import jax
    import jax.numpy as jnp

    return jax.random.normal(jax.random.fold_in(key, step), shape, dtype=jnp.float32)
