"""The JSON description of a compiled program's parts (avals, shardings, trees, debug info),
written and read back without pickling anything.

jax's only public way to rebuild a ``jax.stages.Compiled`` around an executable's bytes
(``jax.experimental.serialize_executable``) unpickles what it reads. So these functions
read and build jax's own classes (``jax._src``), as this jax has them (jax's version is part
of every key and header). A jax whose internals differ fails the round trip
``program.checked_description`` makes before an entry is indexed, or the load (then it is
logged, compiled and replaced): it is never trusted blindly."""
from __future__ import annotations

import functools
import re
import sys


class Refused(Exception):
    """An entry (or a program) this module will not load (or describe): the reason."""


# -- the JSON description of a program (``_describe``), and back (``Program``)
#
# jax's only public way to rebuild a ``jax.stages.Compiled`` around an executable's bytes
# (``jax.experimental.serialize_executable``) unpickles what it reads. So the functions
# below read and build jax's own classes (``jax._src``: pxla's UnloadedMeshExecutable,
# stages.Compiled, ShapedArray, AbstractMesh), as jax 0.10 has them (setup.py keeps jax
# below 0.11, and jax's version is part of every key and header). A jax whose internals
# differ fails the round trip ``checked_description`` makes before an entry is indexed,
# or the load (then it is logged, compiled and replaced): it is never trusted blindly.

_DTYPE_NAMES = ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")
_NODE_MODULES = ("pipeline.",)  # where a tree's own node classes may be imported from


@functools.lru_cache(maxsize=1)
def _dtypes() -> dict:
    """The dtypes a description may name, by name: an explicit table, nothing looked up."""
    import jax.numpy as jnp
    import numpy as np

    table = {}
    for name in _DTYPE_NAMES:
        if hasattr(jnp, name):
            dtype = np.dtype(getattr(jnp, name))
            table[dtype.name] = dtype
    return table


def dtype_json(dtype) -> str:
    import numpy as np

    name = np.dtype(dtype).name
    if _dtypes().get(name) != dtype:
        raise Refused(f"dtype {dtype}")
    return name


def dtype_from(name):
    if not isinstance(name, str) or name not in _dtypes():
        raise Refused(f"dtype {name!r}")
    return _dtypes()[name]


def ints_from(values) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(type(v) is int for v in values):
        raise Refused(f"not a list of integers: {values!r}")
    return list(values)


def _strs(values) -> list[str]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise Refused(f"not a list of strings: {values!r}")
    return list(values)


def _spec_json(spec) -> list:
    """A PartitionSpec: per dimension null, an axis name, or a list of them."""
    from jax.sharding import PartitionSpec

    if type(spec) is not PartitionSpec or spec.unreduced or spec.reduced:
        raise Refused(f"partition spec {spec}")
    entries = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            entries.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(name, str) for name in entry):
            entries.append(list(entry))
        else:
            raise Refused(f"partition spec {spec}")
    return entries


def _spec(entries):
    from jax.sharding import PartitionSpec

    if not isinstance(entries, list):
        raise Refused(f"partition spec {entries!r}")
    return PartitionSpec(*[entry if entry is None or isinstance(entry, str) else tuple(_strs(entry))
                           for entry in entries])


def _axis_types(names) -> tuple:
    from jax.sharding import AxisType

    if not all(isinstance(name, str) and name in AxisType.__members__ for name in _strs(names)):
        raise Refused(f"axis types {names!r}")
    return tuple(AxisType[name] for name in names)


def sharding_json(sharding) -> dict:
    """A NamedSharding on a concrete mesh (the host's mesh of axes data and fsdp): the
    mesh's device ids and shape, axis names and types, the spec, the memory kind."""
    from jax.sharding import Mesh, NamedSharding

    if type(sharding) is not NamedSharding or type(sharding.mesh) is not Mesh:
        raise Refused(f"sharding {sharding}")
    mesh = sharding.mesh
    return {"devices": [int(d.id) for d in mesh.devices.flat], "shape": list(mesh.devices.shape),
            "axes": _strs(mesh.axis_names), "axis_types": [t.name for t in mesh.axis_types],
            "spec": _spec_json(sharding.spec), "memory_kind": sharding.memory_kind}


def sharding_from(obj, by_id: dict):
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    ids = ints_from(obj["devices"])
    if any(i not in by_id for i in ids):
        raise Refused(f"devices {ids} are not all among this host's {sorted(by_id)}")
    devices = np.empty(len(ids), dtype=object)
    devices[:] = [by_id[i] for i in ids]
    mesh = Mesh(devices.reshape(ints_from(obj["shape"])), tuple(_strs(obj["axes"])),
                axis_types=_axis_types(obj["axis_types"]))
    memory_kind = obj["memory_kind"]
    if memory_kind is not None and not isinstance(memory_kind, str):
        raise Refused(f"memory kind {memory_kind!r}")
    return NamedSharding(mesh, _spec(obj["spec"]), memory_kind=memory_kind)


def aval_json(aval) -> dict:
    """A ShapedArray: shape, dtype, weak type, memory space and its abstract sharding."""
    from jax._src import core
    from jax._src.mesh import AbstractMesh
    from jax.sharding import NamedSharding

    sharding = aval.sharding
    if (type(aval) is not core.ShapedArray or aval.manual_axis_type is not core.empty_mat
            or type(sharding) is not NamedSharding or type(sharding.mesh) is not AbstractMesh
            or sharding.memory_kind is not None):
        raise Refused(f"argument type {aval}")
    mesh = sharding.mesh
    device = mesh.abstract_device
    return {"shape": ints_from(aval.shape), "dtype": dtype_json(aval.dtype), "weak_type": bool(aval.weak_type),
            "memory_space": aval.memory_space.name,
            "mesh": {"sizes": ints_from(mesh.axis_sizes), "axes": _strs(mesh.axis_names),
                     "axis_types": [t.name for t in mesh.axis_types],
                     "device": None if device is None else {"kind": device.device_kind, "cores": device.num_cores,
                                                            "platform": device.platform}},
            "spec": _spec_json(sharding.spec)}


