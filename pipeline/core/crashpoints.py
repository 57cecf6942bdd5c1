"""Deterministic crash points, to test resume after a host dies, and a pause after each
batch, to test stopping a run midway.

``PROMPTMILL_CRASH_AT=HOST:POINT:N`` makes host HOST kill itself with SIGKILL, as a
``kill -9`` from outside would, the N-th time (from 0) it reaches POINT:

* ``ready``: warmed up, before its first slice (so before its first commit);
* ``mid_slice``: inside a slice, once the first batch's images are stored, before the
  slice's shards and commit marker;
* ``committed``: right after a slice's commit marker, before the next slice.

``PROMPTMILL_PAUSE_AFTER_BATCH=S`` makes every host sleep S seconds after dispatching
each batch: a run that lasts long enough to be stopped midway, on any machine, with no
more work for its devices.

Unset (always, outside tests), every call is a dictionary lookup.
"""
from __future__ import annotations

import collections
import os
import signal
import time
from typing import Callable

ENV = "PROMPTMILL_CRASH_AT"
PAUSE_ENV = "PROMPTMILL_PAUSE_AFTER_BATCH"
POINTS = ("ready", "mid_slice", "committed")
_reached: collections.Counter = collections.Counter()


def parse(spec: str) -> tuple[int, str, int]:
    """``"1:mid_slice:0"`` -> ``(1, "mid_slice", 0)``; ValueError naming the problem."""
    parts = spec.split(":")
    if len(parts) == 2:
        parts.append("0")
    if len(parts) != 3 or parts[1] not in POINTS or not parts[0].isdigit() or not parts[2].isdigit():
        raise ValueError(f"{ENV} must be HOST:POINT[:N] with POINT one of {', '.join(POINTS)}, got {spec!r}")
    return int(parts[0]), parts[1], int(parts[2])


def reached(point: str, host: int, before: Callable[[], None] | None = None) -> None:
    """Note that ``host`` reached ``point``; die here if ``PROMPTMILL_CRASH_AT`` says so.

    ``before`` runs first (e.g. to let pending uploads land, so the crash leaves them).
    """
    spec = os.environ.get(ENV)
    if not spec:
        return
    count = _reached[point]
    _reached[point] += 1
    if parse(spec) == (host, point, count):
        if before is not None:
            before()
        from pipeline.core import logs

        logs.event("crash_point", host=host, point=point, n=count)
        os.kill(os.getpid(), signal.SIGKILL)


def pause_seconds(value: str | None) -> float:
    """``PROMPTMILL_PAUSE_AFTER_BATCH``'s seconds (0 when unset); ValueError naming the problem."""
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < 60:
        raise ValueError(f"{PAUSE_ENV} must be seconds, at least 0 and below 60, got {value!r}")
    return seconds


def batch_dispatched() -> None:
    """A host dispatched a batch: sleep if ``PROMPTMILL_PAUSE_AFTER_BATCH`` says so."""
    value = os.environ.get(PAUSE_ENV)
    if value:
        time.sleep(pause_seconds(value))
