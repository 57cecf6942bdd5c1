"""What a listing says of objects, local or ``gs://``, without reading them: their sizes,
checksums and modification times.

On GCS each of these is one listing (a request per 1,000 objects) that asks for the
fields it needs and reads no object; locally a ``stat`` of each file. The plan records its
input files' sizes and checksums from here (``listed``), collect checks a slice's objects
(``listed_objects``, ``listed_paths``), and the run's ledgers find the commit markers
written since a time (``modified_times``).
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import os

from pipeline.core.naming import TEMP_PREFIX
from pipeline.io import gcs, listing, storage


@dataclasses.dataclass(frozen=True)
class Listed:
    """What a listing says of one object: its size, its modification time in ns (a local
    file's; None on GCS) and its checksum (``gcs.checksum``; None locally, where it takes
    reading the file)."""
    size: int
    mtime_ns: int | None = None
    checksum: str | None = None


def listed(pattern: str) -> dict[str, Listed]:
    """``storage.glob``'s objects (what a user's pattern names), with what a listing says of
    each: on GCS one listing (nothing is read), locally a stat of each file."""
    if not storage.is_gcs(pattern):
        found = {}
        for path in storage.glob(pattern):
            stat = os.stat(path)
            found[path] = Listed(stat.st_size, stat.st_mtime_ns)
        return found
    bucket, name = gcs.split(pattern)
    if name:
        blob = gcs.client().bucket(bucket).get_blob(name, retry=gcs.retry())
        if blob is not None:
            return {pattern: Listed(blob.size, None, gcs.checksum(blob))}
    match = listing.WILDCARD.search(name)
    literal = f"{gcs.PREFIX}{bucket}/{name[:match.start()] if match else name.rstrip('/') + '/' if name else ''}"
    matches = listing.regex(name[match.start():] if match else "**").match
    return {path: Listed(blob.size, None, gcs.checksum(blob))
            for path, blob in gcs.blobs(literal) if matches(path[len(literal):])}


def modified_times(folder: str, suffix: str = "") -> dict[str, float]:
    """{path: when it was last written, unix seconds} of every object under ``folder`` whose
    name ends with ``suffix``.

    Names and times only, and nothing is read: on GCS one listing (the server's ``updated``
    time, in pages of 1000, asking for those two fields alone); locally the files' mtimes.
    """
    folder = folder.rstrip("/")
    if not storage.is_gcs(folder):
        found = {}
        for root, _, files in os.walk(folder):
            for name in files:
                if name.endswith(suffix):
                    path = os.path.join(root, name)
                    try:
                        found[path] = os.stat(path).st_mtime
                    except FileNotFoundError:  # deleted while listing
                        continue
        return found
    bucket, name = gcs.split(folder + "/")
    # match_glob narrows the listing on GCS itself; a server that ignores it (an emulator)
    # lists the whole folder, filtered here alike
    blobs = gcs.client().list_blobs(bucket, prefix=name, match_glob=f"{name}**{suffix}" if suffix else None,
                                    fields="items(name,updated),nextPageToken", retry=gcs.retry())
    return {f"{gcs.PREFIX}{bucket}/{b.name}": b.updated.timestamp() for b in blobs if b.name.endswith(suffix)
            and not b.name.endswith("/")}


def listed_objects(prefix: str) -> dict[str, dict]:
    """{path: {"size", "md5"}} of every object whose name starts with ``prefix`` (an object,
    a folder, or the start of names: ``shards/3fa1-00042`` lists that slice's shard objects),
    from a listing alone: nothing is read. ``md5`` is the hex digest GCS lists (None for a
    composite object, and always None for a local file, whose checksum only a read gives)."""
    if storage.is_gcs(prefix):
        return {path: {"size": b.size, "md5": base64.b64decode(b.md5_hash).hex() if b.md5_hash else None}
                for path, b in gcs.blobs(prefix, "items(name,size,md5Hash),nextPageToken")}
    found = {}
    if os.path.isdir(prefix):
        for root, _, files in os.walk(prefix):  # links are not followed
            found.update(_stat(os.path.join(root, name)) for name in files if not name.startswith(TEMP_PREFIX))
        return found
    folder, start = os.path.split(prefix)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(folder or "."):
            if entry.name.startswith(start) and not entry.name.startswith(TEMP_PREFIX):
                found.update(listed_objects(entry.path) if entry.is_dir(follow_symlinks=False) else [_stat(entry.path)])
    return found


def listed_paths(paths) -> dict[str, dict]:
    """``listed_objects`` for these exact objects, those of them that exist: on GCS one listing per
    run of names that share a start up to their extension (``shards/3fa1-00042.parquet`` and
    ``.tar`` and ``_stats.json`` in one request); locally a ``stat`` each (a folder is never
    scanned for them)."""
    paths = set(paths)
    if not any(storage.is_gcs(path) for path in paths):
        return dict(_stat(path) for path in sorted(paths) if os.path.isfile(path))
    found = {}
    for start in sorted({path.rsplit(".", 1)[0].removesuffix("_stats") for path in paths}):
        found.update((path, listing) for path, listing in listed_objects(start).items() if path in paths)
    return found


def _stat(path: str) -> tuple[str, dict]:
    return path, {"size": os.stat(path, follow_symlinks=False).st_size, "md5": None}
