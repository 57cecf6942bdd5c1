"""The local model cache: where checkpoints are kept, and how a folder is made there once."""
from __future__ import annotations

import os
import shutil
import tempfile


def cache_dir() -> str:
    """promptmill's local cache folder: ``$PROMPTMILL_CACHE``, else ``~/.cache/promptmill``."""
    return os.environ.get("PROMPTMILL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "promptmill")


def materialize(target: str, fill) -> str:
    """Make the local cache folder ``target`` once; returns it.

    ``fill(scratch)`` writes into a private scratch folder beside ``target``, which is
    then renamed into place (a local, atomic rename). Processes racing for the same
    folder each fill their own scratch; the first rename wins, and no reader ever sees
    a half-written folder.
    """
    if os.path.isfile(os.path.join(target, "model_index.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}-", dir=os.path.dirname(target))
    try:
        fill(scratch)
        os.chmod(scratch, 0o755)  # mkdtemp made it private
        try:
            os.rename(scratch, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "model_index.json")):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
