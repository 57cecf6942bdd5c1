"""The hosts' storage layer: local folders and ``gs://`` alike, for everything outside Beam.

The host processes, the CLI and the code around the Beam pipelines (run.json, the
manifest, listings, commit markers) read and write through here. Two other clients
touch the same paths, each configured for the same emulator in tests: Beam's
FileSystems inside the plan and collect pipelines (``pipeline.io.beamio``), and
tensorstore's own ``gcs`` kvstore for zarr outputs (``pipeline.output.formats``).

Objects are written whole under their final names (GCS has no atomic rename, so we
never write-then-rename; names and contents are deterministic, so a rewrite after a
crash is harmless). GCS goes through google-cloud-storage with its retry policy on
429/5xx and connection errors; ``STORAGE_EMULATOR_HOST`` points it at an emulator.
"""
from __future__ import annotations

import functools
import glob as _glob
import json
import os
import re
from typing import IO, Iterator

GCS_PREFIX = "gs://"
_WILDCARD = re.compile(r"[*?\[]")


def is_gcs(path: str) -> bool:
    return path.startswith(GCS_PREFIX)


def _split_gcs(path: str) -> tuple[str, str]:
    bucket, _, name = path[len(GCS_PREFIX):].partition("/")
    if not bucket:
        raise ValueError(f"not a gs://bucket/object path: {path!r}")
    return bucket, name


@functools.lru_cache(maxsize=None)
def gcs_client():
    """The process's google-cloud-storage client (anonymous against an emulator)."""
    from google.cloud import storage  # imported here: local runs never need it

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project="promptmill-test", credentials=AnonymousCredentials())
    return storage.Client()


def reset_gcs_client() -> None:
    """Forget the client, so the next one follows a changed ``STORAGE_EMULATOR_HOST``."""
    gcs_client.cache_clear()


def _blob(path: str):
    bucket, name = _split_gcs(path)
    return gcs_client().bucket(bucket).blob(name)


def _retry():
    """Retry 429, 5xx and connection errors with jittered exponential backoff.

    Every object promptmill writes is deterministic, so retrying an upload whose
    outcome is unknown is safe even without generation preconditions.
    """
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_delay(initial=0.2, multiplier=2.0, maximum=20.0).with_deadline(300.0)


def write_bytes(path: str, data: bytes) -> None:
    """Write one whole object under its final name."""
    if is_gcs(path):
        _blob(path).upload_from_string(data, retry=_retry(), timeout=120)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def read_bytes(path: str) -> bytes:
    if is_gcs(path):
        return _blob(path).download_as_bytes(retry=_retry(), timeout=120)
    with open(path, "rb") as f:
        return f.read()


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def write_json(path: str, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str):
    return json.loads(read_text(path))


def open_read(path: str) -> IO[bytes]:
    """A binary stream of the object, read lazily (for large prompt shards)."""
    if is_gcs(path):
        return _blob(path).open("rb", retry=_retry())
    return open(path, "rb")


def exists(path: str) -> bool:
    if is_gcs(path):
        return _blob(path).exists(retry=_retry())
    return os.path.exists(path)


def glob(pattern: str) -> list[str]:
    """Sorted paths of the objects matching ``pattern`` (``*``, ``?``, ``[..]``, ``**``).

    A pattern without wildcards that names a folder lists the files under it.
    """
    if is_gcs(pattern):
        return _gcs_glob(pattern)
    if not _WILDCARD.search(pattern) and os.path.isdir(pattern):
        pattern = os.path.join(pattern, "**", "*")
    return sorted(p for p in _glob.glob(pattern, recursive=True) if os.path.isfile(p))


def glob_regex(pattern: str) -> re.Pattern:
    """A regex with the semantics of Python's recursive glob, for object names.

    ``*`` and ``?`` stay within one path segment, ``[..]`` is a character class, and
    ``**/`` matches zero or more whole segments (``**`` at the end: anything).
    """
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _gcs_glob(pattern: str) -> list[str]:
    bucket, name = _split_gcs(pattern)
    match = _WILDCARD.search(name)
    if not match:  # an object, or a folder: everything under it
        if name and _blob(pattern).exists(retry=_retry()):
            return [pattern]
        name = name.rstrip("/") + "/**"
        match = _WILDCARD.search(name)
    regex = glob_regex(name)
    blobs = gcs_client().list_blobs(bucket, prefix=name[: match.start()], retry=_retry())
    return sorted(f"{GCS_PREFIX}{bucket}/{b.name}" for b in blobs
                  if not b.name.endswith("/") and regex.match(b.name))


def checksums(prefix: str) -> dict[str, str]:
    """{name relative to ``prefix``: size and content checksum} for every object under it.

    On GCS the checksum comes with the listing (md5 or crc32c), so nothing is read.
    """
    prefix = prefix.rstrip("/")
    if is_gcs(prefix):
        bucket, name = _split_gcs(prefix + "/")
        blobs = gcs_client().list_blobs(bucket, prefix=name, retry=_retry())
        return {b.name[len(name):]: f"{b.size}:{b.md5_hash or b.crc32c}" for b in blobs if not b.name.endswith("/")}
    import hashlib

    sums = {}
    for path in glob(prefix):
        with open(path, "rb") as f:
            sums[os.path.relpath(path, prefix).replace(os.sep, "/")] = f"{os.path.getsize(path)}:" \
                f"{hashlib.sha256(f.read()).hexdigest()}"
    return sums


def checksum(path: str) -> str:
    """Size and content checksum of one object (on GCS from its metadata: nothing is read)."""
    if is_gcs(path):
        from google.api_core.exceptions import NotFound

        blob = _blob(path)
        try:
            blob.reload(retry=_retry())
        except NotFound:
            raise FileNotFoundError(path) from None
        return f"{blob.size}:{blob.md5_hash or blob.crc32c}"
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"{os.path.getsize(path)}:{digest.hexdigest()}"


def delete_prefix(prefix: str) -> int:
    """Delete the object ``prefix`` and every object under ``prefix/``; returns how many.

    Deletes run in parallel; a missing object counts as deleted (a retried delete may
    find it gone).
    """
    prefix = prefix.rstrip("/")
    if not is_gcs(prefix):
        import shutil

        if os.path.isdir(prefix):
            count = sum(len(files) for _, _, files in os.walk(prefix))
            shutil.rmtree(prefix)
            return count
        if os.path.exists(prefix):
            os.remove(prefix)
            return 1
        return 0
    from concurrent.futures import ThreadPoolExecutor

    from google.api_core.exceptions import NotFound

    bucket, name = _split_gcs(prefix)
    blobs = [b for b in gcs_client().list_blobs(bucket, prefix=name, retry=_retry())
             if b.name == name or b.name.startswith(name + "/")]

    def delete(blob):
        try:
            blob.delete(retry=_retry(), timeout=60)
        except NotFound:
            pass

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(delete, blobs))
    return len(blobs)


def download(path: str, local_path: str) -> None:
    """Copy one object to a local file, streamed."""
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    if is_gcs(path):
        _blob(path).download_to_filename(local_path, retry=_retry(), timeout=600)
        return
    import shutil

    shutil.copyfile(path, local_path)


def iter_lines(path: str) -> Iterator[bytes]:
    """The lines of an object as raw bytes, without their line endings, streamed."""
    with open_read(path) as f:
        for raw in f:
            yield raw.rstrip(b"\r\n")
