"""The hosts' storage layer: local folders and ``gs://`` alike, for everything outside Beam.

The host processes, the CLI and the code around the Beam pipelines (run.json, the
manifest, listings, commit markers) read and write through here. Two other clients
touch the same paths, each configured for the same emulator in tests: Beam's
FileSystems inside the plan and collect pipelines (``pipeline.io.beamio``), and
tensorstore's own ``gcs`` kvstore for zarr outputs (``pipeline.output.formats``).

Objects are written whole under their final names (GCS has no atomic rename, so we
never write-then-rename there: an upload is committed whole or not at all; a local file
is written under a temporary name beside it and renamed, so no truncated file ever has
a final name; names and contents are deterministic, so a rewrite after a crash is
harmless). GCS goes through google-cloud-storage with its retry policy on
429/5xx and connection errors (``pipeline.io.gcs``); what a listing says of objects
without reading them (sizes, checksums, times) is ``pipeline.io.inventory``'s.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
from typing import IO, Iterator

from pipeline.core import logs
from pipeline.core.naming import TEMP_PREFIX
from pipeline.io import gcs, listing

# Large objects download in ranges of CHUNK_SIZE on CHUNK_WORKERS threads. 32 MiB is
# transfer_manager's own default: each range pays its request's latency once, and a
# 3.4 GB UNet still spreads over every worker. Threads, not processes: the work is
# network and crc32c (C, outside the GIL), and a host process must not fork.
CHUNK_SIZE = 32 << 20
CHUNK_WORKERS = 8
_UMASK = os.umask(0o022)  # read once, at import (the only way to read it), and put back
os.umask(_UMASK)


def is_gcs(path: str) -> bool:
    return path.startswith(gcs.PREFIX)


def write_bytes(path: str, data: bytes) -> None:
    """Write one whole object under its final name: a GCS object is uploaded whole; a
    local file is written under a temporary name beside it and renamed, so a full disk
    or a kill never leaves a truncated file under the final name."""
    if is_gcs(path):
        gcs.blob(path).upload_from_string(data, retry=gcs.retry(), timeout=120)
        return
    with local_writer(path) as f:
        f.write(data)


@contextlib.contextmanager
def local_writer(path: str):
    """A binary file that appears at ``path`` only once closed whole (written under a
    ``naming.TEMP_PREFIX`` name in the same folder, then renamed); removed on error."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(scratch, 0o666 & ~_UMASK)  # as open() would have made it
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(scratch)
        raise


def remove_temporaries(folder: str) -> int:
    """Remove what a writer killed midway left in a local ``folder`` (``TEMP_PREFIX`` files,
    never renamed into place; GCS has none); returns how many. Only for a folder no other
    process writes now (the command holds the run's lease)."""
    if is_gcs(folder) or not os.path.isdir(folder):
        return 0
    stale = [entry.path for entry in os.scandir(folder)
             if entry.name.startswith(TEMP_PREFIX) and entry.is_file(follow_symlinks=False)]
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return len(stale)


