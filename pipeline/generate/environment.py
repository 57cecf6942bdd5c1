"""The environment a run's images are made in, and the check that every attempt makes them in the same one.

An image's bits depend on more than its settings: promptmill's code, jax and jaxlib (the
compiler), libtpu on TPUs, flax, the XLA flags that reach the compiler and the platform
(the kind of device). A run resumed under another of any of these would mix images of
two environments in one dataset, and ``reproduce`` of the old ones would fail. So the
first hosts to generate a run record theirs in ``OUT/environment.json``; every later
host, and a local launcher before it starts any, compares its own against it and
refuses a difference, naming each, with what to do. Each metadata row carries the
record's fingerprint, and collect checks it (``pipeline.collect``).

The device count is not part of it (``--xla_force_host_platform_device_count``: an
image's bytes do not depend on the number of devices), nor is anything of the planner's.
"""
from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata

from pipeline import __version__
from pipeline.core import naming
from pipeline.io import storage

LIBRARIES = ("jax", "jaxlib", "libtpu", "flax")  # besides promptmill; libtpu only where installed
NOT_DECISIVE = ("--xla_force_host_platform_device_count",)  # XLA flags that do not change an image's bits
# where flags reach XLA's compilers; NPROC: the CPU backend's thread count (``pin_cpu_threads``)
FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "NPROC")
# XLA's CPU backend sizes its thread pool max(NPROC or the machine's cores, local CPU
# devices), and compiles for that many threads: it splits a large elementwise loop into
# up to that many parts, and a loop split otherwise may round its floats otherwise. So
# without a pin a host of 4 CPU devices on a 2-core machine compiles other bits than a
# host of 2 (a 1x4 run would not equal its 2x2 twin). Every promptmill process pins
# NPROC to at least this many threads, which makes the pool, and so the programs, the
# same for up to this many local devices per process on any machine of at most this
# many cores; a machine with more cores keeps its own count.
CPU_THREADS = 8


class EnvironmentChanged(RuntimeError):
    pass


def pin_cpu_threads(environ=None) -> None:
    """Set NPROC (``CPU_THREADS``, or the machine's cores if more) in ``environ``
    (``os.environ``) unless it is set: before jax starts its CPU backend, which reads it
    then. A value the user set is kept, and recorded like an XLA flag (``current``)."""
    environ = os.environ if environ is None else environ
    environ.setdefault("NPROC", str(max(os.cpu_count() or 1, CPU_THREADS)))


def current(platform: str | None = None) -> dict:
    """This process's environment for making images (``platform``: "kind/device kind",
    given where jax's devices are not this process's to ask, e.g. a local launcher whose
    hosts run on CPU devices; None: jax's first device, which starts jax's backend)."""
    found = {"promptmill": __version__}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    for variable in FLAG_VARIABLES:
        flags = sorted(flag for flag in os.environ.get(variable, "").split()
                       if not flag.startswith(NOT_DECISIVE))
        if flags:
            found[variable] = " ".join(flags)
    if platform is None:
        import jax

        device = jax.local_devices()[0]
        platform = f"{device.platform}/{device.device_kind}"
    found["platform"] = platform
    return found


def fingerprint(environment: dict) -> str:
    """A short hash of an environment record, as each metadata row carries it."""
    return hashlib.sha256(json.dumps(environment, sort_keys=True).encode()).hexdigest()[:16]


def differences(recorded: dict, now: dict) -> list[str]:
    """What differs between two environments, one line per entry (pure)."""
    return [f"{name}: {recorded.get(name, '(none)')} when the run started, {now.get(name, '(none)')} now"
            for name in sorted(set(recorded) | set(now)) if recorded.get(name) != now.get(name)]


def recorded(out: str) -> dict | None:
    """The environment ``out``'s images are made in, None before its first host started."""
    path = naming.environment(out)
    return storage.read_json(path) if storage.exists(path) else None


def check(out: str, now: dict, who: str = "") -> None:
    """EnvironmentChanged unless ``now`` is the environment ``out``'s images are made in (or
    none is recorded yet); ``who`` says who is refused ("host 3"), where it is not the command."""
    found = recorded(out)
    if found is None or found == now:
        return
    raise EnvironmentChanged(
        f"{who + ': ' if who else ''}{out} was generated in another environment, and an image's bits depend on it, so its dataset would "
        f"mix images of two: {'; '.join(differences(found, now))}. Finish the run in the environment that started "
        f"it (the same container image, libraries and XLA flags), or start again with --overwrite or another --out")


def establish(out: str, now: dict, who: str) -> str:
    """Record ``now`` as the environment of ``out`` if none is, else ``check`` it against the
    record; returns the record's fingerprint. Hosts starting together record the same
    bytes; one that finds another's record first is checked against it."""
    if recorded(out) is None:
        try:
            storage.write_if(naming.environment(out), json.dumps(now, indent=2, sort_keys=True).encode() + b"\n", 0)
        except storage.Conflict:  # another host wrote it first
            pass
    check(out, now, who)
    return fingerprint(now)
