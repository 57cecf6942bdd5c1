"""The compile cache's keys: of an executable (the lowered program and the host's devices), of
what compiling one found (``figures_key``), and of the index (what a program is made of)."""
from __future__ import annotations

import functools
import hashlib
import json
import os


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
    """sha256 of the Python sources that build every program: promptmill's own (the
    ``pipeline`` package) and those of each family registered from outside it (every
    module of its top-level package that is loaded once the registry has imported it),
    so a plug-in family's edit is a new key."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [os.path.join(folder, name) for folder, dirs, names in os.walk(root)
             for name in names if name.endswith(".py") and "__pycache__" not in folder]
    digest = hashlib.sha256()
    for path in sorted(set(paths) | _plugin_sources()):
        digest.update(path.encode() if not path.startswith(root) else os.path.relpath(path, root).encode())
        digest.update(b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
        digest.update(b"\0")
    return digest.hexdigest()


def _plugin_sources() -> set[str]:
    """The source files of the families registered from outside ``pipeline``: the loaded
    modules of each one's top-level package."""
    import sys

    from pipeline.model.families import FAMILIES

    tops = {type(family).__module__.split(".")[0] for family in FAMILIES} - {"pipeline"}
    return {os.path.abspath(module.__file__) for name, module in list(sys.modules.items())
            if name.split(".")[0] in tops and getattr(module, "__file__", None)
            and module.__file__.endswith(".py")}


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
