"""PyTorch state dicts <-> the params of promptmill's own networks, by one naming rule.

The rule (``torch_name``): a Flax parameter's path is its PyTorch name split at the
dots, except for
- the leaf: Flax's ``kernel`` is a Linear's ``weight``, stored transposed ([in, out]
  for PyTorch's [out, in]), or a convolution's, its axes moved ([kh, kw, in, out] for
  PyTorch's [out, in, kh, kw]); ``scale`` (a norm's) and ``embedding`` (an Embedding's)
  are ``weight`` as stored; ``bias`` is ``bias``, and a batch norm's running statistics
  keep their names;
- the stacks: a path under one of the network's scanned stacks (``TorchNames.stacks``, e.g.
  ``transformer_blocks``) holds every block's weight on a leading axis, block ``i``
  being PyTorch's ``transformer_blocks.{i}.…``;
- the few weights a network moves (``TorchNames.moved``), e.g. T5's relative position
  bias, which every layer uses but the first layer stores.

Arrays keep their stored dtype: a bf16 checkpoint stays bf16 (a 12B model must never
have a float32 copy in host memory). A transpose is a view of the memory-mapped file;
a stack is one copy, in the stored dtype.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Mapping

import numpy as np

from pipeline.model.loading.weights import WeightsError

# Flax leaf name -> PyTorch parameter name
LEAVES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias",
          "running_mean": "running_mean", "running_var": "running_var"}
# a Flax convolution's kernel [kh, kw, in, out] from PyTorch's [out, in, kh, kw], and back
_CONV_FROM_TORCH, _CONV_TO_TORCH = (2, 3, 1, 0), (3, 2, 0, 1)


@dataclasses.dataclass(frozen=True)
class TorchNames:
    """What a network's naming rule needs besides the rule itself."""
    stacks: tuple[str, ...]  # "/"-joined Flax paths of its scanned stacks
    moved: Mapping[str, str] = dataclasses.field(default_factory=dict)  # "/"-joined Flax path -> PyTorch name
    aliases: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # name -> other names (tied)
    ignored: tuple[str, ...] = ()  # PyTorch name prefixes that are not weights of the network


def stack_of(path: tuple[str, ...], torch_names: TorchNames) -> str | None:
    """The stack ``path`` lies under, or None."""
    joined = "/".join(path)
    return next((stack for stack in torch_names.stacks if joined.startswith(stack + "/")), None)


def torch_name(path: tuple[str, ...], torch_names: TorchNames, index: int | None = None) -> str:
    """The PyTorch name of the Flax parameter at ``path`` (of block ``index`` for a
    stacked one)."""
    joined = "/".join(path)
    if joined in torch_names.moved:
        return torch_names.moved[joined]
    if path[-1] not in LEAVES:
        raise ValueError(f"no PyTorch name for the Flax parameter {joined}: its leaf is not one of {', '.join(LEAVES)}")
    parts = list(path[:-1]) + [LEAVES[path[-1]]]
    stack = stack_of(path, torch_names)
    if stack is not None:
        if index is None:
            raise ValueError(f"{joined} is stacked: a block index is needed")
        depth = stack.count("/") + 1
        parts = parts[:depth] + [str(index)] + parts[depth:]
    return ".".join(parts)


def flatten(tree, prefix=()) -> dict[tuple[str, ...], object]:
    """{path: leaf} of a nested mapping."""
    if isinstance(tree, Mapping):
        flat = {}
        for key, value in tree.items():
            flat.update(flatten(value, prefix + (str(key),)))
        return flat
    return {prefix: tree}


def unflatten(flat: Mapping[tuple[str, ...], object]) -> dict:
    """``flatten``'s inverse: a nested dict."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _blocks(path, shape, torch_names) -> list[int | None]:
    return list(range(shape[0])) if stack_of(path, torch_names) is not None else [None]


def torch_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The PyTorch shape of one (unstacked) Flax parameter of ``shape`` at ``path``."""
    if path[-1] != "kernel":
        return tuple(shape)
    return tuple(shape[axis] for axis in _CONV_TO_TORCH) if len(shape) == 4 else tuple(shape[::-1])


def from_torch_array(path: tuple[str, ...], array: np.ndarray) -> np.ndarray:
    """A PyTorch weight in the Flax layout of the parameter at ``path`` (a view)."""
    if path[-1] != "kernel":
        return array
    return array.transpose(_CONV_FROM_TORCH) if array.ndim == 4 else array.T


def to_torch_array(path: tuple[str, ...], array: np.ndarray) -> np.ndarray:
    """``from_torch_array``'s inverse (a view)."""
    if path[-1] != "kernel":
        return array
    return array.transpose(_CONV_TO_TORCH) if array.ndim == 4 else array.T


