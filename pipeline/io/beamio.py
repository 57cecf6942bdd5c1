"""Beam-side I/O: inside Beam pipelines, every read and write goes through Beam's FileSystems.

promptmill has one storage layer per runtime:

* inside Beam pipelines (``plan``, ``collect``): this module, on top of
  ``apache_beam.io.filesystems.FileSystems``, so Dataflow workers read and write with
  Beam's own GCS client, its retries and its throttling counters, local or ``gs://``;
* outside Beam (host processes, the CLI, code before and after a pipeline):
  ``pipeline.io.storage``.

Both give the same objects: whole objects under their final names (GCS commits an
upload on close, and an exception inside the ``with`` cancels it; a local file is
written under a temporary name and renamed), the same names and the same bytes. Writes are always UNCOMPRESSED, so a
name ending in ``.gz`` is never gzipped behind our back. Pattern expansion stays with
``storage.glob``: Beam's match differs (a folder matches itself, not the files under
it; ``**/`` needs at least one folder; ``*`` matches dotfiles locally), so pipelines
expand patterns into file lists with ``storage.glob`` and read each file here.

``STORAGE_EMULATOR_HOST`` points Beam's GCS client at an emulator, as it does
``pipeline.io.storage``'s (see ``use_emulator_credentials``).
"""
from __future__ import annotations

import functools
import io
import json
import os
import zlib
from typing import Iterator

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

# Bytes read per call when splitting a stream into lines.
READ_CHUNK = 1 << 20
READERS = 16  # ranged reads at once on GCS (``read_pieces``)


def use_emulator_credentials() -> None:
    """With ``STORAGE_EMULATOR_HOST`` set, make Beam's GCS client anonymous.

    Why: Beam looks up Application Default Credentials before its first GCS call,
    ``google.auth.default`` with 4 retries and backoff (about 25 s per process when
    there are none), and with real credentials it refreshes a token against
    oauth2.googleapis.com (a 120 s hang offline). The emulator needs neither. Marking
    Beam's credential cache as initialised with no credentials makes gcsio use
    ``storage.Client.create_anonymous_client()``, which honours
    ``STORAGE_EMULATOR_HOST`` by itself. This uses Beam's private
    ``apache_beam.internal.gcp.auth._Credentials``; it is only done with an emulator.

    Idempotent and cheap: every function here calls it before touching FileSystems,
    and DoFns call it in ``setup()``, so it holds in whatever process runs them.
    """
    if not os.environ.get("STORAGE_EMULATOR_HOST"):
        return
    from apache_beam.internal.gcp import auth

    auth._Credentials._credentials = None
    auth._Credentials._credentials_init = True


def require_filesystem(*paths: str) -> None:
    """Fail early, and clearly, when a ``gs://`` path needs Beam's GCS support and it is
    not installed (the ``gcp`` extra: local runs do without it)."""
    if not any(p.startswith("gs://") for p in paths):
        return
    try:
        import apache_beam.io.gcp.gcsfilesystem  # noqa: F401
        import google.cloud.storage  # noqa: F401
    except ImportError as e:
        raise RuntimeError("gs:// paths need Beam's GCS support: pip install 'promptmill[gcp]' "
                           f"(apache-beam[gcp]) ({e})") from None


def _filesystems():
    use_emulator_credentials()
    return FileSystems


use_emulator_credentials()  # in every process that imports this, Beam workers included


class TruncatedInput(OSError):
    """A compressed object that ends before its compressed stream does (a cut or partial
    upload): its rows so far are not the file's rows, so nothing may be planned from it."""


