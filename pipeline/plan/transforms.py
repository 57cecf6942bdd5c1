"""``plan``: prompt shards in, fixed-size slices out (a Beam pipeline that streams).

No stage ever holds the prompts of the whole input, nor of one whole file: each file
is read twice, one row at a time, and only small summaries and file names cross a
shuffle. At most one slice of items is in memory at a time.

  ScanFiles      each file -> a ``FileScan``: its row count, rejects by reason, and for
                 each valid record its line, image count and 16-byte hashes of its id
                 and (with --dedupe) prompt (``validated`` reads and checks the rows);
                 the arrays go to ``plan/scans/`` and only the file's name crosses
                 the shuffle
  Layout         every FileScan -> a ``Layout`` (``make_layout``, pure): later records
                 with an id already used are rejected (``duplicate_id``); with
                 ``--dedupe``, later records whose prompt was already seen are rejected
                 (``duplicate_prompt``); each file's first global position, in (source,
                 line) order
  PlaceRecords   each file again, with the Layout -> its rejects file, every slice that
                 lies wholly inside the file (written at once), and a part file of each
                 slice it shares with other files (at most two per file)
  JoinShared     (slice, part file) pairs grouped by slice -> the parts concatenated in
                 position order into the slice, then deleted
  WriteManifest  once every slice is written -> ``plan/manifest.json``
``run.json`` (resolved settings, model fingerprint, versions) is written first.
Inside the pipeline, files are read and written through Beam's FileSystems
(``pipeline.io.beamio``); before and after it, through ``pipeline.io.storage``.
Counters (Beam metrics, namespace ``plan``): rows_read, rows_rejected,
records_planned, images_planned, slices_written.
"""
from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import datetime as dt
import hashlib
import io
import json
import os
import re
from importlib import metadata

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import __version__
from pipeline.io import beamio
from pipeline.plan import inputs
from pipeline.core import logs
from pipeline.core import naming
from pipeline.core import records
from pipeline.core import slicing
from pipeline.io import storage
from pipeline.core.settings import Run, Settings
from pipeline.io import runs

_WILDCARD = re.compile(r"[*?\[]")
HASH_BYTES = 16  # of an id or a prompt: collisions are out of reach (2**-128 a pair)


class PlanError(ValueError):
    pass


def input_root(pattern: str) -> str:
    """The folder that auto ids are relative to: the pattern's part before any wildcard."""
    head = _WILDCARD.split(pattern, maxsplit=1)[0]
    return head if _WILDCARD.search(pattern) and head.endswith("/") else head.rpartition("/")[0]


def auto_id(source: str, root: str, line: int) -> str:
    """The id of a record without one: its source relative to the input root, and line."""
    relative = source[len(root):].lstrip("/") if root and source.startswith(root) else os.path.basename(source)
    return f"{relative}:{line}"


def match_prompt_files(pattern: str) -> list[str]:
    """The files of ``pattern`` (``storage.glob``); PlanError if one has an unknown format."""
    paths = storage.glob(pattern)
    try:
        inputs.check_formats(paths)
    except inputs.UnsupportedInput as e:
        raise PlanError(str(e)) from None
    return paths


def validate_payload(source: str, line: int, payload, run_seed: int, root: str,
                     prompt_field: str = "prompt") -> records.Record | records.Reject | None:
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
            return records.parse_text_line(payload, source, line, run_seed, record_id)
        return records.parse_jsonl_line(payload, source, line, run_seed, record_id, prompt_field=prompt_field)
    return records.parse_decoded(payload, source, line, run_seed, record_id, prompt_field=prompt_field)


def validated(path: str, run_seed: int, root: str, prompt_field: str = "prompt"):
    """The rows of one prompt file, checked: ``(payload, Record | Reject)`` in file order."""
    for source, line, payload in inputs.read_rows(path, prompt_field):
        result = validate_payload(source, line, payload, run_seed, root, prompt_field)
        if result is not None:  # a blank line is not a row
            yield payload, result


def _raw_text(payload) -> str:
    if isinstance(payload, bytes):
        return payload.decode("utf-8", "replace")
    return json.dumps(payload, ensure_ascii=False, default=str)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=HASH_BYTES).digest()


