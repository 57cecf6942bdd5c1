"""The local model cache: where checkpoints are kept, and how a folder is made there once."""
from __future__ import annotations

import os
import shutil
import tempfile

from pipeline.core import logs


def cache_dir() -> str:
    """promptmill's local cache folder: ``$PROMPTMILL_CACHE``, else ``~/.cache/promptmill``."""
    return os.environ.get("PROMPTMILL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "promptmill")


def is_made(target: str, marker: str = "model_index.json") -> bool:
    """Whether the cache folder ``target`` (a checkpoint) is complete: ``materialize`` renames
    a folder into place only once it is. ``marker``: the file every such folder holds (a
    diffusers checkpoint's ``model_index.json``; a transformers model's ``config.json``)."""
    return os.path.isfile(os.path.join(target, marker))


def materialize(target: str, fill, marker: str = "model_index.json") -> str:
    """Make the local cache folder ``target`` once per machine; returns it.

    Processes asking for the same folder at once take turns on a file lock beside it
    (``TARGET.lock``): the first fills it, the others wait and then find it made, so a
    checkpoint is downloaded or built once per machine, not once per process.
    ``fill(scratch)`` writes into a private scratch folder beside ``target``, which is
    then renamed into place (a local, atomic rename): a crash leaves no half-written
    folder, and its lock (an ``flock``) dies with the process, so the next one starts over.
    ``marker``: see ``is_made``.
    """
    from filelock import FileLock, Timeout

    if is_made(target, marker):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    lock = FileLock(f"{target}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logs.event("cache_wait", folder=target, reason="another process on this machine is making it")
        lock.acquire()
    try:
        if is_made(target, marker):
            return target
        scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}-", dir=os.path.dirname(target))
        try:
            fill(scratch)
            os.chmod(scratch, 0o755)  # mkdtemp made it private
            try:
                os.rename(scratch, target)
            except OSError:  # made meanwhile by a process that took no lock (an older promptmill)
                if not is_made(target, marker):
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        lock.release()
    return target
