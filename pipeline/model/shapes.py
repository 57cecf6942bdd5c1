"""Shapes and dtypes of inputs and params, for programs lowered without data."""
from __future__ import annotations


def struct(tree, dtype=None):
    """Shapes and dtypes only (``jax.ShapeDtypeStruct``s): lowering needs no real weights.
    ``dtype``: floating leaves in it instead (params a model casts on the devices:
    ``Model.param_dtype``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def leaf(x):
        floating = dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(np.shape(x), dtype if floating else x.dtype)

    return jax.tree_util.tree_map(leaf, tree)


def on(sharding):
    """A ``jax.ShapeDtypeStruct`` maker for inputs placed by ``sharding`` (None: unplaced)."""
    import jax

    def make(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return make


def params(tree, sharding, dtype=None):
    """``struct(tree, dtype)``, placed by ``sharding``."""
    import jax

    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                  struct(tree, dtype))
