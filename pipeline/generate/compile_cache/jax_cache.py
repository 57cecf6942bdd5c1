"""JAX's own persistent compilation cache, turned on in a run's cache folder (``enable``)."""
from __future__ import annotations

import os

from pipeline.generate import jax_events
from pipeline.generate.compile_cache.folders import (CHECKS, EXECUTABLES, INDEX, check_existing, private_folder, pull,
                                                     resolve)

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
        check_existing(os.path.join(path, folder))

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
    global _EXECUTABLES_FOLDER
    _EXECUTABLES_FOLDER = f"{resolve(directory)}/{EXECUTABLES}"
    return path


_EXECUTABLES_FOLDER: str | None = None  # where ``load_or_compile`` keeps executables: set by ``enable``


def executables_folder() -> str | None:
    """Where this process keeps its executables (``EXECUTABLES``), once ``enable`` ran."""
    return _EXECUTABLES_FOLDER


def forget() -> None:
    """No executables' folder any more (a process that turned jax's cache off again)."""
    global _EXECUTABLES_FOLDER
    _EXECUTABLES_FOLDER = None
