"""The parameter shapes of the libraries' Flax networks, traced once.

A network's shapes come from tracing its initialiser (``jax.eval_shape``): nothing is
computed, but a UNet's trace takes seconds of Python, and every host needs the shapes
to compile its sampler while its weights load. So:

* a diffusers network's shapes (``diffusers_shapes``) are kept in this process and in
  the promptmill cache folder (``shapes/``), keyed by the network's class, its config
  and the versions of the libraries that trace it: a machine traces each config once;
* a transformers model built without its weights (``transformers_model``, ``_do_init=False``:
  its constructor traces its shapes too) is built once per process and shared, read-only,
  by whoever asks for the same class, config and dtype (a host's two threads both load
  the text encoder: one for its shapes, one for its weights).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import threading

SHAPES = "shapes"  # the cached shapes' folder, inside the promptmill cache folder

# one trace of each kind at a time: a second asker for the same network waits for the first's
_shapes_lock = threading.Lock()
_models_lock = threading.Lock()
_shapes: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
_models: dict[tuple, object] = {}


def _key(module) -> str:
    """What a diffusers network's shapes depend on: its class, its fields (the config it
    was built from, dtype included) and the versions of the libraries that trace it."""
    import diffusers
    import flax
    import jax

    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.name not in ("parent", "name")}
    text = json.dumps([type(module).__module__, type(module).__qualname__, fields, diffusers.__version__,
                       flax.__version__, jax.__version__], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(key: str) -> str:
    from pipeline.model.cache import cache_dir

    return os.path.join(cache_dir(), SHAPES, f"{key}.json")


def _read(path: str) -> dict | None:
    """The shapes kept at ``path``, or None when there are none (or they are unreadable:
    they are traced again and rewritten)."""
    try:
        with open(path, encoding="utf-8") as f:
            kept = json.load(f)
        return {name: (tuple(shape), dtype) for name, (shape, dtype) in kept.items()}
    except (OSError, ValueError, TypeError):
        return None


def _write(path: str, flat: dict) -> None:
    """Kept for the next process, written whole or not at all (a failed write costs a trace)."""
    scratch = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=".shapes-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({name: [list(shape), dtype] for name, (shape, dtype) in flat.items()}, f)
        os.chmod(scratch, 0o644)  # mkstemp made it private; the cache is shared
        os.replace(scratch, path)
    except OSError:
        if scratch and os.path.exists(scratch):
            os.remove(scratch)


def _trace(module) -> dict:
    import jax
    import jax.numpy as jnp
    from flax.traverse_util import flatten_dict

    tree = jax.eval_shape(module.init_weights, jax.ShapeDtypeStruct((2,), jnp.uint32))
    return {"/".join(path): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in flatten_dict(tree).items()}


def diffusers_shapes(module) -> dict:
    """The params of a diffusers Flax network (UNet, VAE) as a nested dict of
    ``jax.ShapeDtypeStruct``s, from its config alone: no initialiser runs, and the
    initialiser's trace runs once per machine (see the module's docstring). A new dict
    each call: callers may change theirs."""
    import jax
    import numpy as np
    from flax.traverse_util import unflatten_dict

    key = _key(module)
    with _shapes_lock:
        flat = _shapes.get(key)
        if flat is None:
            path = _path(key)
            flat = _read(path)
            if flat is None:
                flat = _trace(module)
                _write(path, flat)
            _shapes[key] = flat
    return unflatten_dict({tuple(name.split("/")): jax.ShapeDtypeStruct(shape, np.dtype(dtype))
                           for name, (shape, dtype) in flat.items()})


def transformers_model(cls, config, dtype):
    """``cls(config, dtype=dtype, _do_init=False)``, a transformers Flax model without
    weights (its ``params_shape_tree`` traced by its constructor), built once per process
    for each class, config and dtype. Shared: callers read it (``module``,
    ``params_shape_tree``, ``__call__`` with their own params) and never set its params."""
    import jax.numpy as jnp

    key = (cls, config.to_json_string(use_diff=False), jnp.dtype(dtype).name)
    with _models_lock:
        model = _models.get(key)
        if model is None:
            model = _models[key] = cls(config, dtype=dtype, _do_init=False)
    return model
