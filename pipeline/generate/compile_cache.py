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
the same folder (``EXECUTABLES``): each host serialises its compiled executable
(``jax.experimental.serialize_executable``) under a key made of the lowered program and
the host's device assignment, and loads it back on the next run (``load_or_compile``). An
executable is the one XLA compiled for exactly that program and those devices, so a
loaded one computes the same bits as a fresh compilation.

Lowering the sampler to find that key takes seconds too (tracing a whole UNet in
Python), so a host also keeps an index from what the program is made of to its
executable (``INDEX``, ``index_key``): the caller's description of the program (the
model's configs, the sampler's settings), promptmill's own source code, the versions of
the libraries that trace it, and the host's devices. A warm host finds its executable
through the index without tracing anything (``load_indexed``). The executable keeps its
own key, so a program that lowers to the same text under another description is
compiled once.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import pickle
import tempfile

from pipeline.generate import jax_events

EXECUTABLES = "executables"  # the per-host executables' folder, inside the cache folder
CHECKS = "checks"  # results of programs compiled for other machines (the TPU check), by index key
CHECKS_FOLDER = "PROMPTMILL_CHECKS_FOLDER"  # a compiling child's parent's ``checks_folder``
INDEX = "index"  # inside EXECUTABLES: what a program is made of -> its executable's key


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
    from pipeline.model.cache import cache_dir

    return os.path.join(cache_dir(), "compile-cache", "local")


_REMOTE: dict[str, str] = {}  # gs:// cache folder -> its local mirror, for ``push``


def _mirror(remote: str) -> str:
    import hashlib

    from pipeline.model.cache import cache_dir

    return os.path.join(cache_dir(), "compile-cache", hashlib.sha256(remote.encode()).hexdigest()[:16])


def pull(remote: str) -> str:
    """Copy a gs:// cache folder's entries into its local mirror; returns the mirror."""
    from pipeline.io import storage

    local = _mirror(remote)
    os.makedirs(local, exist_ok=True)
    for path in storage.glob(remote + "/*"):
        target = os.path.join(local, path.rsplit("/", 1)[-1])
        if not os.path.exists(target):
            storage.download(path, target)
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


def enable(directory: str) -> str:
    """Turn on the persistent compilation cache in ``directory``; returns the folder used.

    The folder is checked by ``resolve``, and a local one is created if needed.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = resolve(directory)
    if path.startswith("gs://"):
        path = pull(path)  # jax works on the local mirror; ``push`` uploads what it adds
    os.makedirs(path, exist_ok=True)

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

    libraries = [f"{name} {metadata.version(name)}" for name in ("flax", "diffusers", "transformers", "numpy")]
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
    """A whole entry under its final name. A local one is renamed into place, so a host
    reading it meanwhile never sees half of it; a GCS object is uploaded whole."""
    from pipeline.io import storage

    if storage.is_gcs(path):
        storage.write_bytes(path, data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=".entry-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(scratch, 0o644)  # mkstemp made it private; the cache is shared like jax's
        os.replace(scratch, path)
    finally:
        if os.path.exists(scratch):
            os.remove(scratch)


def _load(path: str, devices):
    """The executable at ``path``, loaded onto ``devices``; None (logged) if unreadable."""
    from jax.experimental import serialize_executable

    from pipeline.core import logs
    from pipeline.io import storage

    try:
        data, in_tree, out_tree = pickle.loads(storage.read_bytes(path))
        return serialize_executable.deserialize_and_load(data, in_tree, out_tree, execution_devices=list(devices))
    except Exception as e:  # noqa: BLE001 - any unreadable entry is replaced, never trusted
        logs.event("executable_cache_unreadable", path=path, error=f"{type(e).__name__}: {e}")
        return None


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
    ``enable`` chose, none before it).

    Returns (the compiled program, whether it was loaded from the cache). A compiled
    program is written to the cache; an entry that cannot be loaded (another jaxlib's,
    truncated) is logged, compiled again and replaced. Entries are unpickled: the cache
    folder must be as trusted as the code (so is jax's own cache). ``index``: (its
    ``index_key``, what ``load_indexed`` should return with it), recorded in the index.
    """
    from jax.experimental import serialize_executable

    from pipeline.io import storage

    folder = folder or _executables
    if folder is None:
        return _compiled_once(lowered, devices), False
    folder = folder.rstrip("/")
    key = executable_key(lowered, devices)
    path = f"{folder}/{key}"
    compiled = _load(path, devices) if storage.exists(path) else None
    hit = compiled is not None
    if hit:
        EXECUTABLE_COUNTS["hits"] += 1
    else:
        compiled = lowered.compile()
        _write(path, pickle.dumps(serialize_executable.serialize(compiled)))
        EXECUTABLE_COUNTS["writes"] += 1
    if index is not None:
        _write(f"{folder}/{INDEX}/{index[0]}", pickle.dumps({"executable": key, "extra": index[1]}))
        EXECUTABLE_COUNTS["writes"] += 1
    return compiled, hit


def load_indexed(key: str, devices, folder: str | None = None):
    """(the executable the index names for ``key`` (``index_key``), loaded onto ``devices``,
    and the ``extra`` recorded with it), or None: no cache, no entry, or an unreadable one
    (then the caller lowers and compiles, and ``load_or_compile`` replaces it)."""
    from pipeline.io import storage

    folder = folder or _executables
    if folder is None:
        return None
    folder = folder.rstrip("/")
    path = f"{folder}/{INDEX}/{key}"
    if not storage.exists(path):
        return None
    try:
        entry = pickle.loads(storage.read_bytes(path))
        executable = f"{folder}/{entry['executable']}"
    except Exception:  # noqa: BLE001 - an unreadable index entry is rewritten after the compile
        return None
    compiled = _load(executable, devices) if storage.exists(executable) else None
    if compiled is None:
        return None
    EXECUTABLE_COUNTS["hits"] += 1
    return compiled, entry["extra"]


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
    """What ``remember`` kept for ``key``, or None (none, or unreadable)."""
    try:
        with open(os.path.join(checks_folder(folder), f"{key}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