class _StrictGzip(io.RawIOBase):
    """The decompressed bytes of a gzip stream (one member or several, as ``cat a.gz b.gz``
    makes) that raises ``TruncatedInput`` where the stream ends inside a member, even at a
    flush point, and ``OSError`` on bytes after a member that are not another member.
    Beam's own gzip reader returns what it has at such an end, silently."""

    def __init__(self, raw, path: str):
        super().__init__()
        self._raw, self._path = raw, path
        self._z = zlib.decompressobj(zlib.MAX_WBITS | 16)
        self._pending = b""  # compressed bytes not yet given to the decompressor
        self._member_open = False  # bytes of the current member were read, its end not yet
        self._eof = False
        self._rest = b""  # decompressed bytes not yet read

    def readable(self) -> bool:
        return True

    def _next_block(self) -> bytes:
        """Up to READ_CHUNK decompressed bytes; b"" at the end of the whole stream."""
        while True:
            if not self._pending:
                if self._eof:
                    return b""
                self._pending = self._raw.read(READ_CHUNK)
                if not self._pending:
                    self._eof = True
                    if self._member_open:
                        raise TruncatedInput(f"{self._path}: the gzip stream ends early (the file was cut off "
                                             f"or is still being written)")
                    return b""
            if self._z.eof:  # the bytes after a member: another member, or garbage
                if not self._pending.startswith(b"\x1f\x8b"[:len(self._pending)]):
                    raise OSError(f"{self._path}: bytes after the end of the gzip stream that are not gzip")
                self._z = zlib.decompressobj(zlib.MAX_WBITS | 16)
            self._member_open = True
            try:
                block = self._z.decompress(self._pending, READ_CHUNK)
            except zlib.error as e:
                raise OSError(f"{self._path}: not a valid gzip stream ({e})") from None
            self._pending = self._z.unconsumed_tail or self._z.unused_data
            if self._z.eof:
                self._member_open = False
            if block:
                return block

    def readinto(self, buffer) -> int:
        if not self._rest:
            self._rest = self._next_block()
        n = min(len(buffer), len(self._rest))
        buffer[:n] = self._rest[:n]
        self._rest = self._rest[n:]
        return n

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


def open_read(path: str, compression_type: str = CompressionTypes.UNCOMPRESSED):
    """A binary stream of the object; ``CompressionTypes.AUTO`` decompresses by name. A
    ``.gz`` object is read strictly (``_StrictGzip``): one that ends early raises
    ``TruncatedInput`` rather than looking like a shorter file."""
    if compression_type == CompressionTypes.AUTO and path.lower().endswith(".gz"):
        raw = _filesystems().open(path, compression_type=CompressionTypes.UNCOMPRESSED)
        return _StrictGzip(raw, path)  # unbuffered: the rows before a cut are read before it raises
    return _filesystems().open(path, compression_type=compression_type)


def read_bytes(path: str) -> bytes:
    with open_read(path) as f:
        return f.read()


def read_range(path: str, start: int, length: int) -> bytes:
    """``length`` bytes of the object from byte ``start``, in one ranged request on GCS.

    Why not ``open_read`` and seek: Beam's GCS reader fetches ahead in 16 MiB chunks, so
    a few hundred bytes from each of many objects would download megabytes from each.
    On GCS this asks Beam's own client (``gcsio``, with its credentials) for the range
    alone, with google-cloud-storage's default retry of 429, 5xx and connection errors."""
    if length <= 0:
        return b""
    if not path.startswith("gs://"):
        with _filesystems().open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            f.seek(start)
            return f.read(length)
    from apache_beam.io.gcp.gcsio import parse_gcs_path
    from google.cloud.storage.retry import DEFAULT_RETRY

    bucket, name = parse_gcs_path(path)
    data = _gcsio().client.bucket(bucket).blob(name).download_as_bytes(start=start, end=start + length - 1,
                                                                       retry=DEFAULT_RETRY)
    if len(data) != length:
        raise OSError(f"{path}: asked for bytes {start}..{start + length - 1}, got {len(data)} bytes")
    return data


def read_pieces(pieces: list[tuple[str, int, int]]) -> list[bytes]:
    """The bytes of each piece, (path, first byte, length), in order (``read_range``).

    On GCS ``READERS`` at a time, which the requests' latency needs. Local files one after
    the other: each thread allocates in its own malloc arena, which keeps the memory once
    freed (a 10M-prompt plan with --dedupe peaked 240 MiB higher with 16 reader threads)."""
    remote = any(path.startswith("gs://") for path, _, _ in pieces)
    return list((_readers().map if remote else map)(lambda piece: read_range(*piece), pieces))


