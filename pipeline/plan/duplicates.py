"""The duplicate checks by hash range: no worker holds the hashes of every record.

A record whose id an earlier record (in (source, line) order) already has is rejected
as ``duplicate_id``; with ``--dedupe``, then, a record whose prompt an earlier kept
record already has is rejected as ``duplicate_prompt``. Both messages name the earlier
row. Equal hashes fall in the same range of hash values, so each range is checked on
its own, in parallel, and only its records are in memory:

  range_count    the number of ranges, from the input's bytes: about ``RANGE_BYTES`` of
                 input each, so a range holds a few hundred thousand records whatever
                 the run's size
  section        one file's hashes and lines, sorted by hash: each range is a contiguous
                 run of rows (``segments``); the scan writes it next to the file's scan
  later_copies   in one range, the rows whose hash an earlier row has, and that row
  Drops          one file's rejected rows, by line, each with the earlier row it repeats

The id check's section rows carry the prompt's hash too (with --dedupe), so that the
rows it rejects can be left out of the prompt check, range by range
(``exclusions``): the prompt check compares kept records only, as the rule says.
What a check finds is written as bytes (``Drops.to_bytes``, ``lines_to_bytes``) and
only where it lies crosses the runner: a runner that holds a step's output in memory
(Beam's DirectRunner holds all of it, encoded and decoded) holds no rejected row.
Pure functions, but ``write_section`` (Beam's FileSystems).
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from pipeline.io import beamio

# Input bytes per hash range. A range's check holds about 100 bytes per record (its rows,
# the sort's order, the groups), so at the ~150 bytes a row of typical JSONL prompts a
# range of 64 MiB of input holds ~450k records and ~45 MB, and the plan's memory stays
# flat as the input grows. A compressed input (gzip, parquet) counts COMPRESSED_WEIGHT
# times its bytes, about what its text expands to.
RANGE_BYTES = 64 << 20
COMPRESSED_WEIGHT = 4
REASONS = ("duplicate_id", "duplicate_prompt")
_WHAT = {"duplicate_id": "the same id", "duplicate_prompt": "the same prompt"}

# a section's rows: the hash as two 64-bit halves (the high one first: hash order), the
# record's line, and in the id section with --dedupe the prompt's hash, to route a
# rejected record out of the prompt check
ROW = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("line", "<i4")])
ID_ROW_WITH_PROMPT = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("line", "<i4"), ("phi", "<u8"), ("plo", "<u8")])


def range_count(input_bytes: int, ranges_at_least: int = 1) -> int:
    """How many hash ranges the checks of an input of ``input_bytes`` (weighted) use."""
    return max(ranges_at_least, math.ceil(input_bytes / RANGE_BYTES))


def weighted_bytes(path: str, size: int) -> int:
    """``size`` bytes of the input ``path``, weighted by how much its text is compressed."""
    name = path.lower()
    return size * COMPRESSED_WEIGHT if name.endswith((".gz", ".parquet")) else size


def halves(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """16-byte hashes (dtype S16) -> their high and low 64 bits, big-endian: (hi, lo) in
    the hashes' byte order, so (hi, lo) order is the hashes' order."""
    if not len(hashes):
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    pairs = np.frombuffer(np.ascontiguousarray(hashes).tobytes(), dtype=">u8").reshape(-1, 2)
    return pairs[:, 0].astype(np.uint64), pairs[:, 1].astype(np.uint64)


def range_of(hi: np.ndarray, ranges: int) -> np.ndarray:
    """The range (0 .. ranges-1) of each hash, by its high half: equal parts of 2**64."""
    bounds = np.array([(r << 64) // ranges for r in range(1, ranges)], dtype=np.uint64)
    return np.searchsorted(bounds, hi, side="right")


def section(hashes: np.ndarray, lines: np.ndarray, prompts: np.ndarray | None = None) -> np.ndarray:
    """One file's rows (``ROW``; ``ID_ROW_WITH_PROMPT`` with ``prompts``, the prompts' hashes),
    sorted by hash, then line."""
    hi, lo = halves(hashes)
    rows = np.zeros(len(lines), ROW if prompts is None else ID_ROW_WITH_PROMPT)
    rows["hi"], rows["lo"], rows["line"] = hi, lo, lines
    if prompts is not None:
        rows["phi"], rows["plo"] = halves(prompts)
    return rows[np.lexsort((rows["line"], rows["lo"], rows["hi"]))]


def segments(rows: np.ndarray, ranges: int) -> list[tuple[int, int, int]]:
    """(range, first row, end row) of each range that a sorted section has rows of."""
    starts = np.searchsorted(range_of(rows["hi"], ranges), np.arange(ranges + 1), side="left")
    return [(r, int(starts[r]), int(starts[r + 1])) for r in range(ranges) if starts[r + 1] > starts[r]]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows ``start`` .. ``stop`` of the section ``path`` of the input file ``source``."""
    source: str
    path: str
    start: int
    stop: int


