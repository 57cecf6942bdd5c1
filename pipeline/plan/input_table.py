"""The input table: which prompt files a run was planned from, and what they held.

A run is its settings and its inputs. The plan records every file the prompt pattern
matched, with its size and a content checksum, in ``plan/inputs.json`` before ``run.json``
is written. On GCS the checksum is the object's md5 (crc32c for a composite object), and
one listing of the pattern's prefix gives every file's (a request per 1,000 files; nothing
is read). Locally it is the sha256 of the file's bytes, which takes reading the file: the
run keeps each local file's checksum with its size and modification time (ns) in
``plan/input_cache.json``, and a resume reads again only a file whose size or time
changed. A resume, a re-run or ``collect`` of
that run compares the files the pattern matches now against the table and refuses to
go on when any differs, naming each file and what changed: a file edited, a file the
pattern newly matches, a file it no longer matches. Otherwise one dataset could hold
images of two versions of the same prompts.

Every run this version plans has a table, written before its ``run.json``; a run
whose table is gone cannot be checked, so it is refused, never resumed unchecked.
"""
from __future__ import annotations

from pipeline.core import naming
from pipeline.io import storage
from pipeline.plan.layout import PlanError, prompt_files

SHOWN = 10  # changed files named in a refusal


def table(pattern: str, cached: dict | None = None) -> tuple[dict, dict]:
    """(the input table of ``pattern`` now, ``{"pattern", "files": {path: "size:checksum"}}``;
    the cache of its local files' checksums, {path: {"size", "mtime_ns", "checksum"}}).
    ``cached``: an earlier cache, whose checksum of a file is taken when the file's size
    and modification time are still the ones it was read at."""
    files, cache = {}, {}
    for path, found in prompt_files(pattern).items():
        if found.checksum is not None:  # GCS: from the listing
            files[path] = found.checksum
            continue
        hit = (cached or {}).get(path)
        same = hit is not None and (hit.get("size"), hit.get("mtime_ns")) == (found.size, found.mtime_ns)
        files[path] = hit["checksum"] if same else storage.checksum(path)
        cache[path] = {"size": found.size, "mtime_ns": found.mtime_ns, "checksum": files[path]}
    return {"pattern": pattern, "files": files}, cache


def _what(checksum: str) -> str:
    size, _, digest = checksum.partition(":")
    return f"{size} bytes, checksum {digest[:16]}"


def changes(recorded: dict, now: dict) -> list[str]:
    """What differs between two input tables, one line per file (pure), in path order."""
    before, after = recorded.get("files", {}), now.get("files", {})
    found = []
    for path in sorted(set(before) | set(after)):
        if path not in after:
            found.append(f"{path}: planned from, but the prompt pattern no longer matches it (deleted or moved)")
        elif path not in before:
            found.append(f"{path}: new: the prompt pattern matches it now, but the run was planned without it")
        elif before[path] != after[path]:
            found.append(f"{path}: its content changed since the run was planned ({_what(before[path])}; now "
                         f"{_what(after[path])})")
    return found


def record(out: str, pattern: str) -> dict:
    """Write ``pattern``'s table as ``out``'s input table (and the local files' checksums to
    its cache); returns it."""
    found, cache = table(pattern)
    if cache:
        storage.write_json(naming.input_cache(out), cache)
    storage.write_json(naming.plan_inputs(out), found)
    return found


def check(out: str, pattern: str, doing: str) -> None:
    """Refuse (PlanError) to go on ``doing`` (e.g. "resume", "collect") the run in ``out``
    when its inputs differ from the table its plan recorded, or when the table is gone."""
    path = naming.plan_inputs(out)
    if not storage.exists(path):
        raise PlanError(f"cannot {doing} {out}: {path} is missing, so whether its input files changed since it was "
                        f"planned cannot be checked. Restore it, or start again with --overwrite (deletes the run's "
                        f"outputs) or another --out")
    cache_path = naming.input_cache(out)
    cached = storage.read_json(cache_path) if storage.exists(cache_path) else None
    now, cache = table(pattern, cached)
    found = changes(storage.read_json(path), now)
    if not found and cache and cache != cached:  # a file touched, or a run planned before the cache
        storage.write_json(cache_path, cache)
    if found:
        shown = "; ".join(found[:SHOWN]) + (f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else "")
        raise PlanError(f"cannot {doing} {out}: its input files changed since it was planned, so its dataset would "
                        f"mix images of two inputs: {shown}. Restore the inputs, or start again with --overwrite "
                        f"(deletes the run's outputs) or another --out")
