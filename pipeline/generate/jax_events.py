"""Counts of ``jax.monitoring`` events in this process: compilations, compile-cache hits.

Tests and logs use them to prove that nothing recompiles after warm-up, and whether a
host's programs came from the persistent compilation cache.
"""
from __future__ import annotations

import threading

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_WRITE = "/jax/compilation_cache/cache_misses"  # a miss is compiled and written to the cache


class EventCounter:
    """Counts the events named ``events`` from the first ``install`` on.

    ``durations``: the events are duration events (``register_event_duration_secs_listener``),
    else plain events (``register_event_listener``). A listener, once registered, stays
    for the life of the process, so ``install`` registers it once.
    """

    def __init__(self, *events: str, durations: bool = False):
        self._counts = dict.fromkeys(events, 0)
        self._by_thread: dict[tuple[int, str], int] = {}  # (thread ident, event) -> count
        self._durations = durations
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> "EventCounter":
        import jax

        with self._lock:
            if not self._installed:
                register = (jax.monitoring.register_event_duration_secs_listener if self._durations
                            else jax.monitoring.register_event_listener)
                register(self._listener)
                self._installed = True
        return self

    def _listener(self, event: str, *args, **kwargs) -> None:
        if event in self._counts:
            key = (threading.get_ident(), event)
            with self._lock:
                self._counts[event] += 1
                self._by_thread[key] = self._by_thread.get(key, 0) + 1

    def count(self, event: str | None = None) -> int:
        """How many times ``event`` (or the counter's only event) happened since ``install``."""
        if event is None:
            [event] = self._counts
        return self._counts[event]

    def count_here(self, event: str | None = None) -> int:
        """``count``, of the events that happened on the calling thread only (jax reports a
        compilation on the thread that asked for it): what one thread compiled while
        others ran."""
        if event is None:
            [event] = self._counts
        return self._by_thread.get((threading.get_ident(), event), 0)


COMPILES = EventCounter(BACKEND_COMPILE, durations=True)
CACHE = EventCounter(CACHE_HIT, CACHE_WRITE)