def write_pieces(path: str, blocks: list[bytes]) -> list[tuple[str, int, int]]:
    """Write ``blocks`` one after the other as the object ``path``; returns each block's
    piece, (path, first byte, length), for ``read_pieces``."""
    pieces, at = [], 0
    for block in blocks:
        pieces.append((path, at, len(block)))
        at += len(block)
    write_bytes(path, b"".join(blocks))
    return pieces


@functools.lru_cache(maxsize=None)
def _readers():
    """The process's threads for ``read_pieces`` on GCS (made on first use)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(READERS, thread_name_prefix="pieces")


@functools.lru_cache(maxsize=None)
def _gcsio():
    """The process's Beam GCS client (one per process, as Beam's filesystem keeps one)."""
    from apache_beam.io.gcp import gcsio

    use_emulator_credentials()
    return gcsio.GcsIO()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def read_json(path: str):
    return json.loads(read_text(path))


def split_lines(stream, keep_ends: bool = False) -> Iterator[bytes]:
    """The lines of a binary stream as raw bytes, without their line endings.

    Lines end at ``\n``; trailing ``\r``s are dropped (as ``storage.iter_lines``
    does). Blank lines are kept; a last line without a newline is a line. Reads in
    chunks, so it works on every FileSystems stream (gzip ones are not iterable).
    ``keep_ends``: yield each line as read, ending included (the csv module needs them).
    """
    pending: list[bytes] = []
    while True:
        block = stream.read(READ_CHUNK)
        if not block:
            break
        *complete, tail = block.split(b"\n")
        if complete:
            complete[0] = b"".join(pending) + complete[0]
            pending = []
            for line in complete:
                yield line + b"\n" if keep_ends else line.rstrip(b"\r\n")
        pending.append(tail)
    last = b"".join(pending)
    if last:
        yield last if keep_ends else last.rstrip(b"\r\n")


def iter_lines(path: str, compression_type: str = CompressionTypes.AUTO) -> Iterator[bytes]:
    """The lines of an object as raw bytes (``split_lines``), streamed.

    AUTO: a name ending in ``.gz`` (or another compression suffix Beam knows) is
    decompressed first.
    """
    with open_read(path, compression_type) as f:
        yield from split_lines(f)


def open_write(path: str, mime_type: str = "application/octet-stream"):
    """A binary stream that becomes one whole object under its final name when closed.

    For objects too big to build in memory first; parent folders are created. A local
    file is written under a temporary name and renamed once closed
    (``storage.local_writer``), so a full disk never leaves a truncated file under its
    final name; an exception inside the ``with`` leaves nothing.
    """
    if "://" not in path:
        from pipeline.io import storage

        return storage.local_writer(path)
    return _filesystems().create(path, mime_type=mime_type, compression_type=CompressionTypes.UNCOMPRESSED)


def write_bytes(path: str, data: bytes, mime_type: str = "application/octet-stream") -> None:
    """Write one whole object under its final name (parent folders are created)."""
    with open_write(path, mime_type) as f:
        f.write(data)


def delete(paths: list[str]) -> None:
    """Delete these objects (local files or gs:// objects), each by its name as it stands:
    FileSystems.delete would read a name as a pattern (an OUT called ``runs/o[7]``)."""
    local = [path for path in paths if not path.startswith("gs://")]
    for path in local:
        os.remove(path)
    if len(local) < len(paths):
        from apache_beam.io.gcp import gcsio

        use_emulator_credentials()
        failed = [(path, error) for path, error in gcsio.GcsIO().delete_batch([p for p in paths if p not in local])
                  if error]
        if failed:
            raise OSError(f"cannot delete {failed[0][0]}: {failed[0][1]}" +
                          (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))


def write_text(path: str, text: str, mime_type: str = "text/plain") -> None:
    write_bytes(path, text.encode("utf-8"), mime_type)


def write_json(path: str, obj) -> None:
    """The same bytes as ``storage.write_json``."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "application/json")
