"""``plan``: prompt shards in, fixed-size slices out (a Beam pipeline that streams).

No stage ever holds the prompts of the whole input, nor of one whole file: each file
is read twice, one row at a time, and only small summaries, file names and where
objects lie cross a shuffle (no record, rejected row or key: a runner may hold a
step's whole output, as Beam's DirectRunner does in its one process). No step holds a
value of every record: the only thing gathered in one place is a few counts per file.
At most one slice of items, and a chunk of keys, is in memory at a time. ``Plan``
composes the stages (prompt pattern -> the manifest); the per-file logic they run is
in ``pipeline.plan.layout``.

  MatchFiles     the prompt pattern -> its files (``layout.prompt_files``)
  FirstPass      ``pipeline.plan.first_pass``: each file scanned (row count, rejects by
                 reason, per valid record its line, image count and 16-byte hashes of its
                 id and, with --dedupe, prompt), then the duplicate checks, each range of
                 hash values on its own (``pipeline.plan.duplicates``): later records with
                 an id already used are rejected (``duplicate_id``); with ``--dedupe``,
                 later records whose prompt a kept record already has
                 (``duplicate_prompt``); then each file's counts, and its rejected rows
                 for its own placing step
  Layout         every file's counts (one entry a file, none a record) -> a ``Layout``
                 (``layout.make_layout``, pure): each file's first global position, in
                 (source, line) order; whether any kept record's guidance is > 1
  Decide         the Layout -> ``run.json`` gets what the counts decide
                 (``pipeline.plan.decide``): ``guided``, the run's program is the guided
                 one if any kept record is, else the guidance-free one; for a
                 ``--per-device-batch auto`` chosen for this plan (``cap_hosts``), a
                 per-device batch no larger than the run can fill; for
                 ``--batches-per-slice auto``, the batches per slice; hence the slice
                 size; before any slice is written
  PlaceRecords   each file again, with its rejected rows and the Layout -> its rejects
                 file, every slice that lies wholly inside the file (written at once),
                 and a part file of each slice it shares with other files (at most two
                 per file); the keys it places, by range of key-index buckets
                 (``index.KeySection``)
  JoinShared     (slice, part file) pairs grouped by slice -> the parts concatenated in
                 position order into the slice, then deleted
  PlanKeys       every file's keys, by range of buckets -> the plan's key index,
                 ``plan/keys/`` (key -> slice, position; ``pipeline.plan.index``)
  WriteManifest  once every slice and the key index are written -> the objects the
                 checks and the placing steps wrote for later steps (``plan/scans/``)
                 deleted, then ``plan/manifest.json``

``run_plan`` runs ``Plan`` on its own; the beam engine composes it with generate and
collect. Both first call ``pipeline.plan.prepare.prepare``, which writes ``run.json``
(resolved settings, model fingerprint, versions) before any stage runs.
Inside the pipeline, files are read and written through Beam's FileSystems
(``pipeline.io.beamio``); before and after it, through ``pipeline.io.storage``.
Counters (Beam metrics, namespace ``plan``): rows_read, rows_rejected,
records_planned, images_planned, slices_written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.core import logs, naming, records, slicing
from pipeline.core.settings import Settings, guided_by_records_line
from pipeline.io import beamio, runs, storage
from pipeline.model import load as model_lib
from pipeline.output import key_index
from pipeline.plan import duplicates
from pipeline.plan.decide import decide
from pipeline.plan.first_pass import TEMPS, FirstPass
from pipeline.plan.layout import (
    Layout,
    PlanError,
    input_root,
    make_layout,
    prompt_files,
    relative_source,
    validated,
)
from pipeline.plan.index import KeySection, PlanKeys
from pipeline.plan.prepare import prepare


def _raw_text(payload) -> str:
    if isinstance(payload, bytes):
        return payload.decode("utf-8", "replace")
    return json.dumps(payload, ensure_ascii=False, default=str)


def _jsonl_line(obj) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")


def write_slice(out: str, index: int, items) -> int:
    beamio.write_bytes(naming.plan_slice(out, index), b"".join(_jsonl_line(i.to_json()) for i in items),
                       "application/jsonl")
    return index


def key_labels(settings: Settings, paths: list[str]) -> dict[str, str]:
    """{relative path: label} of the run's prompt files (``naming.file_labels``): the names
    of the records without an id (``naming.readable_stem``)."""
    root = input_root(settings.prompts)
    return naming.file_labels(relative_source(path, root) for path in paths)


class _PlaceFn(beam.DoFn):
    """The second pass over one file: rejects, whole slices, the shared slices' items, and
    the pieces of its keys for the key index (``index.KeySection``)."""
    SHARED, KEYS = "shared", "keys"

    def __init__(self, out: str, run_seed: int, root: str, prompt_field: str, labels: dict | None = None,
                 settings: Settings | None = None):
        self.out, self.args, self.labels = out, (run_seed, root, prompt_field, settings.sizes if settings else ()), \
            labels
        self.settings = settings
        self.rejected = Metrics.counter("plan", "rows_rejected")
        self.planned = Metrics.counter("plan", "records_planned")
        self.images = Metrics.counter("plan", "images_planned")
        self.slices = Metrics.counter("plan", "slices_written")

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, element, layout: Layout):
        # the file, and the object of its rows the duplicate checks reject (``duplicates.Drops``), if any
        path, dropped_at = element
        drops = duplicates.Drops.from_bytes(beamio.read_bytes(dropped_at)) if dropped_at else duplicates.Drops.none()
        geometry = layout.geometry(self.settings)
        count = len(geometry.buckets)
        first = layout.bucket_first.get(path, [0] * count)
        end = [f + n for f, n in zip(first, layout.file_bucket_images.get(path, [0] * count))]
        # per bucket: the next position, the slice being gathered and its items
        position, current, pending = list(first), [None] * count, [[] for _ in range(count)]
        with contextlib.ExitStack() as stack:
            rejects = None
            keys = KeySection(naming.plan_section(self.out, path, "keys"), key_index.bucket_count(layout.images), stack)
            for payload, result in validated(path, *self.args):
                dropped = drops.get(result.line) if isinstance(result, records.Record) and len(drops) else None
                if dropped is not None:
                    result = records.Reject(result.source, result.line, *dropped, _raw_text(payload))
                if isinstance(result, records.Reject):
                    if rejects is None:  # only files with rejects get a rejects file
                        rejects = stack.enter_context(beamio.open_write(naming.rejects_file(self.out, path),
                                                                        "application/jsonl"))
                    rejects.write(_jsonl_line(result.to_json()))
                    self.rejected.inc()
                    continue
                self.planned.inc()
                b, bucket = result.bucket, geometry.buckets[result.bucket]
                for item in records.expand(result, position[b], bucket.slice_size, self.labels,
                                           (bucket.offset, bucket.first_slice)):
                    if item.slice != current[b]:
                        yield from self._flush(current[b], pending[b], first[b], end[b], geometry)
                        current[b], pending[b] = item.slice, []
                    pending[b].append(item)
                    keys.add(item.key, item.slice, item.position)
                self.images.inc(result.num_images)
                position[b] += result.num_images
            keys.finish()
        for b in range(count):
            yield from self._flush(current[b], pending[b], first[b], end[b], geometry)
        for piece in keys.pieces:
            yield beam.pvalue.TaggedOutput(self.KEYS, piece)
        for temporary in ([dropped_at] if dropped_at else []) + ([keys.path] if keys.pieces else []):
            yield beam.pvalue.TaggedOutput(TEMPS, temporary)
        if position != end:
            raise PlanError(f"{path} changed while it was planned: {sum(position) - sum(first)} images on the "
                            f"second read, {sum(end) - sum(first)} on the first")

    def _flush(self, index, items, first, end, geometry):
        if index is None:
            return
        start, stop = geometry.slice_span(index)
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


@dataclasses.dataclass(frozen=True)
class Span:
    """What ``IndexSpan`` found of a set of slice indices: how many distinct ones, the lowest
    and highest, and how many came more than once (and the first of those)."""
    count: int
    low: int | None
    high: int | None
    twice: int = 0
    first_twice: tuple[int, ...] = ()

    def exactly(self, n: int) -> bool:
        """Whether the indices were 0 .. n-1, each once: n distinct ones, none twice, from 0 to n-1."""
        return not self.twice and self.count == n and (n == 0 or (self.low, self.high) == (0, n - 1))

    def describe(self, n: int) -> str:
        return (f"{self.count} distinct slice(s) from {self.low} to {self.high} for {n} planned, {self.twice} more "
                f"than once {list(self.first_twice)}")


class _SpanFn(beam.CombineFn):
    """A ``Span`` of (index, times it came) pairs, one a distinct index."""
    SHOWN = 10  # indices that came more than once, kept to name

    def create_accumulator(self):
        return Span(0, None, None)

    def add_input(self, span, counted):
        index, times = counted
        twice = span.first_twice if times == 1 else tuple(sorted((*span.first_twice, index)))[:self.SHOWN]
        return Span(span.count + 1, index if span.low is None else min(span.low, index),
                    index if span.high is None else max(span.high, index), span.twice + (times != 1), twice)

    def merge_accumulators(self, spans):
        spans = list(spans)
        lows = [s.low for s in spans if s.low is not None]
        highs = [s.high for s in spans if s.high is not None]
        return Span(sum(s.count for s in spans), min(lows, default=None), max(highs, default=None),
                    sum(s.twice for s in spans), tuple(sorted(i for s in spans for i in s.first_twice))[:self.SHOWN])

    def extract_output(self, span):
        return span


class IndexSpan(beam.PTransform):
    """Slice indices -> one ``Span``, none for no index (read it ``AsSingleton(...,
    default_value=NO_SPAN)``): counted per index and combined, never listed in one place."""

    def expand(self, indices):
        return (indices
                | "PerIndex" >> beam.Map(lambda index: (index, 1))
                | "CountPerIndex" >> beam.CombinePerKey(sum)
                | "Span" >> beam.CombineGlobally(_SpanFn()).without_defaults())


NO_SPAN = Span(0, None, None)


class WriteManifest(beam.PTransform):
    """(the Layout, the slice indices written, the key index's buckets written, the objects
    the plan's steps wrote for later steps) -> the manifest, once every slice is written and
    each planned slice was written exactly once (``IndexSpan``), the key index is written
    (its step is the last reader of those objects) and those objects are deleted (a few a
    file and hash range, ``pipeline.plan.first_pass``)."""

    def __init__(self, out: str, settings: Settings | None = None):
        super().__init__()
        self.out, self.settings = out, settings

    def expand(self, inputs):
        layout, written, indexed, temporaries = inputs
        settings = self.settings
        span = written | "Written" >> IndexSpan()

        def write(_, layout: Layout, span: Span, _indexed, temporaries):
            rejects = sum(layout.rejects_by_reason.values())
            manifest = {"slice_size": layout.slice_size, "slices": span.count, "records": layout.records,
                        "images": layout.images, "rejects": rejects, "rejects_by_reason": layout.rejects_by_reason,
                        "input_rows": layout.rows, "input_files": len(layout.first)}
            expected = slicing.num_slices(layout.images, layout.slice_size)
            if settings is not None and settings.sizes:  # each size's records, images, slices and batch
                geometry = layout.geometry(runs.read(self.out).settings)
                manifest["buckets"] = [bucket.to_json() for bucket in geometry.buckets]
                expected = geometry.slices
            if layout.records + rejects != layout.rows:
                raise PlanError(f"{layout.rows} input rows, but {layout.records} records and {rejects} rejects")
            if not span.exactly(expected):
                raise PlanError(f"slices are not contiguous: {span.describe(expected)}")
            if layout.guided_by_records:
                manifest["guided_by_records"] = {"records": layout.guided_records, "first": layout.first_guided}
            for name, (count, first) in (("guidance_unused", layout.unused_guidance),
                                         ("negative_prompts_unused", layout.unused_negative)):
                if count:  # said once the plan is done (``run_plan``)
                    manifest[name] = {"records": count, "first": first}
            beamio.delete(temporaries)
            beamio.write_json(naming.manifest(self.out), manifest)
            return manifest

        return (written.pipeline
                | "Once" >> beam.Create([None])
                | "Write" >> beam.Map(write, beam.pvalue.AsSingleton(layout),
                                      beam.pvalue.AsSingleton(span, default_value=NO_SPAN),
                                      beam.pvalue.AsList(indexed), beam.pvalue.AsList(temporaries)))


class Plan(beam.PTransform):
    """The plan pipeline: ``settings.prompts`` (a pattern) -> the manifest (one element),
    written to ``settings.out`` with every slice and rejects file under ``plan/``.

    Applied to the pipeline itself (``p | "Plan" >> Plan(settings)``); the files are
    matched when the pipeline is built. ``cap_hosts``: the hosts that will generate the
    run, when its per-device batch was just chosen by ``--per-device-batch auto`` (the
    most that fits a device): the plan lowers it to what the run can fill
    (``decide.decide_per_device_batch``).
    """

    def __init__(self, settings: Settings, cap_hosts: int | None = None):
        super().__init__()
        self.settings, self.cap_hosts = settings, cap_hosts

    def expand(self, pbegin):
        settings, out = self.settings, self.settings.out
        args = (settings.seed, input_root(settings.prompts), settings.prompt_field)
        listed = prompt_files(settings.prompts)
        matched = sorted(listed)
        ranges = duplicates.range_count(sum(duplicates.weighted_bytes(path, found.size)
                                            for path, found in listed.items()))
        files = (pbegin
                 | "MatchFiles" >> beam.Create(matched)
                 | "SpreadFiles" >> beam.Reshuffle())
        counts, drops, checked = files | "FirstPass" >> FirstPass(out, args, settings, ranges)
        layout = (counts
                  | "AllCounts" >> beam.CombineGlobally(beam.combiners.ToListCombineFn()).without_defaults()
                  | "Layout" >> beam.Map(make_layout, max(1, len(settings.sizes)))
                  | "Decide" >> beam.Map(decide, out, self.cap_hosts))
        placed = (drops
                  | "PlaceRecords" >> beam.ParDo(_PlaceFn(out, *args, key_labels(settings, matched), settings),
                                                 beam.pvalue.AsSingleton(layout))
                  .with_outputs(_PlaceFn.SHARED, _PlaceFn.KEYS, TEMPS, main="written"))
        joined = (placed[_PlaceFn.SHARED]
                  | "GroupShared" >> beam.GroupByKey()
                  | "JoinShared" >> beam.ParDo(_JoinPartsFn(out)))
        written = (placed.written, joined) | "AllSlices" >> beam.Flatten()
        indexed = placed[_PlaceFn.KEYS] | "PlanKeys" >> PlanKeys(out)
        temporaries = (*checked, placed[TEMPS]) | "Temporaries" >> beam.Flatten()
        return (layout, written, indexed, temporaries) | "WriteManifest" >> WriteManifest(out, settings)


def run_plan(settings: Settings, beam_args: list[str] | None = None, overwrite: bool = False,
             cap_hosts: int | None = None) -> dict:
    """Plan ``settings.prompts`` into ``settings.out``; returns the manifest.

    ``overwrite``: delete an earlier run in ``settings.out`` first (``prepare.prepare_out``).
    ``cap_hosts``: see ``Plan``. A resumed run whose plan is finished keeps it
    (``kept_plan``): nothing is read or written again. Logs ``plan_done`` with whether the
    plan was kept and the plan stage's seconds.
    """
    watch = logs.Stopwatch()
    resuming = not overwrite and runs.exists(settings.out)
    settings, _ = prepare(settings, overwrite)
    manifest = kept_plan(settings.out) if resuming else None
    kept = manifest is not None
    if not kept:
        # hosts check their checkpoint against this table instead of hashing it again;
        # planning just hashed it (model fingerprint), so this reads nothing
        storage.write_json(naming.model_files(settings.out), {"files": model_lib.model_table(settings.model)})
        p = beam.Pipeline(options=PipelineOptions(beam_args or []))
        _ = p | "Plan" >> Plan(settings, cap_hosts)
        result = p.run()
        result.wait_until_finish()
        logs.event("plan_counters", **counters(result))
        manifest = storage.read_json(naming.manifest(settings.out))
    asked = manifest.get("guided_by_records")
    if asked:  # a JSON event for logs, and the same as one line for people
        line = guided_by_records_line(asked)
        logs.event("guided_by_records", level=logging.WARNING, message=line, **asked)
        print(f"promptmill plan: {line}", file=sys.stderr)
    if not kept:  # settings the records give that play no part: said once, when planned
        for name, line in unused_lines(manifest, settings.model).items():
            logs.event(name, level=logging.WARNING, message=line, **manifest[name])
            print(f"promptmill plan: {line}", file=sys.stderr)
    logs.event("plan_done", out=settings.out, kept=kept, slices=manifest["slices"], seconds=round(watch.seconds(), 3))
    return manifest


def unused_lines(manifest: dict, model: str) -> dict[str, str]:
    """{event: the line for people} for the records whose own guidance scale, or whose
    negative prompt, plays no part, as the plan counted them (pure)."""
    lines = {}
    if manifest.get("guidance_unused"):
        asked = manifest["guidance_unused"]
        lines["guidance_unused"] = (f"{asked['records']} record(s) give a guidance_scale that {model} takes none of "
                                    f"(the first: {asked['first']}): recorded with each image and counted in the "
                                    f"dataset's stats, never used")
    if manifest.get("negative_prompts_unused"):
        asked = manifest["negative_prompts_unused"]
        lines["negative_prompts_unused"] = (f"{asked['records']} record(s) give a negative_prompt that plays no part "
                                            f"at their guidance on {model} (the first: {asked['first']}): counted in "
                                            f"the dataset's stats")
    return lines


def kept_plan(out: str) -> dict | None:
    """The manifest of the finished plan in ``out``, or None when there is none. Asked only
    once ``prepare`` has resumed the run there (its settings match run.json's, and the
    input table says no input changed): the manifest is written after every slice, so its
    plan is whole, and planning again would write the same bytes. A run without an input
    table (an earlier version's) is planned again: nothing says its inputs are the same.
    Logged as ``plan_kept``."""
    path = naming.manifest(out)
    if not storage.exists(path) or not storage.exists(naming.plan_inputs(out)):
        return None
    manifest = storage.read_json(path)
    logs.event("plan_kept", out=out, slices=manifest["slices"], records=manifest["records"],
               images=manifest["images"], rejects=manifest["rejects"])
    return manifest


def counters(result) -> dict:
    """The ``plan`` Beam counters of a finished pipeline, by name (committed values)."""
    from apache_beam.metrics.metric import MetricsFilter

    found = result.metrics().query(MetricsFilter().with_namespace("plan"))["counters"]
    totals: dict[str, int] = {}
    for counter in found:
        totals[counter.key.metric.name] = totals.get(counter.key.metric.name, 0) + counter.committed
    return dict(sorted(totals.items()))
