"""JAX's persistent compilation cache: compile a run's programs once, reuse them after.

Every host process of every run compiles the same sampler for the same shapes; on a
TPU pod that is minutes per host and per restart. With the cache on, the first process
writes the compiled executables into a folder and every later process with the same
programs, shapes, devices and jax/XLA versions loads them instead of compiling
(https://docs.jax.dev/en/latest/persistent_compilation_cache.html).

The cache is an execution option, like the number of hosts: it never changes an
output byte, so it is not part of ``Settings`` or the run's fingerprint.

``enable`` must run before the programs it should cache are compiled. ``jax_events.CACHE``
counts hits and written entries (jax.monitoring events), so logs and tests can prove
that a process loaded its programs rather than compiling them. In a cluster only
process 0 writes entries (jax's rule, to spare shared filesystems from contention).

That rule, and the devices a pmapped program names (each host's own), leave every host
but host 0 compiling the sampler on every run, and a pod waits for its slowest host. So
the sampler, the one program that takes long to compile, has a cache of its own under
the same folder (``EXECUTABLES``): each host keeps its compiled executable under a key
made of the lowered program and the host's device assignment, and loads it back on the
next run (``load_or_compile``). An executable is the one XLA compiled for exactly that
program and those devices, so a loaded one computes the same bits as a fresh compilation.

Lowering the sampler to find that key takes seconds too (tracing a whole UNet in
Python), so a host also keeps an index from what the program is made of to its
executable (``INDEX``, ``index_key``): the caller's description of the program (the
model's configs, the sampler's settings), promptmill's own source code, the versions of
the libraries that trace it, and the host's devices. A warm host finds its executable
through the index without tracing anything (``load_indexed``). The executable keeps its
own key, so a program that lowers to the same text under another description is
compiled once.

What an entry holds (``ENTRY_MAGIC``): a first line naming the format, one line of JSON
(the format's version, the key the entry is for, jax's and jaxlib's versions, the
platform, the devices, the sha256 and length of the executable's bytes, and a JSON
description of the program: its arguments' and results' types and shardings, its
argument tree), then the bytes the backend's ``serialize_executable`` made, as JAX's own
cache keeps them. Nothing in the cache is unpickled: the ``jax.stages.Compiled`` is
rebuilt here, from this run's lowering (``load_or_compile``) or from the checked
description (``load_indexed``), and index entries are JSON too. An entry that does not
parse, or whose key, versions, devices, digest or description is not what was asked
for, or whose bytes the backend refuses, is logged at warning level
(``executable_cache_unreadable``), compiled again and replaced.

The digest sits in the same writable prefix as the bytes it covers: it catches a
truncated or corrupted entry, and authenticates nothing. A compiled executable is
machine code, so whoever can write the cache can change what the devices compute: keep
a gs:// cache in a bucket only the job's identity can write. Local cache folders are
made private (0700, entries 0600), and one that another user or group can write, or
that another user owns, is refused (``UnsafeCacheFolder``), as ssh refuses a
group-writable ``~/.ssh``. JAX's own persistent cache, in the same folder, keeps raw
serialized executables (no pickle either); the folder rules cover it.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import os
import re
import stat
import sys
import tempfile

from pipeline.generate import jax_events

EXECUTABLES = "executables"  # the per-host executables' folder, inside the cache folder
CHECKS = "checks"  # results of programs compiled for other machines (the TPU check), by index key
CHECKS_FOLDER = "PROMPTMILL_CHECKS_FOLDER"  # a compiling child's parent's ``checks_folder``
INDEX = "index"  # inside EXECUTABLES: what a program is made of -> its executable's key
ENTRY_MAGIC = b"promptmill-executable\n"  # an executable entry's first line, then its JSON header line
ENTRY_FORMAT = 1  # the version of the entries' (and index entries') layout
_KEY = re.compile(r"[0-9a-f]{64}")  # what an index entry may name: a key, never a path


class UnsafeCacheFolder(PermissionError):
    """A local cache folder that someone other than this user could write."""


def resolve(directory: str) -> str:
    """The folder jax should use for ``--compile-cache``, or ValueError.

    A local folder is made absolute, so every host process of a local run shares it
    whatever its working directory. A ``gs://`` folder is kept as it is: ``enable``
    mirrors it into a local folder (jax itself would need gcsfs or TensorFlow for it).
    """
    if not directory:
        raise ValueError("--compile-cache needs a folder")
    if "://" not in directory:
        return os.path.abspath(os.path.expanduser(directory))
    if not directory.startswith("gs://"):
        raise ValueError(f"--compile-cache must be a local folder or gs:// path, got {directory!r}")
    return directory.rstrip("/")


def local_default() -> str:
    """The cache folder of local ``promptmill run``s that name none: under the promptmill
    cache folder, so a second local run of the same job is warm."""
    from pipeline.model.loading.cache import cache_dir

    return os.path.join(cache_dir(), "compile-cache", "local")


_REMOTE: dict[str, str] = {}  # gs:// cache folder -> its local mirror, for ``push``


def _mirror(remote: str) -> str:
    import hashlib

    from pipeline.model.loading.cache import cache_dir

    return os.path.join(cache_dir(), "compile-cache", hashlib.sha256(remote.encode()).hexdigest()[:16])


def pull(remote: str) -> str:
    """Copy a gs:// cache folder's entries into its local mirror; returns the mirror (a
    private local folder, ``private_folder``)."""
    from pipeline.io import storage

    local = private_folder(_mirror(remote))
    for path in storage.glob(remote + "/*"):
        target = os.path.join(local, path.rsplit("/", 1)[-1])
        if not os.path.exists(target):
            storage.download(path, target)
            os.chmod(target, 0o600)
    _REMOTE[remote] = local
    return local


def push() -> int:
    """Upload the entries this process added to a gs:// cache folder; returns how many.

    Entries are uploaded whole under their final names; two hosts writing the same
    entry write a valid executable either way.
    """
    from pipeline.io import storage

    uploaded = 0
    for remote, local in _REMOTE.items():
        present = {path.rsplit("/", 1)[-1] for path in storage.glob(remote + "/*")}
        for name in sorted(os.listdir(local)):
            if name not in present and os.path.isfile(os.path.join(local, name)):
                with open(os.path.join(local, name), "rb") as f:
                    storage.write_bytes(f"{remote}/{name}", f.read())
                uploaded += 1
    return uploaded


def check_private(folder: str) -> str:
    """``folder`` if it is a folder that only this user can write; else UnsafeCacheFolder,
    naming it. Whoever can write a cache folder can change what the devices compute (an
    executable is machine code), so a folder its group or others can write, or another
    user owns, is refused, as ssh refuses a group-writable ``~/.ssh``."""
    info = os.stat(folder)
    problems = []
    if not stat.S_ISDIR(info.st_mode):
        problems.append("not a folder")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        problems.append(f"owned by another user (uid {info.st_uid}, this process runs as {os.getuid()})")
    if info.st_mode & 0o022:
        problems.append(f"writable by its group or by others (mode {stat.S_IMODE(info.st_mode):04o})")
    if problems:
        raise UnsafeCacheFolder(
            f"refusing the compile cache folder {folder}: it is {' and '.join(problems)}. Whoever can "
            f"write it can change what the devices compute; make it this user's own and private "
            f"(chmod 700 {folder}) or choose another folder")
    return folder


def private_folder(folder: str) -> str:
    """``folder``, made if missing (it and any missing folder above it: 0700), and checked
    (``check_private``); returns it."""
    missing = []
    path = os.path.abspath(folder)
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # another host process of this run made it meanwhile
            continue
        os.chmod(path, 0o700)  # as asked, whatever the umask
    return check_private(folder)


def _check_existing(folder: str) -> None:
    """``check_private`` of a local ``folder`` that exists (a gs:// one is the bucket's
    permissions' business)."""
    if "://" not in folder and os.path.isdir(folder):
        check_private(folder)


def enable(directory: str) -> str:
    """Turn on the persistent compilation cache in ``directory``; returns the folder used.

    The folder is checked by ``resolve``; a local one (or a gs:// folder's local mirror)
    is created private if needed, and refused (``UnsafeCacheFolder``), as are its
    executables', index's and checks' folders, if anyone but this user could write it.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = resolve(directory)
    if path.startswith("gs://"):
        path = pull(path)  # jax works on the local mirror; ``push`` uploads what it adds
    private_folder(path)
    for folder in (EXECUTABLES, os.path.join(EXECUTABLES, INDEX), CHECKS):
        _check_existing(os.path.join(path, folder))

    if jax.config.jax_compilation_cache_dir not in (None, path):
        # jax opens its cache once per process, at the first compile that uses it;
        # without a reset a second folder would be ignored silently.
        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_enable_compilation_cache", True)
    # By default jax caches only programs that took >= 1 s to compile. A host's
    # programs are few and all worth keeping, and the small ones (padding, key
    # folding) still cost a restart a little time each.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # 0 would let jax substitute its own per-filesystem minimum; -1 means "no minimum,
    # no override" (see the flag's help in jax/_src/config.py).
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax_events.CACHE.install()
    global _executables
    _executables = f"{resolve(directory)}/{EXECUTABLES}"
    return path


_executables: str | None = None  # where ``load_or_compile`` keeps executables: set by ``enable``
# executables (and index entries) this process loaded from / wrote to the per-host cache
EXECUTABLE_COUNTS = {"hits": 0, "writes": 0}


def _host_parts(devices) -> list[str]:
    """What decides the compiled code besides the program: the devices it runs on (ids,
    kinds, this process among how many), jax, jaxlib and backend versions, XLA flags."""
    import jax
    import jaxlib

    device = devices[0]
    return [repr([(d.id, d.process_index, d.platform, d.device_kind) for d in devices]),
            f"process {jax.process_index()} of {jax.process_count()}",
            f"jax {jax.__version__} jaxlib {jaxlib.__version__}",
            f"backend {device.client.platform} {device.client.platform_version}",
            f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}"]


def _digest(parts: list[str]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def executable_key(lowered, devices) -> str:
    """The per-host cache key of ``lowered`` compiled for ``devices``: the program's text
    and ``_host_parts``."""
    return _digest([lowered.as_text()] + _host_parts(devices))


def figures_key(lowered, devices, kind: str = "figures") -> str:
    """The key under which ``remember`` keeps what compiling ``lowered`` for ``devices``
    found (its memory and costs, not the executable): the program itself, so it holds
    across changes to the code that built it which leave the program as it was.
    ``kind``: what was kept ("figures" of a whole compile, "assigned" of one stopped at
    XLA's buffer assignment)."""
    return _digest([kind, executable_key(lowered, devices)])


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of promptmill's own Python sources (the ``pipeline`` package): the code that
    builds every program."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
            digest.update(b"\0")
    return digest.hexdigest()


def index_key(description: dict, devices) -> str:
    """The index key of a program (``INDEX``): the caller's ``description`` of it (JSON:
    e.g. the model's configs and the sampler's settings), promptmill's sources, jax's
    configuration, the libraries that trace it, and ``_host_parts``. Anything else that could change the
    lowered program is a change to one of these."""
    from importlib import metadata

    libraries = [f"{name} {metadata.version(name)}" for name in ("flax", "numpy")]
    return _digest([json.dumps(description, sort_keys=True), code_digest(), _jax_config()] + libraries
                   + _host_parts(devices))


def _jax_config() -> str:
    """jax's configuration (e.g. the default matmul precision, x64), which tracing reads;
    the caches' own settings left out (they decide where programs are kept, not what
    they are)."""
    import jax

    values = [f"{name}={value!r}" for name, value in sorted(jax.config.values.items()) if "cache" not in name]
    return "\n".join(value for value in values if " at 0x" not in value)


def _write(path: str, data: bytes) -> None:
    """A whole entry under its final name. A local one is written private (0600, in a
    ``private_folder``) and renamed into place, so a host reading it meanwhile never sees
    half of it; a GCS object is uploaded whole."""
    from pipeline.io import storage

    if storage.is_gcs(path):
        storage.write_bytes(path, data)
        return
    folder = private_folder(os.path.dirname(path))
    fd, scratch = tempfile.mkstemp(prefix=".entry-", dir=folder)
    try:
        os.fchmod(fd, 0o600)  # mkstemp's mode already; said here, as the cache's rule
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(scratch, path)
    finally:
        if os.path.exists(scratch):
            os.remove(scratch)


class _Refused(Exception):
    """An entry (or a program) this module will not load (or describe): the reason."""


# -- the JSON description of a program (``_describe``), and back (``_Program``)
#
# jax's only public way to rebuild a ``jax.stages.Compiled`` around an executable's bytes
# (``jax.experimental.serialize_executable``) unpickles what it reads. So the functions
# below read and build jax's own classes (``jax._src``: pxla's UnloadedMeshExecutable,
# stages.Compiled, ShapedArray, AbstractMesh), as jax 0.10 has them (setup.py keeps jax
# below 0.11, and jax's version is part of every key and header). A jax whose internals
# differ fails the round trip ``_checked_description`` makes before an entry is indexed,
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


def _dtype_json(dtype) -> str:
    import numpy as np

    name = np.dtype(dtype).name
    if _dtypes().get(name) != dtype:
        raise _Refused(f"dtype {dtype}")
    return name


def _dtype(name):
    if not isinstance(name, str) or name not in _dtypes():
        raise _Refused(f"dtype {name!r}")
    return _dtypes()[name]


def _ints(values) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(type(v) is int for v in values):
        raise _Refused(f"not a list of integers: {values!r}")
    return list(values)


def _strs(values) -> list[str]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise _Refused(f"not a list of strings: {values!r}")
    return list(values)


def _spec_json(spec) -> list:
    """A PartitionSpec: per dimension null, an axis name, or a list of them."""
    from jax.sharding import PartitionSpec

    if type(spec) is not PartitionSpec or spec.unreduced or spec.reduced:
        raise _Refused(f"partition spec {spec}")
    entries = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            entries.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(name, str) for name in entry):
            entries.append(list(entry))
        else:
            raise _Refused(f"partition spec {spec}")
    return entries


def _spec(entries):
    from jax.sharding import PartitionSpec

    if not isinstance(entries, list):
        raise _Refused(f"partition spec {entries!r}")
    return PartitionSpec(*[entry if entry is None or isinstance(entry, str) else tuple(_strs(entry))
                           for entry in entries])


def _axis_types(names) -> tuple:
    from jax.sharding import AxisType

    if not all(isinstance(name, str) and name in AxisType.__members__ for name in _strs(names)):
        raise _Refused(f"axis types {names!r}")
    return tuple(AxisType[name] for name in names)


def _sharding_json(sharding) -> dict:
    """A NamedSharding on a concrete mesh (pmap's internal one, or an FSDP mesh): the
    mesh's device ids and shape, axis names and types, the spec, the memory kind."""
    from jax.sharding import Mesh, NamedSharding

    if type(sharding) is not NamedSharding or type(sharding.mesh) is not Mesh:
        raise _Refused(f"sharding {sharding}")
    mesh = sharding.mesh
    return {"devices": [int(d.id) for d in mesh.devices.flat], "shape": list(mesh.devices.shape),
            "axes": _strs(mesh.axis_names), "axis_types": [t.name for t in mesh.axis_types],
            "spec": _spec_json(sharding.spec), "memory_kind": sharding.memory_kind}


def _sharding(obj, by_id: dict):
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    ids = _ints(obj["devices"])
    if any(i not in by_id for i in ids):
        raise _Refused(f"devices {ids} are not all among this host's {sorted(by_id)}")
    devices = np.empty(len(ids), dtype=object)
    devices[:] = [by_id[i] for i in ids]
    mesh = Mesh(devices.reshape(_ints(obj["shape"])), tuple(_strs(obj["axes"])),
                axis_types=_axis_types(obj["axis_types"]))
    memory_kind = obj["memory_kind"]
    if memory_kind is not None and not isinstance(memory_kind, str):
        raise _Refused(f"memory kind {memory_kind!r}")
    return NamedSharding(mesh, _spec(obj["spec"]), memory_kind=memory_kind)


def _aval_json(aval) -> dict:
    """A ShapedArray: shape, dtype, weak type, memory space and its abstract sharding."""
    from jax._src import core
    from jax._src.mesh import AbstractMesh
    from jax.sharding import NamedSharding

    sharding = aval.sharding
    if (type(aval) is not core.ShapedArray or aval.manual_axis_type is not core.empty_mat
            or type(sharding) is not NamedSharding or type(sharding.mesh) is not AbstractMesh
            or sharding.memory_kind is not None):
        raise _Refused(f"argument type {aval}")
    mesh = sharding.mesh
    device = mesh.abstract_device
    return {"shape": _ints(aval.shape), "dtype": _dtype_json(aval.dtype), "weak_type": bool(aval.weak_type),
            "memory_space": aval.memory_space.name,
            "mesh": {"sizes": _ints(mesh.axis_sizes), "axes": _strs(mesh.axis_names),
                     "axis_types": [t.name for t in mesh.axis_types],
                     "device": None if device is None else {"kind": device.device_kind, "cores": device.num_cores,
                                                            "platform": device.platform}},
            "spec": _spec_json(sharding.spec)}


def _aval(obj):
    from jax._src import core
    from jax._src.mesh import AbstractDevice, AbstractMesh
    from jax.sharding import NamedSharding

    mesh, device = obj["mesh"], obj["mesh"]["device"]
    if device is not None:
        if not (isinstance(device["kind"], str) and isinstance(device["platform"], str)
                and (device["cores"] is None or type(device["cores"]) is int)):
            raise _Refused(f"abstract device {device!r}")
        device = AbstractDevice(device_kind=device["kind"], num_cores=device["cores"], platform=device["platform"])
    abstract = AbstractMesh(tuple(_ints(mesh["sizes"])), tuple(_strs(mesh["axes"])),
                            _axis_types(mesh["axis_types"]), abstract_device=device)
    if obj["memory_space"] not in core.MemorySpace.__members__ or type(obj["weak_type"]) is not bool:
        raise _Refused(f"argument type {obj!r}")
    return core.ShapedArray(tuple(_ints(obj["shape"])), _dtype(obj["dtype"]), obj["weak_type"],
                            sharding=NamedSharding(abstract, _spec(obj["spec"])),
                            memory_space=core.MemorySpace[obj["memory_space"]])


def _plain(value):
    """A custom tree node's static data as JSON: None, booleans, numbers, strings, and
    tuples of them (as lists)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    raise _Refused(f"tree node data {value!r}")


def _unplain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return tuple(_unplain(v) for v in value)
    raise _Refused(f"tree node data {value!r}")


def _tree_json(treedef):
    """A PyTreeDef as JSON: "*" a leaf, null None, {"tuple"|"list": [children]},
    {"dict": [[key, child], ...]}, or {"node": "module:Class", "data": ..., "children": [...]}
    for a registered class (a flax dataclass: a scheduler's state)."""
    node = treedef.node_data()
    if node is None:
        return "*"
    kind, data = node
    children = [_tree_json(child) for child in treedef.children()]
    if kind is type(None):
        return None
    if kind in (tuple, list) and data is None:
        return {kind.__name__: children}
    if kind is dict:
        if not all(isinstance(key, str) for key in data):
            raise _Refused(f"dict keys {data!r}")
        return {"dict": [[key, child] for key, child in zip(data, children)]}
    name = f"{kind.__module__}:{kind.__qualname__}"
    if "<" in name:
        raise _Refused(f"tree node {name}")
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
        raise _Refused(f"tree node {name}")
    found = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type):
        raise _Refused(f"tree node {name}")
    return found


def _tree(obj):
    import jax
    from jax.tree_util import PyTreeDef, default_registry

    if obj == "*":
        return jax.tree_util.tree_structure(0)
    if obj is None:
        return jax.tree_util.tree_structure(None)
    if not isinstance(obj, dict) or len(obj) not in (1, 3):
        raise _Refused(f"tree {obj!r}")
    if "tuple" in obj or "list" in obj:
        kind = tuple if "tuple" in obj else list
        return PyTreeDef.from_node_data_and_children(default_registry, (kind, None),
                                                      [_tree(child) for child in obj[kind.__name__]])
    if "dict" in obj:
        keys = [key for key, _ in obj["dict"]]
        if _strs(keys) != sorted(set(keys)):
            raise _Refused(f"dict keys {keys!r}")
        return PyTreeDef.from_node_data_and_children(default_registry, (dict, keys),
                                                      [_tree(child) for _, child in obj["dict"]])
    if not isinstance(obj.get("node"), str) or not isinstance(obj.get("children"), list):
        raise _Refused(f"tree {obj!r}")
    return PyTreeDef.from_node_data_and_children(default_registry, (_node_class(obj["node"]), _unplain(obj["data"])),
                                                  [_tree(child) for child in obj["children"]])


def _debug_json(debug):
    if debug is None:
        return None
    names, paths = debug.arg_names, debug.result_paths
    if not all(isinstance(v, str) for v in (debug.traced_for, debug.func_src_info)) or \
            not all(v is None or isinstance(v, tuple) for v in (names, paths)):
        raise _Refused("debug info")
    return {"traced_for": debug.traced_for, "function": debug.func_src_info,
            "arg_names": None if names is None else _strs(names),
            "result_paths": None if paths is None else _strs(paths)}


def _debug(obj):
    from jax._src import core

    if obj is None:
        return None
    if not all(isinstance(obj[k], str) for k in ("traced_for", "function")):
        raise _Refused("debug info")
    names, paths = obj["arg_names"], obj["result_paths"]
    return core.DebugInfo(obj["traced_for"], obj["function"], None if names is None else tuple(_strs(names)),
                          None if paths is None else tuple(_strs(paths)))


def _describe(compiled) -> dict:
    """The JSON description from which ``_Program`` rebuilds ``compiled`` around its
    executable's bytes, without its lowering; _Refused for a program it cannot describe
    in full (effects, host callbacks, constants, custom layouts, other shardings, trees
    of unknown classes), which the index then leaves out."""
    import jax
    from jax._src import stages
    from jax._src.interpreters import pxla

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if type(unloaded) is not pxla.UnloadedMeshExecutable:
        raise _Refused(f"executable {type(unloaded).__name__}")
    u, params = unloaded, compiled._params
    if (u.ordered_effects or u.unordered_effects or u.host_callbacks or u.keepalive or u.mut is not None
            or u.pgle_profiler is not None or params.const_args or params.is_high):
        raise _Refused("effects, callbacks, constants or high-level types")
    # layouts: the executable's defaults, recomputed from its bytes as pxla does
    in_layouts, out_layouts = pxla._get_layouts_from_executable(
        u.xla_executable, (None,) * len(u.input_avals), (None,) * len(u.output_avals), 0, u.input_avals,
        u.output_avals)
    if list(in_layouts) != list(u.xla_in_layouts) or list(out_layouts) != list(u.xla_out_layouts) or \
            any(layout is not None for layout in u.dispatch_in_layouts):
        raise _Refused("custom layouts")
    args, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    if not all(type(arg) is stages.ArgInfo for arg in args):
        raise _Refused("argument info")
    # jit keeps the argument and result types it traced (pmap does not): they are these
    typed = params.in_types is not None
    if (params.out_types is not None) != typed or typed and (
            params.in_types != (in_tree, [arg._aval for arg in args])
            or params.out_types != (compiled.out_tree, list(u.output_avals))):
        raise _Refused("argument or result types of their own")
    all_args = u.all_args_info
    return {"name": u.name, "devices": [int(d.id) for d in u.device_list], "committed": bool(u.committed),
            "kept_var_idx": sorted(int(i) for i in u.kept_var_idx),
            "in_avals": [_aval_json(a) for a in u.input_avals], "out_avals": [_aval_json(a) for a in u.output_avals],
            "in_shardings": [_sharding_json(s) for s in u.input_shardings],
            "out_shardings": [_sharding_json(s) for s in u.output_shardings],
            "args": [{"aval": _aval_json(arg._aval), "donated": bool(arg.donated)} for arg in args],
            "in_tree": _tree_json(in_tree), "out_tree": _tree_json(compiled.out_tree),
            "no_kwargs": bool(compiled._no_kwargs), "typed": typed,
            "all_args": None if all_args is None else {"in_avals": [_aval_json(a) for a in all_args.in_avals],
                                                       "debug": _debug_json(all_args.debug_info)}}


class _Program:
    """A description (``_describe``) read back: the program's parts, on ``by_id``'s devices."""

    def __init__(self, obj: dict, by_id: dict):
        from jax._src import stages
        from jax._src.interpreters import pxla

        if not isinstance(obj, dict):
            raise _Refused("no description of the program")
        ids = _ints(obj["devices"])
        if not ids or any(i not in by_id for i in ids):
            raise _Refused(f"devices {ids} are not all among this host's {sorted(by_id)}")
        if not isinstance(obj["name"], str) or \
                not all(type(obj[k]) is bool for k in ("committed", "no_kwargs", "typed")):
            raise _Refused("name or flags")
        self.name, self.committed, self.no_kwargs = obj["name"], obj["committed"], obj["no_kwargs"]
        self.typed = obj["typed"]
        self.devices = [by_id[i] for i in ids]
        self.kept_var_idx = set(_ints(obj["kept_var_idx"]))
        self.in_avals = [_aval(a) for a in obj["in_avals"]]
        self.out_avals = [_aval(a) for a in obj["out_avals"]]
        self.in_shardings = [_sharding(s, by_id) for s in obj["in_shardings"]]
        self.out_shardings = [_sharding(s, by_id) for s in obj["out_shardings"]]
        if len(self.in_shardings) != len(self.in_avals) or len(self.out_shardings) != len(self.out_avals):
            raise _Refused("as many shardings as types")
        for arg in obj["args"]:
            if type(arg["donated"]) is not bool:
                raise _Refused("argument info")
        self.args = [stages.ArgInfo(_aval(arg["aval"]), arg["donated"]) for arg in obj["args"]]
        self.in_tree, self.out_tree = _tree(obj["in_tree"]), _tree(obj["out_tree"])
        if self.in_tree.num_leaves != len(self.args) or self.out_tree.num_leaves != len(self.out_avals) or \
                not self.kept_var_idx <= set(range(len(self.args))) or len(self.kept_var_idx) != len(self.in_avals):
            raise _Refused("trees, arguments and types disagree")
        everything = obj["all_args"]
        self.all_args = None if everything is None else pxla.AllArgsInfo(
            [_aval(a) for a in everything["in_avals"]], _debug(everything["debug"]))

    def compiled(self, xla_executable):
        """The ``jax.stages.Compiled`` of ``xla_executable`` (loaded onto ``devices``)."""
        from jax._src import stages

        executable = _mesh_executable(
            xla_executable, self.name, self.devices, self.in_avals, self.out_avals, self.in_shardings,
            self.out_shardings, (None,) * len(self.in_avals), (None,) * len(self.out_avals), self.committed,
            self.kept_var_idx, [], self.all_args)
        in_types, out_types = self.types()
        return stages.Compiled(executable, [], self.in_tree.unflatten(self.args), self.out_tree,
                               no_kwargs=self.no_kwargs, in_types=in_types, out_types=out_types)

    def types(self) -> tuple:
        """(in_types, out_types) as jit keeps them (``_describe``), or (None, None)."""
        if not self.typed:
            return None, None
        return (self.in_tree, [arg._aval for arg in self.args]), (self.out_tree, list(self.out_avals))


def _mesh_executable(xla_executable, name, devices, in_avals, out_avals, in_shardings, out_shardings, in_layouts,
                     out_layouts, committed, kept_var_idx, keepalive, all_args_info, intermediate_shardings=None,
                     context_mesh=None):
    """pxla's ``UnloadedMeshExecutable.from_hlo`` (jax 0.10) from its compilation on:
    the executable's shardings checked against the program's, its layouts read, the
    result loaded. For programs without effects, host callbacks or mutable arrays."""
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client as xc

    device_list = devices if isinstance(devices, xc.DeviceList) else xc.DeviceList(tuple(devices))
    in_shardings = tuple(pxla.maybe_concretize_mesh(s, device_list) for s in in_shardings)
    out_shardings = tuple(pxla.maybe_concretize_mesh(s, device_list) for s in out_shardings)
    in_shardings = pxla._maybe_get_and_check_in_shardings(xla_executable, in_shardings, device_list, in_avals, 0)
    out_shardings = pxla._maybe_get_and_check_out_shardings(xla_executable, out_shardings, device_list, out_avals, 0)
    xla_in_layouts, xla_out_layouts = pxla._get_layouts_from_executable(xla_executable, in_layouts, out_layouts, 0,
                                                                        in_avals, out_avals)
    dispatch_in_layouts = pxla.get_dispatch_layouts(xla_in_layouts, in_shardings, in_avals)
    out_shardings = pxla.maybe_recover_user_shardings(in_shardings, out_shardings, in_avals, out_avals,
                                                      intermediate_shardings, context_mesh)
    return pxla.UnloadedMeshExecutable(
        xla_executable=xla_executable, device_list=device_list, backend=xla_executable.client,
        input_avals=in_avals, input_shardings=pxla.finalize_shardings(in_shardings, device_list),
        output_avals=out_avals, output_shardings=pxla.finalize_shardings(out_shardings, device_list),
        committed=committed, name=name, unordered_effects=[], ordered_effects=[], keepalive=keepalive,
        host_callbacks=[], kept_var_idx=kept_var_idx, mut=None, xla_in_layouts=xla_in_layouts,
        dispatch_in_layouts=dispatch_in_layouts, xla_out_layouts=xla_out_layouts, all_args_info=all_args_info,
        pgle_profiler=None).load()


def _lowering(lowered):
    """``lowered``'s MeshComputation, if its compiled program can be rebuilt around a
    loaded executable here (``_from_lowering``); else _Refused."""
    from jax._src.interpreters import pxla

    lowering = getattr(lowered, "_lowering", None)
    if type(lowering) is not pxla.MeshComputation or lowering._device_list is None:
        raise _Refused(f"lowering {type(lowering).__name__}")
    args = lowering.compile_args
    poly = args.get("shape_poly_state")
    types = [*(lowered._in_types or ((), []))[1], *(lowered._out_types or ((), []))[1]]
    if (args.get("ordered_effects") or args.get("unordered_effects") or args.get("host_callbacks")
            or args.get("mut") is not None or args.get("pgle_profiler") is not None or lowering.const_args
            or (poly is not None and poly.uses_dim_vars) or any(a.is_high for a in types)):
        raise _Refused("effects, callbacks, constants, shape polymorphism or high-level types")
    return lowering


def _from_lowering(lowered, xla_executable):
    """The ``jax.stages.Compiled`` that ``lowered.compile()`` makes, with
    ``xla_executable`` in place of XLA's compilation (``MeshComputation.compile``)."""
    from jax._src import stages

    lowering = _lowering(lowered)
    args = lowering.compile_args
    executable = _mesh_executable(
        xla_executable, lowering._name, lowering._device_list, args["global_in_avals"], args["global_out_avals"],
        args["in_shardings"], args["out_shardings"], args["in_layouts"], args["out_layouts"], args["committed"],
        args["kept_var_idx"], args["keepalive"], args["all_args_info"], args.get("intermediate_shardings"),
        args.get("context_mesh"))
    return stages.Compiled(executable, lowering.const_args, lowered.args_info, lowered.out_tree, lowered._no_kwargs,
                           lowered._in_types, lowered._out_types)


def _checked_description(compiled, devices) -> dict | None:
    """``_describe(compiled)``, if ``_Program`` reads it back to the same parts on
    ``devices`` (as JSON, through a round trip); None if it cannot describe it."""
    import jax

    try:
        description = json.loads(json.dumps(_describe(compiled)))
        program = _Program(description, {d.id: d for d in devices})
    except Exception:  # noqa: BLE001 - _Refused, or a program of a shape this module does not know
        return None
    u = compiled._executable._unloaded_executable
    args, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    same = (program.in_avals == list(u.input_avals) and program.out_avals == list(u.output_avals)
            and program.in_shardings == list(u.input_shardings) and program.out_shardings == list(u.output_shardings)
            and program.in_tree == in_tree and program.out_tree == compiled.out_tree
            and [(a._aval, a.donated) for a in program.args] == [(a._aval, a.donated) for a in args]
            and program.devices == list(u.device_list) and program.all_args == u.all_args_info
            and program.types() == (compiled._params.in_types, compiled._params.out_types))
    return description if same else None


# -- entries: a first line, a JSON header line, the executable's bytes

def _json_digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _header(key: str, devices, data: bytes, program: dict | None) -> dict:
    import jax
    import jaxlib

    client = devices[0].client
    return {"format": ENTRY_FORMAT, "key": key, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "platform": client.platform, "platform_version": client.platform_version,
            "devices": [int(d.id) for d in devices], "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "program": program, "program_sha256": _json_digest(program)}


def _entry(key: str, devices, compiled) -> tuple[bytes, dict | None]:
    """(the entry of ``compiled``, its program's description or None)."""
    xla_executable = compiled._executable.xla_executable
    data = xla_executable.client.serialize_executable(xla_executable)
    program = _checked_description(compiled, devices)
    header = json.dumps(_header(key, devices, data, program), sort_keys=True, separators=(",", ":"))
    return ENTRY_MAGIC + header.encode() + b"\n" + data, program


def _parse(blob: bytes, key: str, devices) -> tuple[dict, bytes]:
    """(header, executable bytes) of an entry, checked against what was asked for: the
    key, this jax and jaxlib, this platform, these devices, the bytes' length and digest
    and the description's digest (which catch corruption; they authenticate nothing).
    _Refused otherwise."""
    if not blob.startswith(ENTRY_MAGIC):
        raise _Refused("not an executable entry of this format")
    end = blob.find(b"\n", len(ENTRY_MAGIC))
    if end < 0:
        raise _Refused("no header")
    try:
        header = json.loads(blob[len(ENTRY_MAGIC):end])
    except ValueError as e:
        raise _Refused(f"header: {e}") from None
    data = blob[end + 1:]
    if not isinstance(header, dict):
        raise _Refused("header")
    expected = _header(key, devices, b"", None)
    for field in ("format", "key", "jax", "jaxlib", "platform", "platform_version", "devices"):
        if header.get(field) != expected[field]:
            raise _Refused(f"{field} {header.get(field)!r}, not {expected[field]!r}")
    if header.get("size") != len(data) or header.get("sha256") != hashlib.sha256(data).hexdigest():
        raise _Refused("the executable's bytes do not match their length and digest")
    if header.get("program_sha256") != _json_digest(header.get("program")):
        raise _Refused("the program's description does not match its digest")
    return header, data


def _unreadable(path: str, error: Exception) -> None:
    """Log, at warning level, an entry that will not be loaded (and will be replaced)."""
    from pipeline.core import logs

    reason = str(error) if isinstance(error, _Refused) else f"{type(error).__name__}: {error}"
    logs.event("executable_cache_unreadable", logging.WARNING, path=path, error=reason,
               action="compiled again and replaced")


def _load(path: str, key: str, devices, lowered=None):
    """(the executable entry at ``path`` for ``key``, loaded onto ``devices`` as a
    ``jax.stages.Compiled``, and its description): rebuilt from ``lowered`` when given
    (the entry's description must be the one the rebuilt program has), else from the
    entry's description. None (logged at warning level) if it does not match what was
    asked for or cannot load."""
    from pipeline.io import storage

    devices = list(devices)
    try:
        header, data = _parse(storage.read_bytes(path), key, devices)
        if lowered is not None:
            xla_executable = devices[0].client.deserialize_executable(data, _lowering(lowered)._device_list, None)
            compiled = _from_lowering(lowered, xla_executable)
            if _checked_description(compiled, devices) != header["program"]:
                raise _Refused("its description is not this program's")
            return compiled, header["program"]
        program = _Program(header["program"], {d.id: d for d in devices})
        from jax._src.lib import xla_client as xc

        xla_executable = devices[0].client.deserialize_executable(data, xc.DeviceList(tuple(program.devices)), None)
        compiled = program.compiled(xla_executable)
        if _checked_description(compiled, devices) != header["program"]:
            raise _Refused("the program it rebuilds is not the one it describes")
        return compiled, header["program"]
    except Exception as e:  # noqa: BLE001 - any unreadable entry is replaced, never trusted
        _unreadable(path, e)
        return None


# -- the index's ``extra``: a tree of ShapeDtypeStructs as JSON

def _extra_json(extra, devices) -> dict | None:
    """``extra`` (the params' ``jax.ShapeDtypeStruct``s a caller keeps with its program)
    as JSON, if it reads back equal (``_extra``); else None."""
    import jax

    try:
        leaves, tree = jax.tree_util.tree_flatten(extra)
        described = []
        for leaf in leaves:
            if type(leaf) is not jax.ShapeDtypeStruct or leaf.weak_type or leaf.format.layout is not None:
                raise _Refused(f"index extra leaf {leaf!r}")
            described.append({"shape": _ints(leaf.shape), "dtype": _dtype_json(leaf.dtype),
                              "sharding": None if leaf.sharding is None else _sharding_json(leaf.sharding)})
        obj = json.loads(json.dumps({"tree": _tree_json(tree), "leaves": described}))
        back = _extra(obj, devices)
    except Exception:  # noqa: BLE001 - _Refused, or leaves of a kind this module does not know
        return None
    same = jax.tree_util.tree_structure(back) == tree and jax.tree_util.tree_leaves(back) == leaves
    return obj if same else None


def _extra(obj, devices):
    import jax

    by_id = {d.id: d for d in devices}
    leaves = [jax.ShapeDtypeStruct(tuple(_ints(leaf["shape"])), _dtype(leaf["dtype"]),
                                   sharding=None if leaf["sharding"] is None else _sharding(leaf["sharding"], by_id))
              for leaf in obj["leaves"]]
    tree = _tree(obj["tree"])
    if tree.num_leaves != len(leaves):
        raise _Refused("index extra: tree and leaves disagree")
    return tree.unflatten(leaves)


_RECENT: "collections.OrderedDict[str, object]" = collections.OrderedDict()  # executable_key -> executable
RECENT_PROGRAMS = 8  # the compiled programs a process keeps, most recent first


def _compiled_once(lowered, devices):
    """``lowered.compile()``, or the executable this process compiled last for the same
    program and devices (``executable_key``): a process that builds several generators of
    one program (a benchmark's parts, a bench's recipes) compiles it once. The executable
    is immutable; it is the one XLA compiled for that very program text."""
    key = executable_key(lowered, devices)
    if key in _RECENT:
        _RECENT.move_to_end(key)
        return _RECENT[key]
    compiled = lowered.compile()
    _RECENT[key] = compiled
    while len(_RECENT) > RECENT_PROGRAMS:
        _RECENT.popitem(last=False)
    return compiled


def load_or_compile(lowered, devices, folder: str | None = None, index: tuple[str, object] | None = None):
    """``lowered.compile()``, or the executable an earlier run of this host compiled for
    the same key (``executable_key``) in ``folder`` (local or gs://; default: the one
    ``enable`` chose, none before it), rebuilt around this run's lowering.

    Returns (the compiled program, whether it was loaded from the cache). A program XLA
    compiled here is written to the cache; one that jax's persistent cache gave is used and
    not written (XLA:CPU serializes a deserialized executable without its code). An entry
    that cannot be loaded (another jaxlib's, truncated, not this program's) is logged at
    warning level, compiled again and replaced. ``index``: (its ``index_key``, what
    ``load_indexed`` should return with it: a tree of ``jax.ShapeDtypeStruct``s), recorded
    in the index when both the program and that tree can be described in JSON.
    """
    from pipeline.core import logs
    from pipeline.io import storage

    folder = folder or _executables
    if folder is None:
        return _compiled_once(lowered, devices), False
    folder = folder.rstrip("/")
    _check_existing(folder)
    devices = list(devices)
    key = executable_key(lowered, devices)
    path = f"{folder}/{key}"
    try:
        _lowering(lowered)
        cacheable = True
    except Exception as e:  # noqa: BLE001 - _Refused, or a lowering of a kind this module does not know
        logs.event("executable_not_cached", reason=f"{type(e).__name__}: {e}")
        cacheable = False
    found = _load(path, key, devices, lowered) if cacheable and storage.exists(path) else None
    hit = found is not None
    program = None
    if hit:
        EXECUTABLE_COUNTS["hits"] += 1
        compiled, program = found
    else:
        compiled, served = _compiled_here(lowered)
        if served and cacheable:
            # An executable jax's persistent cache deserialized is not written again: XLA:CPU
            # serializes one without its compiled functions, and the entry would load and then
            # fail at its first run ("Function ... not found"). Only a fresh compile is kept.
            logs.event("executable_not_cached", reason="jax's persistent cache gave this executable; "
                       "only one this process compiled is written")
            cacheable = False
        try:
            data, program = _entry(key, devices, compiled) if cacheable else (None, None)
        except Exception as e:  # noqa: BLE001 - a backend that cannot serialise it: compiled each run
            logs.event("executable_not_cached", reason=f"{type(e).__name__}: {e}")
            data = None
        if data is not None:
            _write(path, data)
            EXECUTABLE_COUNTS["writes"] += 1
    if index is not None and program is not None:
        extra = _extra_json(index[1], devices)
        if extra is None:
            logs.event("executable_not_indexed", reason="its index entry's shapes cannot be described in JSON")
        else:
            entry = {"format": ENTRY_FORMAT, "index": index[0], "executable": key, "extra": extra}
            _write(f"{folder}/{INDEX}/{index[0]}", json.dumps(entry, sort_keys=True).encode())
            EXECUTABLE_COUNTS["writes"] += 1
    elif index is not None and cacheable:
        logs.event("executable_not_indexed", reason="the program cannot be described in JSON")
    return compiled, hit


def _compiled_here(lowered):
    """(``lowered.compile()``, whether jax's persistent cache gave the executable rather
    than XLA compiling it): jax counts a hit on the thread that compiles."""
    jax_events.CACHE.install()
    before = jax_events.CACHE.count_here(jax_events.CACHE_HIT)
    compiled = lowered.compile()
    return compiled, jax_events.CACHE.count_here(jax_events.CACHE_HIT) > before


def load_indexed(key: str, devices, folder: str | None = None):
    """(the executable the index names for ``key`` (``index_key``), loaded onto ``devices``
    without lowering anything, and the ``extra`` recorded with it), or None: no cache, no
    entry, or an unreadable one (logged at warning level; then the caller lowers and
    compiles, and ``load_or_compile`` replaces it)."""
    from pipeline.io import storage

    folder = folder or _executables
    if folder is None:
        return None
    folder = folder.rstrip("/")
    _check_existing(folder)
    _check_existing(f"{folder}/{INDEX}")
    devices = list(devices)
    path = f"{folder}/{INDEX}/{key}"
    if not storage.exists(path):
        return None
    try:
        entry = json.loads(storage.read_bytes(path))
        if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT or entry.get("index") != key:
            raise _Refused("not an index entry of this format for this key")
        if not isinstance(entry.get("executable"), str) or not _KEY.fullmatch(entry["executable"]):
            raise _Refused("it names no executable key")
        extra = _extra(entry["extra"], devices)
    except Exception as e:  # noqa: BLE001 - an unreadable index entry is rewritten after the compile
        _unreadable(path, e)
        return None
    executable = f"{folder}/{entry['executable']}"
    found = _load(executable, entry["executable"], devices) if storage.exists(executable) else None
    if found is None:
        return None
    EXECUTABLE_COUNTS["hits"] += 1
    return found[0], extra


def entries(directory: str) -> int:
    """Number of cached executables in a local cache folder (jax names them ``*-cache``)."""
    if not os.path.isdir(directory):
        return 0
    return sum(1 for name in os.listdir(directory) if name.endswith("-cache"))


def checks_folder(folder: str | None = None) -> str:
    """Where ``remember`` keeps results: under ``folder``, else the one a compiling
    child's parent named (``CHECKS_FOLDER``: both keep their results in one place), else
    under this machine's ``local_default``."""
    if folder is None and os.environ.get(CHECKS_FOLDER):
        return os.environ[CHECKS_FOLDER]
    return os.path.join(folder or local_default(), CHECKS)


def remember(key: str, value: dict, folder: str | None = None) -> None:
    """Keep ``value`` (JSON), what compiling the program of ``key`` (``index_key``) for
    another machine found, under ``folder`` (default: this machine's ``local_default``)."""
    _write(os.path.join(checks_folder(folder), f"{key}.json"), json.dumps(value, sort_keys=True).encode())


def recall(key: str, folder: str | None = None) -> dict | None:
    """What ``remember`` kept for ``key``, or None (none, or unreadable); a checks folder
    others can write is refused (``UnsafeCacheFolder``)."""
    _check_existing(checks_folder(folder))
    try:
        with open(os.path.join(checks_folder(folder), f"{key}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
