"""The plan's first pass and its layout, as plain functions (no Beam transforms): rows
checked into records, one file's scan, and where every record goes.

  match_prompt_files  a pattern -> its prompt files, each of a known format
  validated           one file's rows -> ``Record`` or ``Reject``, in file order
  scan_file           one file -> a ``FileScan``: its row count, rejects by reason, and per
                      valid record its line, image count, whether its guidance is > 1, and
                      16-byte hashes of its id and (with dedupe) prompt;
                      ``save_scan``/``load_scan`` keep it as an npz
  make_layout         every FileScan -> a ``Layout`` (pure): the duplicate checks, each
                      file's first global position, in (source, line) order, and whether
                      any kept record is guided

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
import re

import numpy as np

from pipeline.core import buckets, records
from pipeline.model.sampling import guidance as guidance_rules
from pipeline.io import beamio, listing, storage
from pipeline.plan import inputs

_WILDCARD = re.compile(r"[*?\[]")
HASH_BYTES = 16  # of an id or a prompt: collisions are out of reach (2**-128 a pair)


class PlanError(ValueError):
    pass


def input_root(pattern: str) -> str:
    """The folder that auto ids are relative to: the pattern's part before any wildcard."""
    head = _WILDCARD.split(pattern, maxsplit=1)[0]
    return head if _WILDCARD.search(pattern) and head.endswith("/") else head.rpartition("/")[0]


def relative_source(source: str, root: str) -> str:
    """``source`` relative to the input root (its name alone when outside it)."""
    return source[len(root):].lstrip("/") if root and source.startswith(root) else os.path.basename(source)


def auto_id(source: str, root: str, line: int) -> str:
    """The id of a record without one: its source relative to the input root, and line."""
    return f"{relative_source(source, root)}:{line}"


def match_prompt_files(pattern: str) -> list[str]:
    """The files of ``pattern`` (``storage.glob``); PlanError if one has an unknown format."""
    try:
        paths = storage.glob(pattern)
        inputs.check_formats(paths)
    except (inputs.UnsupportedInput, listing.NotAPromptFile) as e:
        raise PlanError(str(e)) from None
    return paths


