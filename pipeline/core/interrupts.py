"""Stopping a promptmill command by signal: SIGTERM handled as Ctrl-C is.

Python turns SIGINT (Ctrl-C) into ``KeyboardInterrupt``, but lets SIGTERM end the process
at once, running no ``finally``: a ``promptmill run`` ended that way left its host
processes running (issue 28). Within ``raising``, SIGTERM raises ``Interrupted``, a
``KeyboardInterrupt``, in the main thread, so the same cleanup runs for both signals,
and a second signal during that cleanup raises again (the launcher then kills at once).
``exit_code`` is the shell's convention, 128 + the signal's number: 130 for SIGINT, 143
for SIGTERM.
"""
from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(KeyboardInterrupt):
    """A signal other than SIGINT, raised as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []  # the signals the last ``raising`` block turned into Interrupted


def received() -> int | None:
    """The last signal taken since the last ``raising`` block began (during it, or after
    it, when its error is handled), or None: a library that catches the ``Interrupted``
    and raises its own error instead (Beam does, naming the step) still ended because
    of it."""
    return _received[-1] if _received else None


def signal_of(error: BaseException) -> int:
    """The signal behind an interruption: its own for ``Interrupted``, else SIGINT."""
    return getattr(error, "signum", signal.SIGINT)


def exit_code(error: BaseException) -> int:
    """The exit code of a command ended by ``error``'s signal: 128 + its number."""
    return 128 + signal_of(error)


def signal_name(error: BaseException) -> str:
    return signal.Signals(signal_of(error)).name


@contextlib.contextmanager
def raising(signals=(signal.SIGTERM,)):
    """Within the block, each of ``signals`` raises ``Interrupted`` in the main thread; the
    handlers before it are put back after. Off the main thread (only it may set
    handlers, e.g. a command run in-process by a test's thread) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _received.append(signum)
        raise Interrupted(signum)

    _received.clear()
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            # None: the handler was set outside Python (e.g. by a library's C++ code), which
            # cannot be put back from here; the default is what the process started with
            signal.signal(sig, signal.SIG_DFL if old is None else old)
