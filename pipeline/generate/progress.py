"""A host's progress object under OUT: where the host stands, for ``promptmill status``
on any machine.

The logs of a remote run are not under OUT (GKE and Dataflow keep them elsewhere), so
every host also writes one small JSON object, ``naming.progress_file``: its state, its
last event and when, the slices and images it committed in this attempt and its rate
over the last minutes, the slices it skipped or redid, and why it failed. It is fed by
the host's own log events (``Progress`` is a logging handler on promptmill's logger), so
it says what the log says, and written through the storage layer (local or gs://) by a
thread of its own: every ``INTERVAL_S`` seconds, and at once when the host's state
changes. Its ``updated_at`` is when it was written, so a host that stopped writing
(killed, or its machine gone) shows as stale, even while it compiles for minutes and
logs nothing. A failed write is logged and tried again at the next interval; it never
stops the host. A re-run's hosts start their objects afresh: totals come from the
commit markers, not from here.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

from pipeline.core import logs, naming
from pipeline.io import storage

INTERVAL_S = 5.0
CLOSE_TIMEOUT_S = 10.0
RATE_WINDOW_S = 300.0  # the rate is over the slices committed in the last five minutes
MAX_LISTED = 50  # slice indices kept per list (redone); the count is always whole
# the host's state after each of these events
STATES = {"host_started": "starting", "host_ready": "generating", "host_done": "done", "host_stopped": "stopped",
          "host_failed": "failed", "host_killed": "killed"}
# host_killed is the local launcher's, written for a host it had to SIGKILL (the host wrote nothing more)
FINAL = ("done", "stopped", "failed", "killed")


def initial(name: str, host: int | None, hosts: int | None, now: float) -> dict:
    """A host's progress before its first event (pure)."""
    return {"name": name, "host": host, "hosts": hosts, "pid": os.getpid(), "machine": socket.gethostname(),
            "state": "starting", "started_at": round(now, 3), "updated_at": round(now, 3), "last_event": None,
            "last_event_at": None, "last_slice": None, "slices": 0, "images": 0, "images_per_s": None,
            "skipped": 0, "redone": 0, "redone_slices": [], "padding_slots": 0, "failure": None,
            "recent": []}


def rate(recent: list[list[float]], now: float, window_s: float = RATE_WINDOW_S) -> float | None:
    """Images per second over the commits of the last ``window_s`` seconds (pure):
    ``recent`` holds [started, committed, images] per slice; the span runs from the
    earliest start among them to the latest commit. None without such a commit."""
    kept = [r for r in recent if r[1] >= now - window_s]
    if not kept:
        return None
    span = max(r[1] for r in kept) - min(r[0] for r in kept)
    return round(sum(r[2] for r in kept) / span, 3) if span > 0 else None


def apply(progress: dict, event: str, fields: dict, ts: float) -> dict:
    """The progress after one log event of the host (pure): a new dict."""
    p = {**progress, "last_event": event, "last_event_at": round(ts, 3)}
    if event in STATES:
        p["state"] = STATES[event]
    if event == "slice_committed":
        p["slices"] += 1
        p["images"] += fields.get("images", 0)
        p["last_slice"] = fields.get("slice")
        started, committed = fields.get("started_ts", ts), fields.get("committed_ts", ts)
        p["recent"] = [r for r in progress["recent"] if r[1] >= ts - RATE_WINDOW_S] + \
            [[started, committed, fields.get("images", 0)]]
        p["images_per_s"] = rate(p["recent"], ts)
    elif event == "slice_skipped":
        p["skipped"] += 1
    elif event == "slice_redone":
        p["redone"] += 1
        p["redone_slices"] = (progress["redone_slices"] + [fields.get("slice")])[-MAX_LISTED:]
    elif event == "padding_slot":
        p["padding_slots"] += 1
    elif event in ("host_failed", "host_killed"):
        p["failure"] = fields.get("error")
    return p


def mark_killed(path: str, reason: str, now: float | None = None) -> None:
    """Rewrite the progress object at ``path`` of a host its launcher killed (SIGKILL: the
    host could write nothing more) as ``killed``, with ``reason``, so that ``status`` does
    not show it generating until it goes stale. Nothing when the host never wrote one."""
    now = time.time() if now is None else now
    if not storage.exists(path):
        return
    p = apply(storage.read_json(path), "host_killed", {"error": f"killed by its launcher: {reason}"}, now)
    storage.write_json(path, {**p, "updated_at": round(now, 3)})


class Progress(logging.Handler):
    """Keeps a host's progress from its log events and writes it under ``out`` as
    ``name`` (``start`` .. ``close``; ``close`` writes the last state before returning)."""

    def __init__(self, out: str, name: str, host: int | None = None, hosts: int | None = None,
                 interval_s: float = INTERVAL_S, clock=time.time):
        super().__init__()
        self.path = naming.progress_file(out, name)
        self.interval_s, self.clock = interval_s, clock
        self.state = initial(name, host, hosts, clock())
        self._lock = threading.Lock()
        self._urgent = threading.Event()  # the state changed: write now
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._writing = threading.Lock()
        self._logger = logging.getLogger(logs.LOGGER)

    def start(self) -> "Progress":
        self._logger.addHandler(self)
        self._urgent.set()
        self._thread.start()
        return self

    def emit(self, record: logging.LogRecord) -> None:
        if threading.current_thread() is self._thread:
            return  # the writer's own events (a failed write) are not progress
        with self._lock:
            before = self.state["state"]
            self.state = apply(self.state, record.getMessage(), getattr(record, "fields", {}), record.created)
            if self.state["state"] != before:
                self._urgent.set()

    def snapshot(self) -> dict:
        """What the object holds: the progress without its rate's working list, as of now."""
        with self._lock:
            return {**{k: v for k, v in self.state.items() if k != "recent"}, "updated_at": round(self.clock(), 3)}

    def _write(self) -> None:
        with self._writing:
            try:
                storage.write_json(self.path, self.snapshot())
            except Exception as e:  # noqa: BLE001 - best effort: the host goes on, the next write may succeed
                logs.event("progress_not_written", level=logging.WARNING, path=self.path,
                           error=f"{type(e).__name__}: {e}")

    def _loop(self) -> None:
        while not self._finished.is_set():
            self._urgent.wait(self.interval_s)
            self._urgent.clear()
            if not self._finished.is_set():
                self._write()

    def _last_write(self) -> None:
        if self._thread.is_alive():
            self._thread.join()
        self._write()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop listening and writing, then write the last state (once; later calls do
        nothing). Waits at most ``timeout_s`` for it: a stopping host must not wait out the
        storage layer's retries on an unreachable bucket."""
        if self._finished.is_set():
            return
        self._finished.set()
        self._urgent.set()
        self._logger.removeHandler(self)
        last = threading.Thread(target=self._last_write, name="progress-last", daemon=True)
        last.start()
        last.join(timeout_s)
        if last.is_alive():
            logs.event("progress_not_written", level=logging.WARNING, path=self.path,
                       error=f"the last write took more than {timeout_s:g} s; left behind")
        super().close()
