"""How a host stops: at a batch boundary, every host of the run at the same step, and
never after its launcher is gone.

**SIGTERM.** ``jax.distributed.initialize`` starts JAX's preemption service
(``jax_enable_preemption_service``, on by default), which takes SIGTERM as a preemption
notice: the process is not ended, the notice goes to every host through the
coordination service, and each host learns of it from
``multihost_utils.reached_preemption_sync_point(step)``, at the same step. The service
sets that step to one past the highest step any host has reached when the notice
arrives, and a host learns of it only when it asks at exactly that step, so every host
asks once per batch it dispatches, counting from 1 (``SyncStop``; padding batches
count, skipped slices do not). A notice that comes while the host loads and compiles
is answered at step 1, before the first batch. The hosts start their first batch
together (a barrier), so their counts stay in step and none runs on far past the others.

Verified on jax 0.10.2 with two local CPU processes before building on it: both hosts
stop at the same step 0.5-1.3 s after the SIGTERM (the service looks for a notice once a
second), and a single process behaves the same. Two things it does not do:
  * a host that has run all its batches (waiting for the others) asks no more, and
    never learns of the stop: ``pipeline.generate.cluster.finish`` has every host publish
    its outcome, done or stopped, and wait for all of them instead of at a barrier;
  * a stopped host that then exits as usual hangs in JAX's shutdown, whose barrier waits
    for every host (seen: until the other host died, then aborted): a stopped host
    leaves with ``exit_now``, once host 0, which runs the coordination service, knows
    the others are leaving (``cluster.leave``).

**SIGINT** (Ctrl-C on a ``promptmill generate`` in a terminal) is turned into the same
notice (``forward_sigint``); a second one ends the host at once.

**The launcher.** A host started by ``promptmill run`` is told its launcher's pid
(``LAUNCHER_ENV``). A thread (``watch_launcher``) checks every ``ORPHAN_POLL_S`` that it
is still the host's parent. Once it is not (the launcher was killed, even by SIGKILL,
which it cannot handle), the host sends itself SIGTERM, so it stops as above, and kills
itself ``ORPHAN_GRACE_S`` later if it has not exited by then. A thread rather than
Linux's ``prctl(PR_SET_PDEATHSIG)``: that fires when the *thread* that started the
process ends, not the launcher, exists on Linux only, and could not kill the host after
a grace period; ``getppid`` twice a second costs nothing.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from pipeline.core import logs
from pipeline.generate import json_stderr

EXIT_STOPPED = 128 + signal.SIGTERM  # 143: what a process ended by SIGTERM reports
LAUNCHER_ENV = "PROMPTMILL_LAUNCHER_PID"
ORPHAN_POLL_S = 0.5
ORPHAN_GRACE_S = 20.0


class SyncStop:
    """Asked once before each batch a host dispatches: True when the run stops there.

    Counts the batches from 1 and asks ``reached(step)`` (default: JAX's
    ``reached_preemption_sync_point``) at each. ``stopped_at``: the step it stopped at.
    """

    def __init__(self, reached: Callable[[int], bool] | None = None):
        if reached is None:
            from jax.experimental import multihost_utils

            reached = multihost_utils.reached_preemption_sync_point
        self._reached = reached
        self.step = 0
        self.stopped_at: int | None = None

    def __call__(self) -> bool:
        self.step += 1
        if self._reached(self.step):
            self.stopped_at = self.step
            return True
        return False


def forward_sigint() -> None:
    """From now on, Ctrl-C sends this process SIGTERM, the preemption notice every host
    learns of; a second Ctrl-C ends the process at once (exit 130). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    pressed = []

    def handler(signum, frame):
        if pressed:
            exit_now(128 + signal.SIGINT)
        pressed.append(signum)
        logs.event("stop_requested", signal="SIGINT", note="stopping at the next batch; Ctrl-C again to kill")
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGINT, handler)


def watch_launcher(launcher_pid: int, poll_s: float = ORPHAN_POLL_S, grace_s: float = ORPHAN_GRACE_S,
                   parent: Callable[[], int] = os.getppid, kill: Callable[[int, int], None] = os.kill) -> threading.Thread:
    """Start the thread that stops this host once ``launcher_pid`` is no longer its parent:
    SIGTERM to itself, then SIGKILL ``grace_s`` later."""

    def watch():
        while parent() == launcher_pid:
            time.sleep(poll_s)
        logs.event("launcher_gone", level=logging.WARNING, launcher_pid=launcher_pid, grace_s=grace_s)
        kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logs.event("launcher_gone_kill", level=logging.WARNING, launcher_pid=launcher_pid)
        kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def watch_launcher_from_env(env=None) -> threading.Thread | None:
    """``watch_launcher`` for the launcher named in ``LAUNCHER_ENV``, if any; a bad value is an error."""
    value = (os.environ if env is None else env).get(LAUNCHER_ENV)
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{LAUNCHER_ENV} must be the launcher's process id, got {value!r}")
    return watch_launcher(int(value))


def exit_now(code: int, last: Callable[[], None] | None = None) -> None:
    """End the process with ``code`` after flushing its logs, without Python's exit:
    JAX's shutdown at exit waits at a barrier for every host, and after a stop some never
    come (they are gone, or waiting elsewhere). ``last``: called just before the end,
    once the logs are flushed (``cluster.leave``: nothing slow may come between a host
    saying it leaves and its process ending)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if last is not None:
        last()
    json_stderr.drain()  # a host's last lines, through its JSON-lines child
    os._exit(code)
