"""Scheduled runs: a run is named by its scheduled date.

A scheduler (Cloud Scheduler, a Composer DAG) triggers the same command every day. The
command's ``--out`` holds ``{date}``, which becomes the run's scheduled date, and the
job names carry the date too. So a second trigger for the same date (a retry, a manual
re-run) lands in the same OUT and resumes it (committed slices are skipped), and another
date starts another run.
"""
from __future__ import annotations

import datetime as dt
import re

PLACEHOLDER = "{date}"
_NAME_MAX = 40  # JobSet names become pod host names with suffixes; Dataflow allows more


def run_date(value: str | None = None, now: dt.datetime | None = None) -> str:
    """The scheduled date as ``YYYY-MM-DD``, from a date, an RFC 3339 time (Cloud
    Scheduler's and Airflow's), or (``None``) today in UTC."""
    if value is None:
        return (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc).date().isoformat()
    text = value.strip()
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            return dt.date.fromisoformat(text).isoformat()
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}[T ].+", text):  # the same forms on every Python
            raise ValueError(text)
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--date must be YYYY-MM-DD or an RFC 3339 time, got {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment.astimezone(dt.timezone.utc).date().isoformat()


def resolve_out(out: str, date: str | None) -> str:
    """``out`` with ``{date}`` replaced by ``date``; an ``out`` without the placeholder
    is returned as it is, and a placeholder without a date is an error."""
    day = run_date(date) if date is not None else None  # a bad --date is an error even without {date}
    if PLACEHOLDER not in out:
        return out
    if day is None:
        raise ValueError(f"--out {out!r} holds {PLACEHOLDER}: give the run's --date")
    return out.replace(PLACEHOLDER, day)


def job_name(prefix: str, date: str | None = None) -> str:
    """A Kubernetes- and Dataflow-safe job name: lowercase letters, digits and '-',
    starting with a letter, with the scheduled date at the end when there is one."""
    base = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-") or "promptmill"
    if not base[0].isalpha():
        base = f"pm-{base}"
    suffix = f"-{run_date(date).replace('-', '')}" if date else ""
    return base[:_NAME_MAX - len(suffix)].rstrip("-") + suffix