def write_section(path: str, rows: np.ndarray) -> None:
    beamio.write_bytes(path, rows.tobytes())


def piece_of(segment: Segment, dtype: np.dtype) -> tuple[str, int, int]:
    """Where the segment's rows lie in its section: (path, first byte, length), one ranged
    read (``beamio.read_pieces``; ``np.frombuffer(data, dtype)`` gives the rows)."""
    return segment.path, segment.start * dtype.itemsize, (segment.stop - segment.start) * dtype.itemsize


def later_copies(hi: np.ndarray, lo: np.ndarray, rank: np.ndarray, lines: np.ndarray) -> tuple[np.ndarray,
                                                                                              np.ndarray]:
    """(indices of every row whose hash an earlier row has, the index of the earliest such
    row); earlier: lower ``rank`` (the source's place in sorted order), then lower line."""
    if not len(hi):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort((lines, rank, lo, hi))
    first = np.ones(len(order), bool)
    first[1:] = (hi[order][1:] != hi[order][:-1]) | (lo[order][1:] != lo[order][:-1])
    earliest = order[np.flatnonzero(first)][np.cumsum(first) - 1]
    later = ~first
    return order[later], earliest[later]


@dataclasses.dataclass(frozen=True)
class Drops:
    """The rows of one file that a duplicate check rejects: for each (by ``lines``) its
    reason (an index into ``REASONS``) and the earlier row it repeats."""
    lines: np.ndarray  # int32
    reasons: np.ndarray  # int8
    sources: tuple[str, ...]  # the earlier rows' files
    earlier_source: np.ndarray  # int32, into sources
    earlier_lines: np.ndarray  # int32

    @classmethod
    def none(cls) -> "Drops":
        empty = np.zeros(0, np.int32)
        return cls(empty, np.zeros(0, np.int8), (), empty, empty)

    @classmethod
    def merged(cls, parts) -> "Drops":
        """One ``Drops`` of the parts' rows, sorted by line."""
        parts = [p for p in parts if len(p.lines)]
        if not parts:
            return cls.none()
        sources = tuple(sorted({s for p in parts for s in p.sources}))
        where = {s: i for i, s in enumerate(sources)}
        remap = [np.array([where[s] for s in p.sources], np.int32)[p.earlier_source] for p in parts]
        lines = np.concatenate([p.lines for p in parts])
        order = np.argsort(lines, kind="stable")
        return cls(lines[order], np.concatenate([p.reasons for p in parts])[order], sources,
                   np.concatenate(remap)[order], np.concatenate([p.earlier_lines for p in parts])[order])

    def __len__(self) -> int:
        return len(self.lines)

    def get(self, line: int) -> tuple[str, str] | None:
        """(reason, message) of the row on ``line``, or None when it is kept."""
        k = int(np.searchsorted(self.lines, line))
        if k == len(self.lines) or self.lines[k] != line:
            return None
        reason = REASONS[self.reasons[k]]
        return reason, f"{_WHAT[reason]} as {self.sources[self.earlier_source[k]]} line {int(self.earlier_lines[k])}"

    def reason_counts(self) -> dict[str, int]:
        counts = np.bincount(self.reasons, minlength=len(REASONS))
        return {reason: int(n) for reason, n in zip(REASONS, counts) if n}

    def to_bytes(self) -> bytes:
        """A line of JSON (the count and the earlier rows' files), then the arrays: 13 bytes a row."""
        header = json.dumps({"count": len(self), "sources": list(self.sources)}).encode() + b"\n"
        return header + b"".join(np.ascontiguousarray(array, dtype).tobytes() for array, dtype in
                                 zip(self._arrays(), _DROPS_DTYPES))

    @classmethod
    def from_bytes(cls, data: bytes) -> "Drops":
        """``to_bytes``'s Drops back."""
        line, _, rest = data.partition(b"\n")
        header = json.loads(line)
        arrays, at = [], 0
        for dtype in _DROPS_DTYPES:
            arrays.append(np.frombuffer(rest, dtype, header["count"], at))
            at += header["count"] * np.dtype(dtype).itemsize
        lines, reasons, earlier_source, earlier_lines = arrays
        return cls(lines, reasons, tuple(header["sources"]), earlier_source, earlier_lines)

    def _arrays(self) -> tuple:
        return self.lines, self.reasons, self.earlier_source, self.earlier_lines


