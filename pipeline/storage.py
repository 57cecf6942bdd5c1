"""The storage layer: every path, local or ``gs://``, goes through here.

Objects are written whole under their final names (GCS has no atomic rename, so we
never write-then-rename; names and contents are deterministic, so a rewrite after a
crash is harmless). GCS goes through google-cloud-storage with its retry policy on
429/5xx and connection errors; ``STORAGE_EMULATOR_HOST`` points it at an emulator.
"""
from __future__ import annotations

import fnmatch
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
def _gcs_client():
    from google.cloud import storage  # imported here: local runs never need it

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project="promptmill-test", credentials=AnonymousCredentials())
    return storage.Client()


def _blob(path: str):
    bucket, name = _split_gcs(path)
    return _gcs_client().bucket(bucket).blob(name)


def _retry():
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_deadline(300.0)


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


def _gcs_glob(pattern: str) -> list[str]:
    bucket, name = _split_gcs(pattern)
    match = _WILDCARD.search(name)
    prefix = name[: match.start()] if match else name
    if not match and not name.endswith("/"):
        exact = [f"{GCS_PREFIX}{bucket}/{name}"] if _blob(pattern).exists(retry=_retry()) else []
        if exact:
            return exact
        prefix, name = name + "/", name + "/**"
    blobs = _gcs_client().list_blobs(bucket, prefix=prefix, retry=_retry())
    names = (b.name for b in blobs if not b.name.endswith("/"))
    if match or name.endswith("**"):
        regex = re.compile(fnmatch.translate(name).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*"))
        names = (n for n in names if regex.match(n))
    return sorted(f"{GCS_PREFIX}{bucket}/{n}" for n in names)


def checksums(prefix: str) -> dict[str, str]:
    """{name relative to ``prefix``: size and content checksum} for every object under it.

    On GCS the checksum comes with the listing (md5 or crc32c), so nothing is read.
    """
    prefix = prefix.rstrip("/")
    if is_gcs(prefix):
        bucket, name = _split_gcs(prefix + "/")
        blobs = _gcs_client().list_blobs(bucket, prefix=name, retry=_retry())
        return {b.name[len(name):]: f"{b.size}:{b.md5_hash or b.crc32c}" for b in blobs if not b.name.endswith("/")}
    import hashlib

    sums = {}
    for path in glob(prefix):
        with open(path, "rb") as f:
            sums[os.path.relpath(path, prefix).replace(os.sep, "/")] = f"{os.path.getsize(path)}:" \
                f"{hashlib.sha256(f.read()).hexdigest()}"
    return sums


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
