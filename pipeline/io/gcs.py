"""Google Cloud Storage as every ``gs://`` call of ours reaches it: the client, the retry policy,
paths split into bucket and name, and listings page by page.

The storage layer (``pipeline.io.storage``) and the listings with metadata
(``pipeline.io.inventory``) go through here; nothing else makes a client.
``STORAGE_EMULATOR_HOST`` points the client at an emulator (anonymous, as the tests and
the benches run it).
"""
from __future__ import annotations

import functools
import os
from typing import Iterator

PREFIX = "gs://"
# what a listing asks for, unless told otherwise: enough for sizes and checksums
LISTED_FIELDS = "items(name,size,md5Hash,crc32c),nextPageToken"


def split(path: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ("bucket", "a/b"); a ValueError for a path without a bucket."""
    bucket, _, name = path[len(PREFIX):].partition("/")
    if not bucket:
        raise ValueError(f"not a gs://bucket/object path: {path!r}")
    return bucket, name


@functools.lru_cache(maxsize=None)
def client():
    """The process's google-cloud-storage client (anonymous against an emulator)."""
    from google.cloud import storage  # imported here: local runs never need it

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project="promptmill-test", credentials=AnonymousCredentials())
    return storage.Client()


def reset_client() -> None:
    """Forget the client, so the next one follows a changed ``STORAGE_EMULATOR_HOST``."""
    client.cache_clear()


def blob(path: str):
    """The client's handle on one object (nothing is requested)."""
    bucket, name = split(path)
    return client().bucket(bucket).blob(name)


def retry():
    """Retry 429, 5xx and connection errors with jittered exponential backoff.

    Every object promptmill writes is deterministic, so retrying an upload whose
    outcome is unknown is safe even without generation preconditions.
    """
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_delay(initial=0.2, multiplier=2.0, maximum=20.0).with_deadline(300.0)


def blobs(prefix: str, fields: str = LISTED_FIELDS) -> Iterator[tuple]:
    """(path, blob with the listed ``fields``) of every object whose name starts with
    ``prefix`` (a gs:// path), listed page by page; folder placeholders (names ending in
    ``/``) left out."""
    bucket, name = split(prefix)
    for found in client().list_blobs(bucket, prefix=name, fields=fields, retry=retry()):
        if not found.name.endswith("/"):
            yield f"{PREFIX}{bucket}/{found.name}", found


def names(prefix: str) -> Iterator[str]:
    """Every object whose name starts with ``prefix`` (a gs:// path), listed page by page."""
    return (path for path, _ in blobs(prefix, "items(name),nextPageToken"))


def checksum(listed) -> str:
    """``SIZE:HASH`` of a listed blob: GCS's md5, or its crc32c for a composite object
    (which has no md5); nothing is read."""
    return f"{listed.size}:{listed.md5_hash or listed.crc32c}"
