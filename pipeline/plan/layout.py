"""The plan's first pass and its layout, as plain functions (no Beam transforms): rows
checked into records, one file's scan, and where every record goes.

  prompt_files        a pattern -> its prompt files, each of a known format, with their
                      sizes (and on GCS checksums) from one listing
  validated           one file's rows -> ``Record`` or ``Reject``, in file order
  scan_file           one file -> a ``FileScan``: its row count, rejects by reason, and per
                      valid record its line, image count, whether its guidance is > 1, and
                      16-byte hashes of its id and (with dedupe) prompt;
                      ``save_scan``/``load_scan`` keep it (but its hashes) as an npz
  count_file          a FileScan and its rows the duplicate checks reject
                      (``pipeline.plan.duplicates``) -> its ``FileCounts``
  make_layout         every file's FileCounts -> a ``Layout`` (pure): each file's first
                      global position, in (source, line) order, and whether any kept
                      record is guided: one entry a file, nothing a record

``pipeline.plan.transforms`` runs these inside the plan pipeline.
"""
from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import io
import json
import os

import numpy as np

from pipeline.core import buckets, records
from pipeline.model import families
from pipeline.io import beamio, inventory, listing
from pipeline.plan import inputs

UNUSED_GUIDANCE, UNUSED_NEGATIVE = 1, 2  # ``FileScan.unused``'s bits
HASH_BYTES = 16  # of an id or a prompt: collisions are out of reach (2**-128 a pair)


class PlanError(ValueError):
    pass


def input_root(pattern: str) -> str:
    """The folder that auto ids are relative to: the pattern's part before any wildcard."""
    head = listing.WILDCARD.split(pattern, maxsplit=1)[0]
    return head if listing.WILDCARD.search(pattern) and head.endswith("/") else head.rpartition("/")[0]


def relative_source(source: str, root: str) -> str:
    """``source`` relative to the input root (its name alone when outside it)."""
    return source[len(root):].lstrip("/") if root and source.startswith(root) else os.path.basename(source)


def auto_id(source: str, root: str, line: int) -> str:
    """The id of a record without one: its source relative to the input root, and line."""
    return f"{relative_source(source, root)}:{line}"


def match_prompt_files(pattern: str) -> list[str]:
    """The files of ``pattern`` (``storage.glob``); PlanError if one has an unknown format."""
    return sorted(prompt_files(pattern))


def prompt_files(pattern: str) -> dict[str, inventory.Listed]:
    """{file: what its listing says of it} of ``pattern``'s files (``inventory.listed``: one
    listing on GCS); PlanError if one has an unknown format or is not a file."""
    try:
        found = inventory.listed(pattern)
        inputs.check_formats(sorted(found))
    except (inputs.UnsupportedInput, listing.NotAPromptFile) as e:
        raise PlanError(str(e)) from None
    return found


def validate_payload(source: str, line: int, payload, run_seed: int, root: str, *,
                     prompt_field: str = "prompt", sizes: tuple[str, ...] = ()) -> records.Record | records.Reject | None:
    """One row of ``inputs.read_rows`` to a Record, a Reject, or None (a blank line)."""
    if isinstance(payload, records.Reject):
        return payload
    record_id = auto_id(source, root, line)
    if isinstance(payload, bytes):
        try:
            text_file = inputs.format_of(source) == "txt"
        except inputs.UnsupportedInput:
            text_file = False
        if text_file:
            return records.parse_text_line(payload, source, line, run_seed, record_id, sizes=sizes)
        return records.parse_jsonl_line(payload, source, line, run_seed, record_id, prompt_field=prompt_field,
                                        sizes=sizes)
    return records.parse_decoded(payload, source, line, run_seed, record_id, prompt_field=prompt_field, sizes=sizes)


def validated(path: str, run_seed: int, root: str, prompt_field: str = "prompt", sizes: tuple[str, ...] = ()):
    """The rows of one prompt file, checked: ``(payload, Record | Reject)`` in file order;
    ``sizes``: the run's buckets, which a row may ask for (``records.parse_row``)."""
    for source, line, payload in inputs.read_rows(path, prompt_field):
        result = validate_payload(source, line, payload, run_seed, root, prompt_field=prompt_field, sizes=sizes)
        if result is not None:  # a blank line is not a row
            yield payload, result