def validate_payload(source: str, line: int, payload, run_seed: int, root: str,
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
        result = validate_payload(source, line, payload, run_seed, root, prompt_field, sizes)
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
    guided: np.ndarray  # bool: the record's guidance (its own, else the run's) asks for it (``guidance.asks``)
    buckets: np.ndarray | None = None  # int16: the index of the size the record asked for (None: all 0)


def scan_file(path: str, run_seed: int, root: str, prompt_field: str = "prompt", dedupe: bool = True,
              default_guidance: float = 7.5, *, rule: str = "diffusers", sizes: tuple[str, ...] = ()) -> FileScan:
    rows, reasons = 0, collections.Counter()
    lines, images, guided, sized = array.array("i"), array.array("i"), array.array("b"), array.array("h")
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
        guided.append(guidance_rules.asks(rule, guidance))
        ids += digest(result.id)
        if dedupe:
            prompts += digest(result.prompt)
    as_hashes = lambda b: np.frombuffer(bytes(b), dtype=f"S{HASH_BYTES}")  # noqa: E731
    return FileScan(path, rows, dict(reasons), np.asarray(lines, np.int32), np.asarray(images, np.int32),
                    as_hashes(ids), as_hashes(prompts), np.asarray(guided, bool), np.asarray(sized, np.int16))


@dataclasses.dataclass
class Layout:
    """Where each file's records go, and which rows the duplicate checks reject."""
    first: dict  # source -> its first image's global position
    images_of: dict  # source -> its images
    drops: dict  # source -> {line: (reason, message)}
    rows: int
    records: int
    images: int
    rejects_by_reason: dict
    guided: bool  # some kept record's guidance is > 1: the run needs the guided program
    guided_records: int = 0  # the kept records whose guidance (their own, else the run's) asks for it
    first_guided: str | None = None  # the first of them, "SOURCE line N"
    guided_by_records: bool = False  # they made the run guided: its own guidance does not ask (``decide_guidance``)
    slice_size: int | None = None  # the run's slice size, once the plan decided it (``transforms.decide``)
    # per size (bucket) of the run, in order: each file's first global position in it, its
    # images and records, and the buckets' totals (one bucket in a single-size run: ``first``)
    bucket_first: dict = dataclasses.field(default_factory=dict)  # source -> [position per bucket]
    bucket_images: list = dataclasses.field(default_factory=list)
    bucket_records: list = dataclasses.field(default_factory=list)
    file_bucket_images: dict = dataclasses.field(default_factory=dict)  # source -> [images per bucket]
    bucket_slice_sizes: list | None = None  # each bucket's slice size, once decided (``transforms.decide``)

    def geometry(self, settings) -> "buckets.Geometry":
        """The plan's buckets, with the decided slice sizes: ``buckets.Geometry``."""
        found = settings.buckets() if settings is not None else [(0, 0, 0)]
        return buckets.Geometry.lay_out([(w, h) for w, h, _ in found], [b for _, _, b in found],
                                        self.bucket_slice_sizes or [self.slice_size],
                                        self.bucket_images or [self.images], self.bucket_records or [self.records])


def _later_copies(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices of every element equal to an earlier one, the index of that earlier one)."""
    if not len(hashes):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    earliest = first[inverse.reshape(-1)]
    later = np.nonzero(earliest != np.arange(len(hashes)))[0]
    return later, earliest[later]


def make_layout(scans: list[FileScan], dedupe: bool, num_buckets: int = 1) -> Layout:
    """Duplicate checks, positions and guidance over every file (pure; files in sorted order).

    A record whose id an earlier record (in (source, line) order) already has is
    rejected as ``duplicate_id``; with ``dedupe``, then, a record whose prompt an earlier
    kept record already has is rejected as ``duplicate_prompt``. Both messages name the
    earlier row. Memory: about 60 bytes a record, for the hashes and their sort.
    """
    scans = sorted(scans, key=lambda s: s.source)
    sources = [s.source for s in scans]
    owner = np.repeat(np.arange(len(scans)), [len(s.lines) for s in scans])
    lines = np.concatenate([s.lines for s in scans]) if scans else np.zeros(0, np.int32)
    images = np.concatenate([s.images for s in scans]) if scans else np.zeros(0, np.int32)
    drops: dict[str, dict] = {}
    kept = np.ones(len(lines), bool)

    def reject(later, earlier, reason, what):
        for i, j in zip(later.tolist(), earlier.tolist()):
            kept[i] = False
            drops.setdefault(sources[owner[i]], {})[int(lines[i])] = (
                reason, f"{what} as {sources[owner[j]]} line {int(lines[j])}")

    if scans:
        reject(*_later_copies(np.concatenate([s.id_hashes for s in scans])), "duplicate_id", "the same id")
        if dedupe:
            candidates = np.nonzero(kept)[0]
            later, earlier = _later_copies(np.concatenate([s.prompt_hashes for s in scans])[candidates])
            reject(candidates[later], candidates[earlier], "duplicate_prompt", "the same prompt")
    guided = np.concatenate([s.guided for s in scans]) if scans else np.zeros(0, bool)
    kept_images = np.where(kept, images, 0).astype(np.int64)
    per_file = np.bincount(owner, weights=kept_images, minlength=len(scans)).astype(np.int64)
    sized = np.concatenate([s.buckets if s.buckets is not None else np.zeros(len(s.lines), np.int16)
                            for s in scans]) if scans else np.zeros(0, np.int16)
    # bucket-major: every image of bucket 0, then of bucket 1, ...; files in order within each
    per_bucket = np.stack([np.bincount(owner, weights=np.where(sized == b, kept_images, 0), minlength=len(scans))
                           for b in range(num_buckets)]).astype(np.int64).reshape(num_buckets, len(scans))
    flat = np.cumsum(per_bucket.reshape(-1))
    bucket_starts = (np.concatenate([[0], flat[:-1]]) if flat.size else flat).reshape(num_buckets, len(scans))
    starts = bucket_starts[0] if scans else []
    reasons = collections.Counter()
    for scan in scans:
        reasons.update(scan.reasons)
    for by_line in drops.values():
        reasons.update(reason for reason, _ in by_line.values())
    asking = np.nonzero(guided & kept)[0]
    first_guided = f"{sources[owner[asking[0]]]} line {int(lines[asking[0]])}" if len(asking) else None
    return Layout(first={s: int(f) for s, f in zip(sources, starts)},
                  images_of={s: int(n) for s, n in zip(sources, per_file)}, drops=drops,
                  rows=sum(s.rows for s in scans), records=int(kept.sum()), images=int(kept_images.sum()),
                  rejects_by_reason=dict(sorted(reasons.items())), guided=bool(len(asking)),
                  guided_records=int(len(asking)), first_guided=first_guided,
                  bucket_first={s: [int(f) for f in bucket_starts[:, i]] for i, s in enumerate(sources)},
                  bucket_images=[int(n) for n in per_bucket.sum(axis=1)],
                  bucket_records=[int(((sized == b) & kept).sum()) for b in range(num_buckets)],
                  file_bucket_images={s: [int(n) for n in per_bucket[:, i]] for i, s in enumerate(sources)})



_ARRAYS = ("lines", "images", "id_hashes", "prompt_hashes", "guided", "buckets")


def save_scan(scan: FileScan, path: str) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **{name: getattr(scan, name) for name in _ARRAYS},
             meta=np.array(json.dumps({"source": scan.source, "rows": scan.rows, "reasons": scan.reasons})))
    beamio.write_bytes(path, buffer.getvalue())


def load_scan(path: str) -> FileScan:
    with np.load(io.BytesIO(beamio.read_bytes(path))) as saved:
        meta = json.loads(str(saved["meta"]))
        return FileScan(meta["source"], meta["rows"], meta["reasons"], **{name: saved[name] for name in _ARRAYS})