def torch_shapes(shapes: Mapping[tuple[str, ...], tuple[int, ...]],
                 torch_names: TorchNames) -> dict[str, tuple[int, ...]]:
    """{PyTorch name: shape} of the network whose flat Flax param shapes are ``shapes``:
    what its PyTorch checkpoint holds."""
    out = {}
    for path, shape in shapes.items():
        shape = tuple(shape)
        for index in _blocks(path, shape, torch_names):
            one = shape[1:] if index is not None else shape
            out[torch_name(path, torch_names, index)] = torch_shape(path, one)
    return out


def _gathered(shapes: Mapping[tuple[str, ...], tuple[int, ...]], torch_names: TorchNames, where: str, lookup,
              convert) -> dict:
    """Flat params of the network whose flat param shapes are ``shapes``, blocks stacked:
    ``lookup(path, index, shape)`` gives each block's (weight name, stored array or None,
    the shape it must have as stored), ``convert(path, array)`` its Flax array.
    WeightsError, naming ``where`` and the weights, when any is missing or has another shape."""
    flat, missing, odd = {}, [], []
    for path, shape in shapes.items():
        shape, arrays = tuple(shape), []
        blocks = _blocks(path, shape, torch_names)
        for index in blocks:
            name, array, expected = lookup(path, index, shape[1:] if index is not None else shape)
            if array is None:
                missing.append(name)
            elif tuple(array.shape) != expected:
                odd.append(f"{name} has shape {tuple(array.shape)}, the network expects {expected}")
            else:
                arrays.append(convert(path, array))
        if len(arrays) == len(blocks):
            flat[path] = np.stack(arrays) if stack_of(path, torch_names) is not None else arrays[0]
    if missing:
        raise WeightsError(f"{where}: {len(missing)} weight(s) missing, e.g. {', '.join(missing[:5])}")
    if odd:
        raise WeightsError(f"{where}: {'; '.join(odd[:5])}")
    return flat


def _refuse_unknown(where: str, unknown: list[str]) -> None:
    if unknown:
        raise WeightsError(f"{where}: {len(unknown)} weight(s) the network does not have, e.g. "
                           f"{', '.join(unknown[:5])}")


def from_torch(state: Mapping[str, np.ndarray], shapes: Mapping[tuple[str, ...], tuple[int, ...]],
               torch_names: TorchNames, where: str) -> dict:
    """Nested Flax params from a PyTorch state dict ({name: array}, e.g. memory-mapped
    safetensors), for a network whose flat param shapes are ``shapes``. Each array keeps
    its dtype. WeightsError, naming ``where`` and the weights, when any is missing, has
    another shape than the network's, or is not a weight of the network (names under
    ``torch_names.ignored`` excepted)."""
    used = set()

    def lookup(path, index, shape):
        name = torch_name(path, torch_names, index)
        candidates = (name, *torch_names.aliases.get(name, ()))
        used.update(candidates)
        found = next((n for n in candidates if n in state), None)
        return (name, None, None) if found is None else (found, state[found], torch_shape(path, shape))

    flat = _gathered(shapes, torch_names, where, lookup, from_torch_array)
    _refuse_unknown(where, sorted(name for name in state
                                  if name not in used and not name.startswith(torch_names.ignored)))
    return unflatten(flat)


