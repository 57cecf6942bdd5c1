"""Every line a host writes to its log is a JSON line.

A host's log is its stderr. Python's logs are JSON lines already (``pipeline.core.logs``),
but the C++ libraries underneath (XLA, the TPU runtime, gRPC) write their own lines to
the same file descriptor (``W1128 ... preemption_notifier.cc:90] SIGTERM caught``), which
break a reader that takes the log as JSON lines (``jq``, ``promptmill status``). So a host
routes its stderr (fd 2, for every thread and library) through a small child process
that passes JSON lines through as they are and wraps any other line in a ``native_log``
event. The child ignores SIGTERM and SIGINT, which a stopping host's process group gets,
and ends when the last writer is gone, so a host's last lines are never lost; a host
that ends through ``stopping.exit_now`` waits for it (``drain``).
"""
from __future__ import annotations

import os
import subprocess

from pipeline.core import children

_CHILD = r"""
import json, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
out = sys.stdout.buffer
for raw in sys.stdin.buffer:
    text = raw.rstrip(b"\r\n")
    try:
        whole = text[:1] == b"{" and isinstance(json.loads(text), dict)
    except ValueError:
        whole = False
    if not whole:
        if not text.strip():
            continue
        text = json.dumps({"ts": round(time.time(), 3), "level": "warning", "event": "native_log",
                           "line": text.decode("utf-8", "replace")}).encode()
    out.write(text + b"\n")
    out.flush()
"""
_child: subprocess.Popen | None = None


def route() -> None:
    """Route this process's stderr through the JSON-lines child (once per process)."""
    global _child
    if _child is not None:
        return
    read, write = os.pipe()
    log = os.dup(2)
    _child = subprocess.Popen(children.python("-c", _CHILD), stdin=read, stdout=log, close_fds=True)
    os.close(read)
    os.close(log)
    os.dup2(write, 2)
    os.close(write)


def drain(timeout_s: float = 5.0) -> None:
    """Close this process's stderr and wait until the child has written every line."""
    if _child is None:
        return
    try:
        os.close(2)
    except OSError:
        pass
    try:
        _child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
