"""The per-host executables: entries (a first line, a JSON header line, the executable's
bytes), loaded or compiled and written (``load_or_compile``), and found through the index
without tracing (``load_indexed``)."""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import re

from pipeline.core import logs
from pipeline.generate import jax_events
from pipeline.generate.compile_cache import jax_cache
from pipeline.generate.compile_cache.codec import (Refused, dtype_from, dtype_json, ints_from, sharding_from,
                                                   sharding_json, tree_from, tree_json)
from pipeline.generate.compile_cache.folders import INDEX, check_existing, write_whole
from pipeline.generate.compile_cache.keys import executable_key
from pipeline.generate.compile_cache.program import Program, checked_description, from_lowering, lowering_of

ENTRY_MAGIC = b"promptmill-executable\n"  # an executable entry's first line, then its JSON header line
ENTRY_FORMAT = 1  # the version of the entries' (and index entries') layout
_KEY = re.compile(r"[0-9a-f]{64}")  # what an index entry may name: a key, never a path
# executables (and index entries) this process loaded from / wrote to the per-host cache
EXECUTABLE_COUNTS = {"hits": 0, "writes": 0}


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
    program = checked_description(compiled, devices)
    header = json.dumps(_header(key, devices, data, program), sort_keys=True, separators=(",", ":"))
    return ENTRY_MAGIC + header.encode() + b"\n" + data, program


def _parse(blob: bytes, key: str, devices) -> tuple[dict, bytes]:
    """(header, executable bytes) of an entry, checked against what was asked for: the
    key, this jax and jaxlib, this platform, these devices, the bytes' length and digest
    and the description's digest (which catch corruption; they authenticate nothing).
    Refused otherwise."""
    if not blob.startswith(ENTRY_MAGIC):
        raise Refused("not an executable entry of this format")
    end = blob.find(b"\n", len(ENTRY_MAGIC))
    if end < 0:
        raise Refused("no header")
    try:
        header = json.loads(blob[len(ENTRY_MAGIC):end])
    except ValueError as e:
        raise Refused(f"header: {e}") from None
    data = blob[end + 1:]
    if not isinstance(header, dict):
        raise Refused("header")
    expected = _header(key, devices, b"", None)
    for field in ("format", "key", "jax", "jaxlib", "platform", "platform_version", "devices"):
        if header.get(field) != expected[field]:
            raise Refused(f"{field} {header.get(field)!r}, not {expected[field]!r}")
    if header.get("size") != len(data) or header.get("sha256") != hashlib.sha256(data).hexdigest():
        raise Refused("the executable's bytes do not match their length and digest")
    if header.get("program_sha256") != _json_digest(header.get("program")):
        raise Refused("the program's description does not match its digest")
    return header, data


def _unreadable(path: str, error: Exception) -> None:
    """Log, at warning level, an entry that will not be loaded (and will be replaced)."""

    reason = str(error) if isinstance(error, Refused) else f"{type(error).__name__}: {error}"
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
            xla_executable = devices[0].client.deserialize_executable(data, lowering_of(lowered)._device_list, None)
            compiled = from_lowering(lowered, xla_executable)
            if checked_description(compiled, devices) != header["program"]:
                raise Refused("its description is not this program's")
            return compiled, header["program"]
        program = Program(header["program"], {d.id: d for d in devices})
        from jax._src.lib import xla_client as xc

        xla_executable = devices[0].client.deserialize_executable(data, xc.DeviceList(tuple(program.devices)), None)
        compiled = program.compiled(xla_executable)
        if checked_description(compiled, devices) != header["program"]:
            raise Refused("the program it rebuilds is not the one it describes")
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
                raise Refused(f"index extra leaf {leaf!r}")
            described.append({"shape": ints_from(leaf.shape), "dtype": dtype_json(leaf.dtype),
                              "sharding": None if leaf.sharding is None else sharding_json(leaf.sharding)})
        obj = json.loads(json.dumps({"tree": tree_json(tree), "leaves": described}))
        back = _extra(obj, devices)
    except Exception:  # noqa: BLE001 - Refused, or leaves of a kind this module does not know
        return None
    same = jax.tree_util.tree_structure(back) == tree and jax.tree_util.tree_leaves(back) == leaves
    return obj if same else None


def _extra(obj, devices):
    import jax

    by_id = {d.id: d for d in devices}
    leaves = [jax.ShapeDtypeStruct(tuple(ints_from(leaf["shape"])), dtype_from(leaf["dtype"]),
                                   sharding=None if leaf["sharding"] is None else sharding_from(leaf["sharding"], by_id))
              for leaf in obj["leaves"]]
    tree = tree_from(obj["tree"])
    if tree.num_leaves != len(leaves):
        raise Refused("index extra: tree and leaves disagree")
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
    from pipeline.io import storage

    folder = folder or jax_cache.executables_folder()
    if folder is None:
        return _compiled_once(lowered, devices), False
    folder = folder.rstrip("/")
    check_existing(folder)
    devices = list(devices)
    key = executable_key(lowered, devices)
    path = f"{folder}/{key}"
    try:
        lowering_of(lowered)
        cacheable = True
    except Exception as e:  # noqa: BLE001 - Refused, or a lowering of a kind this module does not know
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
            write_whole(path, data)
            EXECUTABLE_COUNTS["writes"] += 1
    if index is not None and program is not None:
        extra = _extra_json(index[1], devices)
        if extra is None:
            logs.event("executable_not_indexed", reason="its index entry's shapes cannot be described in JSON")
        else:
            entry = {"format": ENTRY_FORMAT, "index": index[0], "executable": key, "extra": extra}
            write_whole(f"{folder}/{INDEX}/{index[0]}", json.dumps(entry, sort_keys=True).encode())
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

    folder = folder or jax_cache.executables_folder()
    if folder is None:
        return None
    folder = folder.rstrip("/")
    check_existing(folder)
    check_existing(f"{folder}/{INDEX}")
    devices = list(devices)
    path = f"{folder}/{INDEX}/{key}"
    if not storage.exists(path):
        return None
    try:
        entry = json.loads(storage.read_bytes(path))
        if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT or entry.get("index") != key:
            raise Refused("not an index entry of this format for this key")
        if not isinstance(entry.get("executable"), str) or not _KEY.fullmatch(entry["executable"]):
            raise Refused("it names no executable key")
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
