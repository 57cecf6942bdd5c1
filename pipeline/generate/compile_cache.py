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
"""
from __future__ import annotations

import os

from pipeline.generate import jax_events


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
    return path


def entries(directory: str) -> int:
    """Number of cached executables in a local cache folder (jax names them ``*-cache``)."""
    if not os.path.isdir(directory):
        return 0
    return sum(1 for name in os.listdir(directory) if name.endswith("-cache"))