def digest(text: str) -> bytes:
    """The 16-byte hash that the duplicate checks compare (of an id or a prompt)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=HASH_BYTES).digest()


@dataclasses.dataclass
class FileScan:
    """What the first pass learns of one file: counts, and per valid record its line,
    image count, whether its guidance is > 1, and the hash of its id, and with dedupe of
    its prompt (25 or 41 bytes a record)."""
    source: str
    rows: int
    reasons: dict
    lines: np.ndarray  # int32, increasing
    images: np.ndarray  # int32
    id_hashes: np.ndarray  # S16
    prompt_hashes: np.ndarray  # S16; empty without dedupe
    guided: np.ndarray  # bool: the record's guidance (its own, else the run's) asks for it (``Rule.asks``)
    buckets: np.ndarray | None = None  # int16: the index of the size the record asked for (None: all 0)
    # int8 bits: UNUSED_GUIDANCE, the record's own guidance scale plays no part (``Rule.guidance_unused``);
    # UNUSED_NEGATIVE, its negative prompt plays none (``Rule.negative_unused``)
    unused: np.ndarray | None = None


def scan_file(path: str, run_seed: int, root: str, prompt_field: str = "prompt", dedupe: bool = True,
              default_guidance: float = 7.5, *, rule: str = "diffusers", sizes: tuple[str, ...] = ()) -> FileScan:
    rows, reasons = 0, collections.Counter()
    lines, images, guided, sized = array.array("i"), array.array("i"), array.array("b"), array.array("h")
    unused = array.array("b")
    found = families.guidance_rule(rule)
    ids, prompts = bytearray(), bytearray()
    for _, result in validated(path, run_seed, root, prompt_field, sizes):
        rows += 1
        if isinstance(result, records.Reject):
            reasons[result.reason] += 1
            continue
        lines.append(result.line)
        images.append(result.num_images)
        sized.append(result.bucket)
        guidance = default_guidance if result.guidance_scale is None else result.guidance_scale
        guided.append(found.asks(guidance))
        unused.append((UNUSED_GUIDANCE if result.guidance_scale is not None and found.guidance_unused(guidance) else 0)
                      | (UNUSED_NEGATIVE if result.negative_prompt and found.negative_unused(guidance) else 0))
        ids += digest(result.id)
        if dedupe:
            prompts += digest(result.prompt)
    as_hashes = lambda b: np.frombuffer(bytes(b), dtype=f"S{HASH_BYTES}")  # noqa: E731
    return FileScan(path, rows, dict(reasons), np.asarray(lines, np.int32), np.asarray(images, np.int32),
                    as_hashes(ids), as_hashes(prompts), np.asarray(guided, bool), np.asarray(sized, np.int16),
                    np.asarray(unused, np.int8))


@dataclasses.dataclass(frozen=True)
class FileCounts:
    """What the layout needs of one file once its duplicates are known: its rows, its
    rejects by reason (the duplicate checks' included), and of its kept records, per size
    (bucket), the records and images; how many ask for guidance, and the first one's line."""
    source: str
    rows: int
    reasons: dict
    bucket_records: tuple[int, ...]
    bucket_images: tuple[int, ...]
    guided_records: int = 0
    first_guided: int | None = None  # the line of the first kept record that asks for guidance
    # the kept records whose own guidance scale, and whose negative prompt, plays no part, and the
    # line of the first of each
    unused_guidance: int = 0
    first_unused_guidance: int | None = None
    unused_negative: int = 0
    first_unused_negative: int | None = None


def count_file(scan: FileScan, drops, num_buckets: int = 1) -> FileCounts:
    """``scan``'s counts once the rows in ``drops`` (``duplicates.Drops``) are rejected (pure)."""
    kept = ~np.isin(scan.lines, drops.lines)
    sized = scan.buckets if scan.buckets is not None else np.zeros(len(scan.lines), np.int16)
    images = np.where(kept, scan.images, 0).astype(np.int64)
    asking = np.flatnonzero(scan.guided & kept)
    reasons = collections.Counter(scan.reasons)
    reasons.update(drops.reason_counts())
    unused = scan.unused if scan.unused is not None else np.zeros(len(scan.lines), np.int8)
    idle = [np.flatnonzero(((unused & bit) != 0) & kept) for bit in (UNUSED_GUIDANCE, UNUSED_NEGATIVE)]
    first = [int(scan.lines[found[0]]) if len(found) else None for found in idle]
    return FileCounts(scan.source, scan.rows, dict(reasons),
                      tuple(int(((sized == b) & kept).sum()) for b in range(num_buckets)),
                      tuple(int(images[sized == b].sum()) for b in range(num_buckets)),
                      len(asking), int(scan.lines[asking[0]]) if len(asking) else None,
                      len(idle[0]), first[0], len(idle[1]), first[1])


@dataclasses.dataclass
class Layout:
    """Where each file's records go: each file's first position (per size), the run's
    totals, and whether a kept record asks for guidance. One entry a file, none a record."""
    first: dict  # source -> its first image's global position
    images_of: dict  # source -> its images
    rows: int
    records: int
    images: int
    rejects_by_reason: dict
    guided: bool  # some kept record's guidance is > 1: the run needs the guided program
    guided_records: int = 0  # the kept records whose guidance (their own, else the run's) asks for it
    first_guided: str | None = None  # the first of them, "SOURCE line N"
    guided_by_records: bool = False  # they made the run guided: its own guidance does not ask (``decide_guidance``)
    # the kept records whose own guidance scale, and whose negative prompt, plays no part: (count,
    # the first one's "SOURCE line N")
    unused_guidance: tuple = (0, None)
    unused_negative: tuple = (0, None)
    slice_size: int | None = None  # the run's slice size, once the plan decided it (``decide.decide``)
    # per size (bucket) of the run, in order: each file's first global position in it, its
    # images and records, and the buckets' totals (one bucket in a single-size run: ``first``)
    bucket_first: dict = dataclasses.field(default_factory=dict)  # source -> [position per bucket]
    bucket_images: list = dataclasses.field(default_factory=list)
    bucket_records: list = dataclasses.field(default_factory=list)
    file_bucket_images: dict = dataclasses.field(default_factory=dict)  # source -> [images per bucket]
    bucket_slice_sizes: list | None = None  # each bucket's slice size, once decided (``decide.decide``)

    def geometry(self, settings) -> "buckets.Geometry":
        """The plan's buckets, with the decided slice sizes: ``buckets.Geometry``."""
        found = settings.buckets() if settings is not None else [(0, 0, 0)]
        return buckets.Geometry.lay_out([(w, h) for w, h, _ in found], [b for _, _, b in found],
                                        self.bucket_slice_sizes or [self.slice_size],
                                        self.bucket_images or [self.images], self.bucket_records or [self.records])


def make_layout(counts: list[FileCounts], num_buckets: int = 1) -> Layout:
    """Positions and guidance from every file's counts (pure; files in sorted order): the
    images of bucket 0 first, then of bucket 1, ...; files in order within each."""
    counts = sorted(counts, key=lambda c: c.source)
    sources = [c.source for c in counts]
    per_bucket = np.array([c.bucket_images for c in counts], np.int64).reshape(len(counts), num_buckets).T
    flat = np.cumsum(per_bucket.reshape(-1))
    bucket_starts = (np.concatenate([[0], flat[:-1]]) if flat.size else flat).reshape(num_buckets, len(counts))
    reasons = collections.Counter()
    for c in counts:
        reasons.update(c.reasons)
    asking = [c for c in counts if c.guided_records]
    idle_guidance = [c for c in counts if c.unused_guidance]
    idle_negative = [c for c in counts if c.unused_negative]
    records = [sum(c.bucket_records[b] for c in counts) for b in range(num_buckets)]
    return Layout(first={s: int(bucket_starts[0, i]) for i, s in enumerate(sources)},
                  images_of={s: int(per_bucket[:, i].sum()) for i, s in enumerate(sources)},
                  rows=sum(c.rows for c in counts), records=sum(records), images=int(per_bucket.sum()),
                  rejects_by_reason=dict(sorted(reasons.items())), guided=bool(asking),
                  guided_records=sum(c.guided_records for c in asking),
                  first_guided=f"{asking[0].source} line {asking[0].first_guided}" if asking else None,
                  unused_guidance=(sum(c.unused_guidance for c in idle_guidance), f"{idle_guidance[0].source} line "
                                   f"{idle_guidance[0].first_unused_guidance}" if idle_guidance else None),
                  unused_negative=(sum(c.unused_negative for c in idle_negative), f"{idle_negative[0].source} line "
                                   f"{idle_negative[0].first_unused_negative}" if idle_negative else None),
                  bucket_first={s: [int(f) for f in bucket_starts[:, i]] for i, s in enumerate(sources)},
                  bucket_images=[int(n) for n in per_bucket.sum(axis=1)], bucket_records=records,
                  file_bucket_images={s: [int(n) for n in per_bucket[:, i]] for i, s in enumerate(sources)})


_ARRAYS = ("lines", "images", "guided", "buckets", "unused")  # the hashes are in the sections (``duplicates.section``)


def save_scan(scan: FileScan, path: str) -> None:
    """``scan``'s counts and per-record arrays, without its hashes."""
    buffer = io.BytesIO()
    np.savez(buffer, **{name: getattr(scan, name) for name in _ARRAYS},
             meta=np.array(json.dumps({"source": scan.source, "rows": scan.rows, "reasons": scan.reasons})))
    beamio.write_bytes(path, buffer.getvalue())


def load_scan(path: str) -> FileScan:
    """A ``save_scan``: its hashes are empty."""
    none = np.zeros(0, f"S{HASH_BYTES}")
    with np.load(io.BytesIO(beamio.read_bytes(path))) as saved:
        meta = json.loads(str(saved["meta"]))
        return FileScan(meta["source"], meta["rows"], meta["reasons"], id_hashes=none, prompt_hashes=none,
                        **{name: saved[name] for name in _ARRAYS})
