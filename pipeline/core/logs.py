"""Structured logs: one JSON object per line and per event, on stderr."""
from __future__ import annotations

import contextlib
import json
import logging
import sys
import time

LOGGER = "promptmill"


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {"ts": round(record.created, 3), "level": record.levelname.lower(), "event": record.getMessage()}
        fields.update(getattr(record, "fields", {}))
        return json.dumps(fields, ensure_ascii=False, default=str)


_BAR = []  # the progress bar on stderr, while there is one (``above``)


@contextlib.contextmanager
def above(bar):
    """While inside, events are written above ``bar`` (a tqdm bar), never into its line."""
    _BAR.append(bar)
    try:
        yield bar
    finally:
        _BAR.remove(bar)


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when an event is logged, not to the
    stream it was at ``setup`` (a caller that redirects stderr later still gets the events),
    above the progress bar when there is one."""

    def emit(self, record: logging.LogRecord) -> None:
        bar = _BAR[-1] if _BAR else None
        if bar is None or bar.disable:
            return super().emit(record)
        try:
            bar.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


# What Beam logs on the root logger when apitools is missing (a local install without the gcp
# extra): every command printed it, a refused one too, about libraries promptmill never uses
_BEAM_APITOOLS = "apitools not found, and bigquery client libraries are not available"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _NotBeamsApitools(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_BEAM_APITOOLS)


def drop_beams_apitools_warning() -> None:
    """Drop that one warning of Beam's, and only it, at its source (the root logger);
    idempotent. Call it before Beam is imported."""
    root = logging.getLogger()
    if not any(isinstance(f, _NotBeamsApitools) for f in root.filters):
        root.addFilter(_NotBeamsApitools())


def setup(level: int = logging.INFO) -> logging.Logger:
    """Send promptmill's events to stderr as JSON lines (idempotent)."""
    logger = logging.getLogger(LOGGER)
    if not any(getattr(h, "_promptmill", False) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(_JsonLines())
        handler._promptmill = True
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


class _OursSaidOnce(logging.Filter):
    """Drops a library's log record of an exception that promptmill raised (a module of
    ``pipeline``): the command that fails of it says it in one line, and Beam's DoFn
    runner would first print its whole traceback (a truncated input, a plan error)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or not type(error).__module__.startswith("pipeline.")


def quiet_library_tracebacks() -> None:
    """Install ``_OursSaidOnce`` on the libraries' loggers (idempotent); the Python logging
    that Beam's runner uses reports through the root logger's handlers."""
    for name in ("apache_beam.runners.common", "apache_beam.runners.worker.operations", ""):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OursSaidOnce) for f in logger.filters):
            logger.addFilter(_OursSaidOnce())
        for handler in logger.handlers:
            if not any(isinstance(f, _OursSaidOnce) for f in handler.filters):
                handler.addFilter(_OursSaidOnce())


def event(name: str, level: int = logging.INFO, **fields) -> None:
    """Log one event with its fields, e.g. ``event("slice_committed", host=0, slice=3)``."""
    logging.getLogger(LOGGER).log(level, name, extra={"fields": fields})


def parse(line: str) -> dict | None:
    """The event of a log line, or None if the line is not one of ours."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) and "event" in obj else None


class Stopwatch:
    def __init__(self):
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


@contextlib.contextmanager
def heartbeat(name: str, every_s: float = 30.0, **fields):
    """While inside, log ``name`` every ``every_s`` seconds with the seconds elapsed
    (``elapsed_s``) and ``fields``: a long silent wait (a TPU compile of many minutes)
    says it is still going, and what."""
    import threading

    done = threading.Event()
    watch = Stopwatch()

    def beat():
        while not done.wait(every_s):
            event(name, elapsed_s=round(watch.seconds(), 1), **fields)

    thread = threading.Thread(target=beat, name=f"heartbeat-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