def aval_from(obj):
    from jax._src import core
    from jax._src.mesh import AbstractDevice, AbstractMesh
    from jax.sharding import NamedSharding

    mesh, device = obj["mesh"], obj["mesh"]["device"]
    if device is not None:
        if not (isinstance(device["kind"], str) and isinstance(device["platform"], str)
                and (device["cores"] is None or type(device["cores"]) is int)):
            raise Refused(f"abstract device {device!r}")
        device = AbstractDevice(device_kind=device["kind"], num_cores=device["cores"], platform=device["platform"])
    abstract = AbstractMesh(tuple(ints_from(mesh["sizes"])), tuple(_strs(mesh["axes"])),
                            _axis_types(mesh["axis_types"]), abstract_device=device)
    if obj["memory_space"] not in core.MemorySpace.__members__ or type(obj["weak_type"]) is not bool:
        raise Refused(f"argument type {obj!r}")
    return core.ShapedArray(tuple(ints_from(obj["shape"])), dtype_from(obj["dtype"]), obj["weak_type"],
                            sharding=NamedSharding(abstract, _spec(obj["spec"])),
                            memory_space=core.MemorySpace[obj["memory_space"]])


def _plain(value):
    """A custom tree node's static data as JSON: None, booleans, numbers, strings, and
    tuples of them (as lists)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    raise Refused(f"tree node data {value!r}")


def _unplain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return tuple(_unplain(v) for v in value)
    raise Refused(f"tree node data {value!r}")


def tree_json(treedef):
    """A PyTreeDef as JSON: "*" a leaf, null None, {"tuple"|"list": [children]},
    {"dict": [[key, child], ...]}, or {"node": "module:Class", "data": ..., "children": [...]}
    for a registered class (a flax dataclass: a scheduler's state)."""
    node = treedef.node_data()
    if node is None:
        return "*"
    kind, data = node
    children = [tree_json(child) for child in treedef.children()]
    if kind is type(None):
        return None
    if kind in (tuple, list) and data is None:
        return {kind.__name__: children}
    if kind is dict:
        if not all(isinstance(key, str) for key in data):
            raise Refused(f"dict keys {data!r}")
        return {"dict": [[key, child] for key, child in zip(data, children)]}
    name = f"{kind.__module__}:{kind.__qualname__}"
    if "<" in name:
        raise Refused(f"tree node {name}")
    _node_class(name)  # one that can be found again
    return {"node": name, "data": _plain(data), "children": children}


def _node_class(name: str) -> type:
    """The class a tree's custom node names: looked up among modules already imported, or
    imported from ``_NODE_MODULES`` only; it must be registered as a pytree node."""
    import importlib

    module_name, _, qualname = name.partition(":")
    if module_name.startswith(_NODE_MODULES) and re.fullmatch(r"[\w.]+", module_name):
        # imported (or waited for: another thread may be importing it right now, as a host's
        # weights load beside its compile; sys.modules would hand over a half-made module)
        module = importlib.import_module(module_name)
    else:
        module = sys.modules.get(module_name)
    if module is None or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", qualname):
        raise Refused(f"tree node {name}")
    found = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type):
        raise Refused(f"tree node {name}")
    return found


def tree_from(obj):
    import jax
    from jax.tree_util import PyTreeDef, default_registry

    if obj == "*":
        return jax.tree_util.tree_structure(0)
    if obj is None:
        return jax.tree_util.tree_structure(None)
    if not isinstance(obj, dict) or len(obj) not in (1, 3):
        raise Refused(f"tree {obj!r}")
    if "tuple" in obj or "list" in obj:
        kind = tuple if "tuple" in obj else list
        return PyTreeDef.from_node_data_and_children(default_registry, (kind, None),
                                                      [tree_from(child) for child in obj[kind.__name__]])
    if "dict" in obj:
        keys = [key for key, _ in obj["dict"]]
        if _strs(keys) != sorted(set(keys)):
            raise Refused(f"dict keys {keys!r}")
        return PyTreeDef.from_node_data_and_children(default_registry, (dict, keys),
                                                      [tree_from(child) for _, child in obj["dict"]])
    if not isinstance(obj.get("node"), str) or not isinstance(obj.get("children"), list):
        raise Refused(f"tree {obj!r}")
    return PyTreeDef.from_node_data_and_children(default_registry, (_node_class(obj["node"]), _unplain(obj["data"])),
                                                  [tree_from(child) for child in obj["children"]])


def debug_json(debug):
    if debug is None:
        return None
    names, paths = debug.arg_names, debug.result_paths
    if not all(isinstance(v, str) for v in (debug.traced_for, debug.func_src_info)) or \
            not all(v is None or isinstance(v, tuple) for v in (names, paths)):
        raise Refused("debug info")
    return {"traced_for": debug.traced_for, "function": debug.func_src_info,
            "arg_names": None if names is None else _strs(names),
            "result_paths": None if paths is None else _strs(paths)}


def debug_from(obj):
    from jax._src import core

    if obj is None:
        return None
    if not all(isinstance(obj[k], str) for k in ("traced_for", "function")):
        raise Refused("debug info")
    names, paths = obj["arg_names"], obj["result_paths"]
    return core.DebugInfo(obj["traced_for"], obj["function"], None if names is None else tuple(_strs(names)),
                          None if paths is None else tuple(_strs(paths)))