_DROPS_DTYPES = ("<i4", "i1", "<i4", "<i4")  # Drops' lines, reasons, earlier_source, earlier_lines


def lines_to_bytes(lines: dict[str, np.ndarray]) -> bytes:
    """{source: lines} (``exclusions``' rows of several files) as bytes: a line of JSON (the
    sources and their counts), then the lines, 4 bytes each."""
    sources = sorted(lines)
    header = json.dumps({"sources": sources, "counts": [len(lines[s]) for s in sources]}).encode() + b"\n"
    return header + b"".join(np.ascontiguousarray(lines[s], "<i4").tobytes() for s in sources)


def lines_from_bytes(data: bytes) -> dict[str, np.ndarray]:
    """``lines_to_bytes``'s {source: lines} back."""
    line, _, rest = data.partition(b"\n")
    header = json.loads(line)
    found, at = {}, 0
    for source, count in zip(header["sources"], header["counts"]):
        found[source] = np.frombuffer(rest, "<i4", count, at)
        at += 4 * count
    return found


def check_range(parts: list[tuple[str, np.ndarray]], reason: str,
                excluded: dict[str, np.ndarray] | None = None) -> tuple[dict[str, Drops], dict[str, np.ndarray]]:
    """One range's check: ``parts``, (source, its rows of the range); ``excluded``: {source:
    lines} of rows left out (rejected by the id check). Returns ({source: its rows that
    repeat an earlier one, in no order: ``Drops.merged`` sorts them}, {source: those rows'
    indices in its part, once the rows left out are taken out}) (pure)."""
    sources = sorted({source for source, _ in parts})
    rank_of = {source: i for i, source in enumerate(sources)}
    kept = []
    for source, rows in parts:
        if excluded and source in excluded:
            rows = rows[~np.isin(rows["line"], excluded[source])]
        kept.append((source, rows))
    if not kept or not sum(len(rows) for _, rows in kept):
        return {}, {}
    hi = np.concatenate([rows["hi"] for _, rows in kept])
    lo = np.concatenate([rows["lo"] for _, rows in kept])
    lines = np.concatenate([rows["line"] for _, rows in kept]).astype(np.int32)
    rank = np.repeat(np.array([rank_of[s] for s, _ in kept], np.int32), [len(rows) for _, rows in kept])
    part = np.repeat(np.arange(len(kept), dtype=np.int32), [len(rows) for _, rows in kept])
    offsets = np.concatenate([[0], np.cumsum([len(rows) for _, rows in kept])])
    later, earliest = later_copies(hi, lo, rank, lines)
    code = REASONS.index(reason)
    found, where = {}, {}
    by_part = np.argsort(part[later], kind="stable")
    later, earliest = later[by_part], earliest[by_part]
    cuts = np.searchsorted(part[later], np.arange(len(kept) + 1))
    for p in range(len(kept)):
        mine, earlier = later[cuts[p]:cuts[p + 1]], earliest[cuts[p]:cuts[p + 1]]
        if not len(mine):
            continue
        used, index = np.unique(rank[earlier], return_inverse=True)
        source = kept[p][0]
        found[source] = Drops(lines[mine], np.full(len(mine), code, np.int8), tuple(sources[r] for r in used),
                              index.astype(np.int32).reshape(-1), lines[earlier])
        where[source] = mine - offsets[p]
    return found, where


def exclusions(rows: np.ndarray, dropped: np.ndarray, ranges: int) -> dict[int, np.ndarray]:
    """{prompt range: lines} of the rows ``dropped`` (indices into one file's id rows, which
    carry the prompts' hashes): where the prompt check must leave them out."""
    chosen = rows[dropped]
    where = range_of(chosen["phi"], ranges)
    return {int(r): chosen["line"][where == r].astype(np.int32) for r in np.unique(where)}