@dataclasses.dataclass
class FileScan:
    """What the first pass learns of one file: counts, and per valid record its line,
    image count and the hash of its id, and with dedupe of its prompt (24 or 40 bytes
    a record)."""
    source: str
    rows: int
    reasons: dict
    lines: np.ndarray  # int32, increasing
    images: np.ndarray  # int32
    id_hashes: np.ndarray  # S16
    prompt_hashes: np.ndarray  # S16; empty without dedupe


def scan_file(path: str, run_seed: int, root: str, prompt_field: str = "prompt", dedupe: bool = True) -> FileScan:
    rows, reasons = 0, collections.Counter()
    lines, images = array.array("i"), array.array("i")
    ids, prompts = bytearray(), bytearray()
    for _, result in validated(path, run_seed, root, prompt_field):
        rows += 1
        if isinstance(result, records.Reject):
            reasons[result.reason] += 1
            continue
        lines.append(result.line)
        images.append(result.num_images)
        ids += _digest(result.id)
        if dedupe:
            prompts += _digest(result.prompt)
    as_hashes = lambda b: np.frombuffer(bytes(b), dtype=f"S{HASH_BYTES}")  # noqa: E731
    return FileScan(path, rows, dict(reasons), np.asarray(lines, np.int32), np.asarray(images, np.int32),
                    as_hashes(ids), as_hashes(prompts))


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


def _later_copies(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices of every element equal to an earlier one, the index of that earlier one)."""
    if not len(hashes):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    earliest = first[inverse.reshape(-1)]
    later = np.nonzero(earliest != np.arange(len(hashes)))[0]
    return later, earliest[later]


def make_layout(scans: list[FileScan], dedupe: bool) -> Layout:
    """Duplicate checks and positions over every file (pure; files in sorted order).

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
    kept_images = np.where(kept, images, 0).astype(np.int64)
    per_file = np.bincount(owner, weights=kept_images, minlength=len(scans)).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(per_file)[:-1]]) if scans else []
    reasons = collections.Counter()
    for scan in scans:
        reasons.update(scan.reasons)
    for by_line in drops.values():
        reasons.update(reason for reason, _ in by_line.values())
    return Layout(first={s: int(f) for s, f in zip(sources, starts)},
                  images_of={s: int(n) for s, n in zip(sources, per_file)}, drops=drops,
                  rows=sum(s.rows for s in scans), records=int(kept.sum()), images=int(kept_images.sum()),
                  rejects_by_reason=dict(sorted(reasons.items())))


def _jsonl_line(obj) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")


def write_slice(out: str, index: int, items) -> int:
    beamio.write_bytes(naming.plan_slice(out, index), b"".join(_jsonl_line(i.to_json()) for i in items),
                       "application/jsonl")
    return index


_ARRAYS = ("lines", "images", "id_hashes", "prompt_hashes")


def save_scan(scan: FileScan, path: str) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **{name: getattr(scan, name) for name in _ARRAYS},
             meta=np.array(json.dumps({"source": scan.source, "rows": scan.rows, "reasons": scan.reasons})))
    beamio.write_bytes(path, buffer.getvalue())


def load_scan(path: str) -> FileScan:
    with np.load(io.BytesIO(beamio.read_bytes(path))) as saved:
        meta = json.loads(str(saved["meta"]))
        return FileScan(meta["source"], meta["rows"], meta["reasons"], **{name: saved[name] for name in _ARRAYS})


class _ScanFn(beam.DoFn):
    """Scans one file and saves its arrays; yields where they are (the Beam runner
    never holds, copies or pickles the arrays)."""

    def __init__(self, out: str, run_seed: int, root: str, prompt_field: str, dedupe: bool):
        self.out, self.args = out, (run_seed, root, prompt_field, dedupe)
        self.read = Metrics.counter("plan", "rows_read")

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, path: str):
        scan = scan_file(path, *self.args)
        self.read.inc(scan.rows)
        saved = naming.plan_scan(self.out, path)
        save_scan(scan, saved)
        yield saved


def layout_of_saved(paths: list[str], dedupe: bool) -> Layout:
    """``make_layout`` over the saved scans, which are then deleted."""
    layout = make_layout([load_scan(path) for path in paths], dedupe)
    beamio.delete(paths)
    return layout


