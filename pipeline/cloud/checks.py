"""Checks every submission makes before anything runs, and the job name it runs under.

Each check returns the value it was given, or raises a ValueError naming the flag and
what to pass instead.
"""
from __future__ import annotations

import hashlib
import os

from pipeline.cloud import dates as schedule
from pipeline.io import storage


def require_gcs(flag: str, value: str | None, target: str) -> str:
    """``value`` if it is a gs:// path, else a ValueError naming the flag and the fix."""
    if not value or not storage.is_gcs(value) or len(value.rstrip("/")) <= len("gs://"):
        raise ValueError(f"{flag} must be a gs://BUCKET/PREFIX path for submit {target} (its workers read and "
                         f"write Cloud Storage, not this machine's disk), got {value!r}")
    return value


def require_remote_model(model: str, target: str) -> str:
    """``model`` unless it is a folder on this machine, which the workers cannot see."""
    if model != "tiny" and not storage.is_gcs(model) and os.path.exists(model):
        raise ValueError(f"--model {model!r} is a folder on this machine, which the {target} workers cannot read: "
                         f"copy it to gs://BUCKET/models/NAME and pass that (or bake it into the image)")
    return model


def require_value(flag: str, value, target: str, example: str):
    if value is None or value == "":
        raise ValueError(f"submit {target} needs {flag}, e.g. {flag} {example}")
    return value


def job_name(out: str, name: str | None = None, date: str | None = None) -> str:
    """The Dataflow job / JobSet name: ``name`` (or ``promptmill-`` and a hash of OUT) and the date.

    Without ``--name`` the name follows from OUT, so re-running the same command finds
    the same JobSet (and Dataflow refuses a second running job of one name) instead of
    starting a second one on the same OUT. ``schedule.job_name`` keeps it a valid
    Kubernetes and Dataflow name and appends the scheduled date.
    """
    prefix = name or f"promptmill-{hashlib.sha256(out.rstrip('/').encode()).hexdigest()[:8]}"
    return schedule.job_name(prefix, date)
