"""Key indexes: where an image's key lives, found by reading one small object.

A run has two, of one format. The plan's (``OUT/plan/keys/BBBBB.parquet``) gives each
planned key its slice and position; collect's (``OUT/dataset/index/BBBBB.parquet``) gives
each key of the dataset its part, row group and row in ``dataset/metadata/`` (and its
slice), and is made bucket by bucket from the plan's (``pipeline.collect.parts.place_keys``).
A key's bucket is a hash of the key alone (``bucket_of``), over a number of
buckets fixed by the planned images (``bucket_count``), so a look-up reads one bucket of
about ``KEYS_PER_BUCKET`` keys whatever the size of the run: ``reproduce`` needs no
listing and no scan. Each bucket is a Parquet file sorted by key.

The plan's is built by range of buckets (``pipeline.plan.index``): the steps that place the
keys write them out by bucket, and each bucket is written once, whole (``columns_bytes``).
"""
from __future__ import annotations

import hashlib
import json
import math

from pipeline.io import storage

KEYS_PER_BUCKET = 4096  # a bucket is about this many keys: ~100 KB, one read
PLAN_COLUMNS = ("key", "slice", "position")
DATASET_COLUMNS = ("key", "part", "row_group", "row", "slice")


def bucket_count(images: int) -> int:
    """How many buckets an index of a run of ``images`` planned images has (pure)."""
    return max(1, math.ceil(images / KEYS_PER_BUCKET))


def bucket_of(key: str, buckets: int) -> int:
    """The bucket of ``key`` among ``buckets`` (pure: a hash of the key alone)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % buckets


def split(columns: dict[str, list], buckets: int) -> list[tuple[int, bytes]]:
    """``columns`` (the index's columns, one entry per key: ``key`` and whole numbers) cut
    into one piece per bucket, each packed (``pack``) (pure)."""
    pieces: dict[int, dict[str, list]] = {}
    names = list(columns)
    for i, key in enumerate(columns["key"]):
        piece = pieces.setdefault(bucket_of(key, buckets), {name: [] for name in names})
        for name in names:
            piece[name].append(columns[name][i])
    return [(bucket, pack(piece)) for bucket, piece in sorted(pieces.items())]


def pack(columns: dict[str, list]) -> bytes:
    """Index columns as compact bytes, what a bucket is gathered from: about 20 bytes an entry
    (the keys joined by newlines, each number column as int64), not a Python object each."""
    import numpy as np

    keys = "\n".join(columns["key"]).encode("utf-8")
    numbers = [name for name in columns if name != "key"]
    header = json.dumps({"names": numbers, "count": len(columns["key"]), "keys": len(keys)}).encode() + b"\n"
    return header + keys + b"".join(np.asarray(columns[name], np.int64).tobytes() for name in numbers)


def unpack(data: bytes) -> dict[str, list]:
    """``pack``'s columns back (pure)."""
    import numpy as np

    line, _, rest = data.partition(b"\n")
    header = json.loads(line)
    count, size = header["count"], header["keys"]
    found = {"key": rest[:size].decode("utf-8").split("\n") if count else []}
    for n, name in enumerate(header["names"]):
        found[name] = np.frombuffer(rest, np.int64, count, size + 8 * count * n).tolist()
    return found


def _table(columns: dict[str, list]):
    import pyarrow as pa

    types = {"key": pa.string()}
    table = pa.table({name: pa.array(values, types.get(name, pa.int64())) for name, values in columns.items()})
    return table.sort_by("key")


def bucket_bytes(pieces) -> bytes:
    """One bucket's Parquet bytes from its packed pieces (any order): every entry, sorted by key."""
    pieces = [unpack(piece) for piece in pieces]
    return columns_bytes({name: [v for piece in pieces for v in piece[name]] for name in pieces[0]})


def columns_bytes(columns: dict[str, list]) -> bytes:
    """A bucket's Parquet bytes from its columns: every entry, sorted by key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(_table(columns), sink)
    return sink.getvalue().to_pybytes()


def read_bucket(path: str) -> dict[str, list]:
    """A bucket's columns (none where no key falls in it: the object was never written)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not storage.exists(path):
        return {}
    return pq.ParquetFile(pa.BufferReader(storage.read_bytes(path)), pre_buffer=False).read(
        use_threads=False).to_pydict()


def find(path: str, keys, read=storage.read_bytes) -> dict[str, dict]:
    """{key: its entry} for those of ``keys`` that the bucket object ``path`` holds (none
    when the bucket was never written: no key falls in it); ``read`` reads the object."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if not storage.exists(path):
        return {}
    table = pq.ParquetFile(pa.BufferReader(read(path)), pre_buffer=False).read(use_threads=False)
    found = table.filter(pc.is_in(table.column("key"), pa.array(list(keys), pa.string())))
    return {row["key"]: row for row in found.to_pylist()}
