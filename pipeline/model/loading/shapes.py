"""The parameter shapes of the libraries' Flax networks, traced once.

A network's shapes come from tracing its initialiser (``jax.eval_shape``): nothing is
computed, but a UNet's trace takes seconds of Python, and every host needs the shapes
to compile its sampler while its weights load. So:

* a diffusers network's shapes (``diffusers_shapes``) are kept in this process and in
  the promptmill cache folder (``shapes/``), keyed by the network's class, its config
  and the versions of the libraries that trace it: a machine traces each config once;
* a transformers model (``transformers_model``) is its Flax module and its shapes, kept
  the same way (transformers' own model object traces its initialiser in its constructor,
  weights or not), with the call of transformers' CLIP text models; built once per
  process and shared, read-only, by whoever asks for the same class, config and dtype (a
  host's two threads both load the text encoder: one for its shapes, one for its weights).
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
    return _digest([type(module).__module__, type(module).__qualname__, fields, diffusers.__version__,
                    flax.__version__, jax.__version__])


def _digest(parts: list) -> str:
    """The cache key of what a model's shapes depend on (``parts``, JSON-able)."""
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(key: str) -> str:
    from pipeline.model.loading.cache import cache_dir

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

    return _flat(jax.eval_shape(module.init_weights, jax.ShapeDtypeStruct((2,), jnp.uint32)))


def _flat(tree: dict) -> dict:
    """A nested dict of shaped leaves as flat shapes (``"a/b": (shape, dtype name)``), as kept."""
    from flax.traverse_util import flatten_dict

    return {"/".join(path): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in flatten_dict(tree).items()}


def _kept(key: str, trace) -> dict:
    """The flat shapes kept under ``key`` in the cache folder, else ``trace()``'s, kept there."""
    path = _path(key)
    flat = _read(path)
    if flat is None:
        flat = trace()
        _write(path, flat)
    return flat


def _tree(flat: dict) -> dict:
    """Flat shapes as a nested dict of ``jax.ShapeDtypeStruct``s (a new one each call)."""
    import jax
    import numpy as np
    from flax.traverse_util import unflatten_dict

    return unflatten_dict({tuple(name.split("/")): jax.ShapeDtypeStruct(shape, np.dtype(dtype))
                           for name, (shape, dtype) in flat.items()})


def diffusers_shapes(module) -> dict:
    """The params of a diffusers Flax network (UNet, VAE) as a nested dict of
    ``jax.ShapeDtypeStruct``s, from its config alone: no initialiser runs, and the
    initialiser's trace runs once per machine (see the module's docstring). A new dict
    each call: callers may change theirs."""
    key = _key(module)
    with _shapes_lock:
        flat = _shapes.get(key)
        if flat is None:
            flat = _shapes[key] = _kept(key, lambda: _trace(module))
    return _tree(flat)


@dataclasses.dataclass(frozen=True, eq=False)
class TransformersModel:
    """A transformers Flax model without weights, as promptmill uses one: the Flax module
    the library's model object holds (``module_class(config, dtype)``), that object's
    ``params_shape_tree`` and ``base_model_prefix``, and, for the CLIP text models, their
    call. Params are always passed in."""
    config: object
    module: object
    params_shape_tree: dict
    base_model_prefix: str

    def __call__(self, input_ids, params, output_hidden_states=None):
        """transformers' ``FlaxCLIPTextPreTrainedModel.__call__`` with the arguments a run
        gives it: the ids alone (every token attended, positions in order), deterministic,
        the config's output flags unless ``output_hidden_states`` says otherwise."""
        import jax.numpy as jnp

        config = self.config
        hidden = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        positions = jnp.broadcast_to(jnp.arange(jnp.atleast_2d(input_ids).shape[-1]), input_ids.shape)
        return self.module.apply({"params": params}, jnp.array(input_ids, dtype="i4"),
                                 jnp.array(jnp.ones_like(input_ids), dtype="i4"), jnp.array(positions, dtype="i4"),
                                 True, config.output_attentions, hidden, config.return_dict)


def _transformers_key(cls, config_json: str, dtype_name: str) -> str:
    import flax
    import jax
    import transformers

    return _digest([cls.__module__, cls.__qualname__, config_json, dtype_name, transformers.__version__,
                    flax.__version__, jax.__version__])


def _transformers_trace(cls, config, dtype) -> dict:
    """The flat shapes of ``cls``' params, traced by the library's own model object."""
    return _flat(cls(config, dtype=dtype, _do_init=False).params_shape_tree)


def transformers_model(cls, config, dtype) -> TransformersModel:
    """The ``TransformersModel`` of transformers' Flax model class ``cls`` (e.g.
    ``FlaxCLIPTextModel``) for ``config`` and ``dtype``: its shapes traced once per
    machine (see the module's docstring), the model built once per process. Shared:
    callers read it and pass their own params."""
    import jax.numpy as jnp

    config_json, dtype_name = config.to_json_string(use_diff=False), jnp.dtype(dtype).name
    with _models_lock:
        model = _models.get((cls, config_json, dtype_name))
        if model is None:
            key = _transformers_key(cls, config_json, dtype_name)
            flat = _kept(key, lambda: _transformers_trace(cls, config, dtype))
            model = _models[(cls, config_json, dtype_name)] = TransformersModel(
                config=config, module=cls.module_class(config=config, dtype=dtype), params_shape_tree=_tree(flat),
                base_model_prefix=cls.base_model_prefix)
    return model