def flax_key(path: tuple[str, ...], torch_names: TorchNames, index: int | None, *, joined: bool,
             renames: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The key that the libraries' own Flax modules give the parameter at ``path`` (of block
    ``index`` when stacked), in their msgpack files: PyTorch's module path with our leaf,
    a list's index joined to the list's name (``joined``: diffusers' ``down_blocks_0``) or a
    key of its own (transformers' ``layers/0``), module names in ``renames`` renamed (after
    joining: ``{"to_out_0": "proj_attn"}``). A moved parameter keeps its path."""
    if "/".join(path) in torch_names.moved:
        return path
    parts: list[str] = []
    for part in torch_name(path, torch_names, index).split(".")[:-1]:
        if joined and part.isdigit() and parts:
            parts[-1] = f"{parts[-1]}_{part}"
        else:
            parts.append(part)
    renames = renames or {}
    return (*(renames.get(part, part) for part in parts), path[-1])


def from_flax(flat: Mapping[tuple[str, ...], np.ndarray], shapes: Mapping[tuple[str, ...], tuple[int, ...]],
              torch_names: TorchNames, where: str, *, joined: bool, renames: Mapping[str, str] | None = None,
              ignored: tuple[str, ...] = ()) -> dict:
    """Nested params from the flat params of a Flax checkpoint written by diffusers' or
    transformers' own Flax module of the same network (a msgpack file: ``flax_key`` names
    each weight, already in Flax's layout), blocks stacked, each array in its stored dtype.
    WeightsError, naming ``where`` and the weights, when any is missing, has another shape,
    or is not a weight of the network (keys whose "/"-joined form starts with one of
    ``ignored`` excepted)."""
    used = set()

    def lookup(path, index, shape):
        key = flax_key(path, torch_names, index, joined=joined, renames=renames)
        used.add(key)
        return "/".join(key), flat.get(key), shape

    out = _gathered(shapes, torch_names, where, lookup, lambda path, array: np.asarray(array))
    _refuse_unknown(where, sorted("/".join(key) for key in flat
                                  if key not in used and not "/".join(key).startswith(ignored)))
    return unflatten(out)


def to_torch(params: Mapping, torch_names: TorchNames) -> dict[str, np.ndarray]:
    """The PyTorch state dict ({name: numpy array}, each in its param's dtype) of nested
    Flax params: ``from_torch``'s inverse."""
    out = {}
    for path, value in flatten(params).items():
        array = np.asarray(value)
        for index in _blocks(path, array.shape, torch_names):
            one = array[index] if index is not None else array
            out[torch_name(path, torch_names, index)] = to_torch_array(path, one)
    return out


def abstract_params(shapes: Mapping[str, Mapping[tuple[str, ...], tuple[int, ...]]], dtype) -> dict:
    """{component: nested ``jax.ShapeDtypeStruct``s in ``dtype``} of {component: flat param
    shapes}: a model's params from its configs alone."""
    import jax

    return {component: unflatten({path: jax.ShapeDtypeStruct(shape, dtype) for path, shape in flat.items()})
            for component, flat in shapes.items()}


def flat_shapes(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path: shape} of a nested tree of arrays or ``jax.ShapeDtypeStruct``s."""
    return {path: tuple(leaf.shape) for path, leaf in flatten(tree).items()}


@dataclasses.dataclass(frozen=True)
class Network:
    """One of our own networks, carried from its config to its module, parameter shapes
    and weights: ``module(config)`` builds it, ``example(config)`` gives the (args, kwargs)
    of the smallest call that initialises it, and ``torch_names`` says how PyTorch torch_names its
    parameters (``from_torch``, ``to_torch``: by rule, blocks stacked). A network module
    exports its ``Network`` (or, with options of its own, ``variants``): callers read its
    shapes and convert its weights through it, so that no network writes these again."""
    module: type
    example: object  # config -> (args, kwargs) of ``module.init`` after the random key
    torch_names: TorchNames | None = None

    def param_shapes(self, config) -> dict[tuple[str, ...], tuple[int, ...]]:
        """{flat param path: shape}, from the config alone (traced once per config: nothing
        is computed, a 12B model's shapes come in a moment)."""
        with _TRACING:  # a host's load and its compile thread ask at once: one traces, the other waits
            return dict(_traced_shapes(self.module, self.example, config))  # a copy: the cached one is shared

    def from_torch(self, state: Mapping[str, np.ndarray], config, where: str) -> dict:
        """Params from a PyTorch state dict ({name: array}), each array in its stored dtype,
        blocks stacked; WeightsError, naming ``where``, for any missing, misshapen or unknown
        weight."""
        return from_torch(state, self.param_shapes(config), self.torch_names, where)

    def to_torch(self, params: Mapping) -> dict[str, np.ndarray]:
        """The PyTorch state dict of ``params``: ``from_torch``'s inverse."""
        return to_torch(params, self.torch_names)


def variants(module, example, torch_names: TorchNames):
    """``network(**options)``: the ``Network`` of ``module(config, **options)`` (a text encoder
    run to some of its layers, ...), one object for the same options, so that its shapes are
    traced once a config. Ask with the options in one order: each order is an object."""
    @functools.lru_cache(maxsize=None)
    def network(**options) -> Network:
        return Network(functools.partial(module, **options), example, torch_names)

    return network


def token_ids_example(config):
    """A text encoder's smallest call (``Network.example``): one row of two token ids."""
    import jax.numpy as jnp

    return (jnp.zeros((1, 2), jnp.int32),), {}


_TRACING = threading.Lock()


@functools.lru_cache(maxsize=16)
def _traced_shapes(module: type, example, config) -> dict[tuple[str, ...], tuple[int, ...]]:
    import jax

    args, kwargs = example(config)
    tree = jax.eval_shape(lambda: module(config).init(jax.random.PRNGKey(0), *args, **kwargs))
    return flat_shapes(tree["params"])