def delete(paths: list[str]) -> int:
    """Delete these objects (local or gs://, in parallel); returns how many. A missing
    one counts as deleted (a retried delete may find it gone)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(path):
        if is_gcs(path):
            from google.api_core.exceptions import NotFound

            with contextlib.suppress(NotFound):
                gcs.blob(path).delete(retry=gcs.retry(), timeout=60)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, paths))
    return len(paths)


def read_bytes(path: str) -> bytes:
    if is_gcs(path):
        return gcs.blob(path).download_as_bytes(retry=gcs.retry(), timeout=120)
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


def read_range(path: str, start: int, size: int) -> bytes:
    """``size`` bytes of an object from byte ``start`` (one ranged request on GCS)."""
    if is_gcs(path):
        return gcs.blob(path).download_as_bytes(start=start, end=start + size - 1, retry=gcs.retry())
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(size)


def open_read(path: str) -> IO[bytes]:
    """A binary stream of the object, read lazily (for large prompt shards)."""
    if is_gcs(path):
        return gcs.blob(path).open("rb", retry=gcs.retry())
    return open(path, "rb")


def exists(path: str) -> bool:
    if is_gcs(path):
        return gcs.blob(path).exists(retry=gcs.retry())
    return os.path.exists(path)


class Conflict(RuntimeError):
    """A conditional write found the object changed since it was read."""


def read_versioned(path: str) -> tuple[bytes | None, object]:
    """An object's bytes (None: it does not exist) and its version, for ``write_if``: on GCS
    its generation, locally its (inode, mtime_ns)."""
    if is_gcs(path):
        from google.api_core.exceptions import NotFound

        blob = gcs.blob(path)
        try:
            data = blob.download_as_bytes(retry=gcs.retry(), timeout=60)
        except NotFound:
            return None, 0
        return data, blob.generation
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            return f.read(), (info.st_ino, info.st_mtime_ns)
    except FileNotFoundError:
        return None, 0


def write_if(path: str, data: bytes, version) -> None:
    """Write ``path`` whole only if it is still at ``version`` (``read_versioned``; 0: only if
    it does not exist), else ``Conflict``. On GCS the generation precondition makes it
    atomic; locally a new file is linked into place (which fails if one is there) and a
    replaced one is checked just before the rename, which leaves a window of a few
    microseconds that only a lock would close."""
    if is_gcs(path):
        from google.api_core.exceptions import PreconditionFailed

        try:
            gcs.blob(path).upload_from_string(data, if_generation_match=version, retry=gcs.retry(), timeout=60)
        except PreconditionFailed:
            raise Conflict(path) from None
        return
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(scratch, 0o666 & ~_UMASK)
        if version == 0:
            try:
                os.link(scratch, path)
            except FileExistsError:
                raise Conflict(path) from None
        else:
            _, now = read_versioned(path)
            if now != version:
                raise Conflict(path)
            os.replace(scratch, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(scratch)


def glob(pattern: str) -> list[str]:
    """Sorted paths of the files a user's pattern names (``*``, ``?``, ``[..]``, ``**``):
    the object or the files under the folder it names as it stands, else those that
    match (``pipeline.io.listing``). Only for a user's ``--prompts``: a folder promptmill
    names is listed with ``files``, where its name is never a pattern."""
    if not is_gcs(pattern):
        return listing.glob(pattern)
    bucket, name = gcs.split(pattern)
    if name and exists(pattern):
        return [pattern]
    match = listing.WILDCARD.search(name)
    if not match:  # a folder: everything under it
        return sorted(files(pattern))
    literal = f"{gcs.PREFIX}{bucket}/{name[:match.start()]}"
    matches = listing.regex(name[match.start():]).match
    return sorted(path for path in gcs.names(literal) if matches(path[len(literal):]))


def files(folder: str, pattern: str = "**") -> Iterator[str]:
    """Paths of the objects under ``folder``, a literal path (``runs/o[7]`` is that folder),
    whose name relative to it matches ``pattern``, streamed in no set order (GCS in pages
    of 1000; locally regular files only, no symbolic link followed)."""
    if not is_gcs(folder):
        return listing.files(folder, pattern)
    prefix = folder.rstrip("/") + "/"
    matches = listing.regex(pattern).match
    return (path for path in gcs.names(prefix) if matches(path[len(prefix):]))


def entries(folder: str) -> Iterator[tuple[str, str]]:
    """``(path, kind)`` of everything under ``folder`` (a literal path), streamed: kind
    "file", or locally "link" (never followed) or "other" (``listing.entries``)."""
    if not is_gcs(folder):
        return listing.entries(folder)
    return ((path, "file") for path in gcs.names(folder.rstrip("/") + "/"))


def checksum(path: str) -> str:
    """Size and content checksum of one object: on GCS from its metadata (md5, or crc32c for
    a composite object; nothing is read), locally the sha256 of its bytes."""
    if is_gcs(path):
        bucket, name = gcs.split(path)
        found = gcs.client().bucket(bucket).get_blob(name, retry=gcs.retry()) if name else None
        if found is None:
            raise FileNotFoundError(path)
        return gcs.checksum(found)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"{os.path.getsize(path)}:{digest.hexdigest()}"


def download(path: str, local_path: str) -> None:
    """Copy one object to a local file, streamed."""
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    if is_gcs(path):
        gcs.blob(path).download_to_filename(local_path, retry=gcs.retry(), timeout=600)
        return
    import shutil

    shutil.copyfile(path, local_path)


def iter_lines(path: str) -> Iterator[bytes]:
    """The lines of an object as raw bytes, without their line endings, streamed."""
    with open_read(path) as f:
        for raw in f:
            yield raw.rstrip(b"\r\n")


class ChecksumError(OSError):
    """A downloaded object whose bytes differ from the size or checksum it was listed
    with; the message names the object."""


def object_checksums(prefix: str) -> dict[str, dict]:
    """{name relative to ``prefix``: {"size", "md5", "crc32c"}} of every object under it.

    On GCS these come with the listing, base64 as GCS gives them, and nothing is read;
    either checksum may be None (a composite object has no md5). For a local folder
    they are computed from the files' bytes, in the same encoding.
    """
    prefix = prefix.rstrip("/")
    if is_gcs(prefix):
        return {path[len(prefix) + 1:]: {"size": b.size, "md5": b.md5_hash, "crc32c": b.crc32c}
                for path, b in gcs.blobs(prefix + "/")}
    found = {}
    for path in sorted(files(prefix)):
        hashes = _Hashing(None, md5=True, crc32c=True)
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                hashes.write(block)
        found[os.path.relpath(path, prefix).replace(os.sep, "/")] = hashes.listed()
    return found


class _Hashing:
    """A write-only stream that keeps the size, md5 and/or crc32c of what passes through
    it to ``sink`` (None: nowhere)."""

    def __init__(self, sink, md5: bool, crc32c: bool):
        import google_crc32c

        self.sink, self.size = sink, 0
        self.md5 = hashlib.md5() if md5 else None
        self.crc32c = google_crc32c.Checksum() if crc32c else None

    def write(self, data: bytes) -> int:
        self.size += len(data)
        for digest in (self.md5, self.crc32c):
            if digest is not None:
                digest.update(data)
        return self.sink.write(data) if self.sink is not None else len(data)

    def listed(self) -> dict:
        """{"size", "md5", "crc32c"} as GCS lists them (None for a checksum not kept)."""
        encode = lambda digest: base64.b64encode(digest.digest()).decode() if digest is not None else None  # noqa: E731
        return {"size": self.size, "md5": encode(self.md5), "crc32c": encode(self.crc32c)}


def _mismatch(path: str, expected: dict, found: dict) -> str | None:
    """What differs between an object's listed size and checksums and its downloaded ones
    (only those both sides have), or None."""
    differ = [key for key in ("size", "md5", "crc32c")
              if expected.get(key) is not None and found.get(key) is not None and expected[key] != found[key]]
    if not differ:
        return None
    return f"{path}: downloaded {', '.join(f'{k} {found[k]}' for k in differ)}, but it was listed with " \
           f"{', '.join(f'{k} {expected[k]}' for k in differ)}"


def download_verified(path: str, local_path: str, expected: dict, chunk_size: int | None = None,
                      workers: int | None = None) -> None:
    """Copy one object to a local file and check it against ``expected``, its
    {"size", "md5", "crc32c"} as ``object_checksums`` listed them.

    A GCS object larger than ``chunk_size`` with a listed crc32c downloads in ranges of
    ``chunk_size`` on ``workers`` threads (google-cloud-storage's
    ``transfer_manager.download_chunks_concurrently``), which combines the ranges'
    crc32c into the whole object's as they arrive (defaults: ``CHUNK_SIZE``,
    ``CHUNK_WORKERS``). Only crc32c combines that way, so a
    large object listed without one downloads whole, and says so in the log
    (``download_whole``). A whole download is hashed as it streams to disk; either way
    no byte is read twice. The object is pinned to the listed checksums: one that has
    changed since, or bytes that differ from them, raise ``ChecksumError`` naming it,
    and leave no file behind.
    """
    chunk_size, workers = chunk_size or CHUNK_SIZE, workers or CHUNK_WORKERS
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    try:
        if not is_gcs(path):
            with open(path, "rb") as source, open(local_path, "wb") as target:
                hashes = _Hashing(target, md5=expected.get("md5") is not None,
                                  crc32c=expected.get("crc32c") is not None)
                for block in iter(lambda: source.read(1 << 20), b""):
                    hashes.write(block)
            found = hashes.listed()
        elif expected["size"] > chunk_size and expected.get("crc32c"):
            found = _download_chunked(path, local_path, expected, chunk_size, workers)
        else:
            if expected["size"] > chunk_size:
                logs.event("download_whole", path=path, size=expected["size"],
                           reason="no crc32c listed: only crc32c combines over ranges, so it is read whole "
                                  "and checked by md5")
            found = _download_whole(path, local_path, expected)
        problem = _mismatch(path, expected, found)
        if problem:
            raise ChecksumError(problem)
    except BaseException:
        if os.path.exists(local_path):
            os.remove(local_path)
        raise


def _data_corruption():
    try:
        from google.cloud.storage.exceptions import DataCorruption
    except ImportError:  # google-cloud-storage 2.x keeps it in google-resumable-media
        from google.resumable_media.common import DataCorruption
    return DataCorruption


def _download_chunked(path: str, local_path: str, expected: dict, chunk_size: int, workers: int) -> dict:
    from google.api_core.exceptions import NotFound
    from google.cloud.storage import transfer_manager

    blob = gcs.blob(path)
    try:
        blob.reload(retry=gcs.retry())  # its generation pins the ranges to one version of the object
    except NotFound:
        raise FileNotFoundError(path) from None
    now = {"size": blob.size, "md5": blob.md5_hash, "crc32c": blob.crc32c}
    changed = _mismatch(path, expected, now)
    if changed:
        raise ChecksumError(changed.replace("downloaded", "now has", 1))
    try:
        # checks the crc32c combined from the ranges against the blob's, which is the listed one
        transfer_manager.download_chunks_concurrently(
            blob, local_path, chunk_size=chunk_size, download_kwargs={"retry": gcs.retry(), "timeout": 600},
            worker_type=transfer_manager.THREAD, max_workers=workers, crc32c_checksum=True)
    except _data_corruption() as e:
        raise ChecksumError(f"{path}: the downloaded ranges' crc32c differs from the listed {expected['crc32c']} "
                            f"({e})") from None
    return {"size": os.path.getsize(local_path)}


def _download_whole(path: str, local_path: str, expected: dict) -> dict:
    from google.api_core.exceptions import NotFound

    with open(local_path, "wb") as f:
        # one checksum is enough: crc32c when listed (cheaper), else md5
        hashes = _Hashing(f, md5=not expected.get("crc32c") and expected.get("md5") is not None,
                          crc32c=bool(expected.get("crc32c")))
        try:
            gcs.blob(path).download_to_file(hashes, retry=gcs.retry(), timeout=600)
        except NotFound:
            raise FileNotFoundError(path) from None
        except _data_corruption() as e:  # the client's own check against the server's x-goog-hash
            raise ChecksumError(f"{path}: {e}") from None
    return hashes.listed()
