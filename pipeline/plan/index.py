"""The plan's key index: each planned key's slice and position, bucketed by a hash of the
key (``pipeline.output.key_index``), so that ``reproduce KEY`` finds a key's slice by
reading one bucket, before collect as after it.

No step holds the keys of the whole run, and no key crosses the runner (a runner may hold
a step's whole output: Beam's DirectRunner holds it in its one process):

  KeySection  in each file's placing step, the keys it places with their buckets, written
              every ``CHUNK`` keys into the file's object (``naming.plan_section`` "keys"),
              sorted by bucket, a block per range of ``BUCKETS_PER_RANGE`` buckets; out
              goes (range, piece) per block, a piece being (path, first byte, length)
  PlanKeys    the pieces grouped by range -> each range's blocks read, and each of its
              buckets written whole (``key_index.columns_bytes``, which sorts by key)

A bucket's bytes depend only on the keys in it, so they are the same whichever step
places which key.
"""
from __future__ import annotations

import array
import json

import apache_beam as beam
import numpy as np

from pipeline.core import naming
from pipeline.io import beamio
from pipeline.output import key_index

# A range's step holds its keys as bytes and three int64 each: ~262k keys (4,096 a bucket),
# about 20 MB; the pieces that cross the runner are a few per file and range.
BUCKETS_PER_RANGE = 64
CHUNK = 1 << 17  # keys a placing step holds before it writes them out: about 10 MB


def pack_block(keys: list[bytes], numbers: np.ndarray) -> bytes:
    """Keys and their (bucket, slice, position) rows as one block: a line of JSON (the count
    and the keys' bytes), the keys joined by newlines (a key holds none: ``naming``), the
    numbers as int64."""
    joined = b"\n".join(keys)
    header = json.dumps({"count": len(keys), "keys": len(joined)}).encode() + b"\n"
    return header + joined + np.ascontiguousarray(numbers, "<i8").tobytes()


def unpack_block(data: bytes) -> tuple[list[bytes], np.ndarray]:
    """``pack_block``'s keys and (count, 3) numbers back."""
    line, _, rest = data.partition(b"\n")
    header = json.loads(line)
    count, size = header["count"], header["keys"]
    keys = rest[:size].split(b"\n") if count else []
    return keys, np.frombuffer(rest, "<i8", 3 * count, size).reshape(count, 3)


def by_value(values: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(value, the indices that have it, in order) of each distinct value, lowest first (pure)."""
    order = np.argsort(values, kind="stable")
    cuts = np.flatnonzero(np.diff(values[order])) + 1
    return [(int(values[chosen[0]]), chosen) for chosen in np.split(order, cuts) if len(chosen)]


class KeySection:
    """The keys one placing step places (``add``), written out to ``path`` every ``CHUNK``
    and at ``finish``: ``pieces`` is then [(range, piece)]. The object is opened on
    ``stack`` (a ``contextlib.ExitStack``) once there is a key, so it is whole once the
    stack closes, and gone if it closes with an error."""

    def __init__(self, path: str, buckets: int, stack):
        self.path, self.buckets, self.stack = path, buckets, stack
        self.pieces: list[tuple[int, tuple[str, int, int]]] = []
        self._keys: list[bytes] = []
        self._numbers = array.array("q")
        self._stream, self._at = None, 0

    def add(self, key: str, slice_index: int, position: int) -> None:
        self._keys.append(key.encode("utf-8"))
        self._numbers.extend((key_index.bucket_of(key, self.buckets), slice_index, position))
        if len(self._keys) >= CHUNK:
            self.finish()

    def finish(self) -> None:
        """Write out the keys held (the last ones: also called by ``add`` every ``CHUNK``)."""
        if not self._keys:
            return
        if self._stream is None:
            self._stream = self.stack.enter_context(beamio.open_write(self.path))
        numbers = np.frombuffer(self._numbers, np.int64).reshape(-1, 3)
        for r, chosen in by_value(numbers[:, 0] // BUCKETS_PER_RANGE):
            block = pack_block([self._keys[i] for i in chosen], numbers[chosen])
            self._stream.write(block)
            self.pieces.append((r, (self.path, self._at, len(block))))
            self._at += len(block)
        self._keys, self._numbers = [], array.array("q")


class _WriteRangeFn(beam.DoFn):
    """One range's blocks -> each of its buckets written whole; yields the buckets written."""

    def __init__(self, out: str):
        self.out = out

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, element):
        _, pieces = element
        keys, numbers = [], []
        for data in beamio.read_pieces(list(pieces)):
            found, rows = unpack_block(data)
            keys += found
            numbers.append(rows)
        numbers = np.concatenate(numbers)
        for bucket, chosen in by_value(numbers[:, 0]):
            columns = {"key": [keys[i].decode("utf-8") for i in chosen], "slice": numbers[chosen, 1].tolist(),
                       "position": numbers[chosen, 2].tolist()}  # key_index.PLAN_COLUMNS
            beamio.write_bytes(naming.plan_keys(self.out, bucket), key_index.columns_bytes(columns),
                               "application/vnd.apache.parquet")
            yield bucket


class PlanKeys(beam.PTransform):
    """(range, piece) of every placing step's ``KeySection`` -> the buckets written."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def expand(self, pieces):
        return (pieces
                | "KeyRanges" >> beam.GroupByKey()
                | "WriteBuckets" >> beam.ParDo(_WriteRangeFn(self.out)))