class _PlaceFn(beam.DoFn):
    """The second pass over one file: rejects, whole slices, and the shared slices' items."""
    SHARED = "shared"

    def __init__(self, out: str, size: int, run_seed: int, root: str, prompt_field: str):
        self.out, self.size, self.args = out, size, (run_seed, root, prompt_field)
        self.rejected = Metrics.counter("plan", "rows_rejected")
        self.planned = Metrics.counter("plan", "records_planned")
        self.images = Metrics.counter("plan", "images_planned")
        self.slices = Metrics.counter("plan", "slices_written")

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, path: str, layout: Layout):
        first, drops = layout.first.get(path, 0), layout.drops.get(path, {})
        end = first + layout.images_of.get(path, 0)
        position, current, pending = first, None, []
        with contextlib.ExitStack() as stack:
            rejects = None
            for payload, result in validated(path, *self.args):
                if isinstance(result, records.Record) and result.line in drops:
                    reason, message = drops[result.line]
                    result = records.Reject(result.source, result.line, reason, message, _raw_text(payload))
                if isinstance(result, records.Reject):
                    if rejects is None:  # only files with rejects get a rejects file
                        rejects = stack.enter_context(beamio.open_write(naming.rejects_file(self.out, path),
                                                                        "application/jsonl"))
                    rejects.write(_jsonl_line(result.to_json()))
                    self.rejected.inc()
                    continue
                self.planned.inc()
                for item in records.expand(result, position, self.size):
                    if item.slice != current:
                        yield from self._flush(current, pending, first, end, layout.images)
                        current, pending = item.slice, []
                    pending.append(item)
                self.images.inc(result.num_images)
                position += result.num_images
        yield from self._flush(current, pending, first, end, layout.images)
        if position != end:
            raise PlanError(f"{path} changed while it was planned: {position - first} images on the second "
                            f"read, {end - first} on the first")

    def _flush(self, index, items, first, end, total):
        if index is None:
            return
        start, stop = index * self.size, min((index + 1) * self.size, total)
        if first <= start and stop <= end:  # the slice lies wholly in this file
            self.slices.inc()
            yield write_slice(self.out, index, items)
        else:
            part = naming.plan_part(self.out, index, items[0].position)
            beamio.write_bytes(part, b"".join(_jsonl_line(i.to_json()) for i in items), "application/jsonl")
            yield beam.pvalue.TaggedOutput(self.SHARED, (index, (items[0].position, part)))


class _JoinPartsFn(beam.DoFn):
    """A shared slice from its parts, in position order; the parts are deleted after."""

    def __init__(self, out: str):
        self.out = out
        self.slices = Metrics.counter("plan", "slices_written")

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, element):
        index, parts = element
        paths = [path for _, path in sorted(parts)]
        beamio.write_bytes(naming.plan_slice(self.out, index), b"".join(beamio.read_bytes(p) for p in paths),
                           "application/jsonl")
        beamio.delete(paths)
        self.slices.inc()
        yield index


class WriteManifest(beam.PTransform):
    def __init__(self, out: str, size: int):
        super().__init__()
        self.out, self.size = out, size

    def expand(self, inputs):
        layout, written = inputs

        def write(_, layout: Layout, slice_ids):
            rejects = sum(layout.rejects_by_reason.values())
            manifest = {"slice_size": self.size, "slices": len(slice_ids), "records": layout.records,
                        "images": layout.images, "rejects": rejects, "rejects_by_reason": layout.rejects_by_reason,
                        "input_rows": layout.rows, "input_files": len(layout.first)}
            if layout.records + rejects != layout.rows:
                raise PlanError(f"{layout.rows} input rows, but {layout.records} records and {rejects} rejects")
            if sorted(slice_ids) != list(range(slicing.num_slices(layout.images, self.size))):
                raise PlanError(f"slices are not contiguous: {sorted(slice_ids)[:10]}")
            beamio.write_json(naming.manifest(self.out), manifest)
            return manifest

        return (written.pipeline
                | "Once" >> beam.Create([None])
                | "Write" >> beam.Map(write, beam.pvalue.AsSingleton(layout), beam.pvalue.AsList(written)))


