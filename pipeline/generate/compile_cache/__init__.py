"""The compile cache: a run's programs compiled once, then loaded, on every host and every re-run.

``folders`` (local or gs:// folders, private and checked), ``jax_cache`` (JAX's own
persistent cache), ``keys`` (what a program and a host's devices hash to), ``codec`` and
``program`` (a compiled program's JSON description, read back without pickle),
``entries`` (each host's executables and their index, ``load_or_compile``,
``load_indexed``) and ``memo`` (the TPU check's results by program). The cache never
changes an output byte: it is an execution option, not a setting.
"""
from pipeline.generate.compile_cache.entries import (  # noqa: F401 (the cache's face)
    ENTRY_MAGIC, EXECUTABLE_COUNTS, entries, load_indexed, load_or_compile)
from pipeline.generate.compile_cache.folders import (  # noqa: F401
    CHECKS, CHECKS_FOLDER, EXECUTABLES, INDEX, UnsafeCacheFolder, check_before_run, check_private, local_default,
    private_folder, pull, push, resolve)
from pipeline.generate.compile_cache.jax_cache import enable, executables_folder  # noqa: F401
from pipeline.generate.compile_cache.keys import code_digest, executable_key, figures_key, index_key  # noqa: F401
from pipeline.generate.compile_cache.memo import checks_folder, recall, remember  # noqa: F401
