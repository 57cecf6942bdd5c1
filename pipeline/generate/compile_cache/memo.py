"""The TPU check's memo: what compiling a program for another machine found, kept by its key."""
from __future__ import annotations

import json
import os

from pipeline.generate.compile_cache import folders
from pipeline.generate.compile_cache.folders import CHECKS, CHECKS_FOLDER, check_existing, write_whole

def checks_folder(folder: str | None = None) -> str:
    """Where ``remember`` keeps results: under ``folder``, else the one a compiling
    child's parent named (``CHECKS_FOLDER``: both keep their results in one place), else
    under this machine's ``local_default``."""
    if folder is None and os.environ.get(CHECKS_FOLDER):
        return os.environ[CHECKS_FOLDER]
    return os.path.join(folder or folders.local_default(), CHECKS)


def remember(key: str, value: dict, folder: str | None = None) -> None:
    """Keep ``value`` (JSON), what compiling the program of ``key`` (``index_key``) for
    another machine found, under ``folder`` (default: this machine's ``local_default``)."""
    write_whole(os.path.join(checks_folder(folder), f"{key}.json"), json.dumps(value, sort_keys=True).encode())


def recall(key: str, folder: str | None = None) -> dict | None:
    """What ``remember`` kept for ``key``, or None (none, or unreadable); a checks folder
    others can write is refused (``UnsafeCacheFolder``)."""
    check_existing(checks_folder(folder))
    try:
        with open(os.path.join(checks_folder(folder), f"{key}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