def build(p, pattern: str, out: str, settings: Settings):
    """The plan pipeline on ``p``; returns the PCollection of the manifest."""
    root, size = input_root(pattern), settings.slice_size
    args = (settings.seed, root, settings.prompt_field)
    files = (p
             | "MatchFiles" >> beam.Create(match_prompt_files(pattern))
             | "SpreadFiles" >> beam.Reshuffle())
    layout = (files
              | "ScanFiles" >> beam.ParDo(_ScanFn(out, *args, settings.dedupe))
              | "AllScans" >> beam.combiners.ToList()
              | "Layout" >> beam.Map(layout_of_saved, settings.dedupe))
    placed = files | "PlaceRecords" >> beam.ParDo(_PlaceFn(out, size, *args), beam.pvalue.AsSingleton(layout)) \
        .with_outputs(_PlaceFn.SHARED, main="written")
    joined = (placed[_PlaceFn.SHARED]
              | "GroupShared" >> beam.GroupByKey()
              | "JoinShared" >> beam.ParDo(_JoinPartsFn(out)))
    written = (placed.written, joined) | "AllSlices" >> beam.Flatten()
    return (layout, written) | "WriteManifest" >> WriteManifest(out, size)


def _versions() -> dict:
    names = ("jax", "jaxlib", "flax", "diffusers", "transformers", "apache-beam", "numpy", "pillow", "pyarrow")
    found = {"promptmill": __version__}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def resolve_settings(settings: Settings) -> tuple[Settings, Run]:
    """Settings with the model's defaults filled in, and the run they plan."""
    from pipeline.model import load as model

    settings.validate()
    described = model.describe(settings.model)
    size = described["native_size"]
    settings = settings.replace(width=settings.width or size, height=settings.height or size,
                                scheduler=settings.scheduler or described["scheduler"]).validate()
    run = Run.create(settings, described["fingerprint"], versions=_versions(),
                     created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    return settings, run


def prepare_out(out: str, run: Run, overwrite: bool = False) -> Run:
    """Make ``out`` ready for ``run``; returns the run in force.

    * An empty OUT gets ``run``.
    * An OUT holding the same run (same settings fingerprint) is resumed: its run.json,
      and so its ``created_at``, is kept, so every rewritten object has the same bytes.
    * An OUT holding a run with other settings is refused, since it would mix two runs'
      slices in one dataset, unless ``overwrite``.
    ``overwrite`` deletes everything promptmill wrote under OUT (``naming.OWNED``) first.
    """
    if overwrite:
        deleted = sum(storage.delete_prefix(naming.join(out, name)) for name in naming.OWNED)
        if deleted:
            logs.event("overwrite", out=out, objects_deleted=deleted)
    elif runs.exists(out):
        previous = runs.read(out)
        if previous.settings_fingerprint == run.settings_fingerprint:
            return previous
        changed = [f.name for f in dataclasses.fields(Settings)  # a moved OUT is the same run
                   if f.name != "out" and getattr(previous.settings, f.name) != getattr(run.settings, f.name)]
        if previous.model_fingerprint != run.model_fingerprint:
            changed.append("model weights")
        raise PlanError(f"{out} already holds a run with other settings (changed: {', '.join(changed)}); "
                        "use another --out, or add --overwrite to delete the old run and start over")
    runs.write(out, run)
    return run


def run_plan(settings: Settings, beam_args: list[str] | None = None, overwrite: bool = False) -> dict:
    """Plan ``settings.prompts`` into ``settings.out``; returns the manifest.

    ``overwrite``: delete an earlier run in ``settings.out`` first (``prepare_out``).
    """
    beamio.require_filesystem(settings.prompts, settings.out)
    if not match_prompt_files(settings.prompts):  # also: every file has a known format
        raise PlanError(f"no prompt files match {settings.prompts!r}")
    settings, run = resolve_settings(settings)
    prepare_out(settings.out, run, overwrite)
    p = beam.Pipeline(options=PipelineOptions(beam_args or []))
    build(p, settings.prompts, settings.out, settings)
    result = p.run()
    result.wait_until_finish()
    logs.event("plan_counters", **counters(result))
    return storage.read_json(naming.manifest(settings.out))


def counters(result) -> dict:
    """The ``plan`` Beam counters of a finished pipeline, by name (committed values)."""
    from apache_beam.metrics.metric import MetricsFilter

    found = result.metrics().query(MetricsFilter().with_namespace("plan"))["counters"]
    totals: dict[str, int] = {}
    for counter in found:
        totals[counter.key.metric.name] = totals.get(counter.key.metric.name, 0) + counter.committed
    return dict(sorted(totals.items()))
