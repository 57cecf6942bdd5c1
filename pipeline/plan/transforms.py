"""``plan``: prompt shards in, fixed-size slices out (a Beam pipeline that streams).

No stage ever holds the prompts of the whole input, nor of one whole file: each file
is read twice, one row at a time, and only small summaries and file names cross a
shuffle. At most one slice of items is in memory at a time. ``Plan`` composes the
stages (prompt pattern -> the manifest); the per-file logic they run is in
``pipeline.plan.layout``.

  MatchFiles     the prompt pattern -> its files (``layout.match_prompt_files``)
  ScanFiles      each file -> a ``FileScan`` (``layout.scan_file``): its row count, rejects
                 by reason, and for each valid record its line, image count and 16-byte
                 hashes of its id and (with --dedupe) prompt; the arrays go to
                 ``plan/scans/`` and only the file's name crosses the shuffle
  Layout         every FileScan -> a ``Layout`` (``layout.make_layout``, pure): later
                 records with an id already used are rejected (``duplicate_id``); with
                 ``--dedupe``, later records whose prompt was already seen are rejected
                 (``duplicate_prompt``); each file's first global position, in (source,
                 line) order; whether any kept record's guidance is > 1
  Decide         the Layout -> ``run.json`` gets ``guided``: the run's program is the
                 guided one if any kept record is, else the guidance-free one
                 (``decide_guidance``); and, for a ``--per-device-batch auto`` chosen
                 for this plan (``cap_hosts``), a per-device batch no larger than the run
                 can fill (``decide_per_device_batch``), hence the slice size; before any
                 slice is written
  PlaceRecords   each file again, with the Layout -> its rejects file, every slice that
                 lies wholly inside the file (written at once), and a part file of each
                 slice it shares with other files (at most two per file)
  JoinShared     (slice, part file) pairs grouped by slice -> the parts concatenated in
                 position order into the slice, then deleted
  PlanKeys       every written slice -> the plan's key index, ``plan/keys/`` (key -> slice,
                 position; ``pipeline.plan.index``)
  WriteManifest  once every slice and the key index are written -> ``plan/manifest.json``

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
from pipeline.core.settings import NO_CFG_RULES, Settings, guided_by_records_line
from pipeline.io import beamio, runs, storage
from pipeline.model import load as model_lib
from pipeline.model.sampling import guidance as guidance_rules
from pipeline.plan.layout import (
    Layout,
    PlanError,
    input_root,
    relative_source,
    load_scan,
    make_layout,
    match_prompt_files,
    save_scan,
    scan_file,
    validated,
)
from pipeline.plan.index import PlanKeys
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


class _ScanFn(beam.DoFn):
    """Scans one file and saves its arrays; yields where they are (the Beam runner
    never holds, copies or pickles the arrays)."""

    def __init__(self, out: str, run_seed: int, root: str, prompt_field: str, sizes: tuple[str, ...], dedupe: bool,
                 default_guidance: float, rule: str = "diffusers"):
        self.out, self.args, self.rule, self.sizes = out, (run_seed, root, prompt_field, dedupe, default_guidance), \
            rule, sizes
        self.read = Metrics.counter("plan", "rows_read")

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, path: str):
        scan = scan_file(path, *self.args, rule=self.rule, sizes=self.sizes)
        self.read.inc(scan.rows)
        saved = naming.plan_scan(self.out, path)
        save_scan(scan, saved)
        yield saved


def key_labels(settings: Settings, paths: list[str]) -> dict[str, str] | None:
    """{relative path: label} of the run's prompt files (``naming.file_labels``) when its
    records without an id get readable keys (``key_names`` "readable"), else None."""
    if settings.key_names != "readable":
        return None
    root = input_root(settings.prompts)
    return naming.file_labels(relative_source(path, root) for path in paths)


def layout_of_saved(paths: list[str], dedupe: bool, num_buckets: int = 1) -> Layout:
    """``make_layout`` over the saved scans, which are then deleted."""
    layout = make_layout([load_scan(path) for path in paths], dedupe, num_buckets)
    beamio.delete(paths)
    return layout


def decide(layout: Layout, out: str, cap_hosts: int | None = None) -> Layout:
    """``decide_guidance``, then ``decide_per_device_batch``; the layout with the run's
    slice size, as run.json now holds it."""
    layout = decide_guidance(layout, out)
    settings = decide_per_device_batch(layout, out, cap_hosts)
    sizes = [slicing.slice_size(settings.devices_per_host, batch, settings.batches_per_slice)
             for _, _, batch in settings.buckets()]
    return dataclasses.replace(layout, slice_size=settings.slice_size, bucket_slice_sizes=sizes)


def decide_per_device_batch(layout: Layout, out: str, cap_hosts: int | None) -> Settings:
    """The run's settings, once ``out``'s run.json holds a per-device batch no larger than
    the run can fill on ``cap_hosts`` hosts (``slicing.most_per_device``), when the batch
    was chosen by ``--per-device-batch auto`` for this plan (``cap_hosts`` not None; a
    resumed run keeps the batch its slices were cut with). Logged as
    ``per_device_batch_capped`` when lowered."""
    run = runs.read(out)
    settings = run.settings
    if cap_hosts is None:
        return settings
    fits = [batch for _, _, batch in settings.buckets()]
    most = [slicing.most_per_device(images, cap_hosts, settings.devices_per_host)
            for images in layout.bucket_images or [layout.images]]
    capped = [min(fit, top) for fit, top in zip(fits, most)]
    if capped == fits:
        return settings
    for (width, height, fit), top, images in zip(settings.buckets(), most, layout.bucket_images or [layout.images]):
        if fit > top:
            logs.event("per_device_batch_capped", out=out, fits=fit, per_device_batch=top, images=images,
                       hosts=cap_hosts, devices_per_host=settings.devices_per_host,
                       **({"size": f"{width}x{height}"} if settings.sizes else {}))
    settings = settings.replace(per_device_batch=capped[0],
                                bucket_batches=tuple(capped) if settings.bucket_batches else ()).validate()
    runs.write(out, run.with_settings(settings))
    return settings


def decide_guidance(layout: Layout, out: str) -> Layout:
    """Record in ``out``'s run.json whether the run is guided (some kept record has
    guidance > 1, or the run guides every image under the older rule); returns the
    layout. A run that already recorded the other choice is refused: its images would
    mix two programs."""
    run = runs.read(out)
    settings = run.settings
    if settings.guidance_rule in NO_CFG_RULES:  # a family without classifier-free guidance: decided when prepared
        return layout
    guided = layout.guided or settings.guidance_rule == "always"
    if guided and not guidance_rules.asks(settings.guidance_rule, settings.guidance_scale):
        layout = dataclasses.replace(layout, guided_by_records=True)  # the manifest and status say so
    if settings.guided is None:
        settings = settings.replace(guided=guided).validate()
        runs.write(out, run.with_settings(settings))
        logs.event("guidance_decided", out=out, guided=guided)
    elif settings.guided != guided:
        planned = "guided" if settings.guided else "guidance-free"
        above = guidance_rules.threshold(settings.guidance_rule)
        now = f"some record's guidance is > {above}" if guided else f"no record's guidance is > {above}"
        raise PlanError(f"{out} holds a {planned} run, but now {now}: the run's images would mix two programs; "
                        "use another --out, or add --overwrite to start over")
    return layout


class _PlaceFn(beam.DoFn):
    """The second pass over one file: rejects, whole slices, and the shared slices' items."""
    SHARED = "shared"

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

    def process(self, path: str, layout: Layout):
        geometry = layout.geometry(self.settings)
        drops = layout.drops.get(path, {})
        count = len(geometry.buckets)
        first = layout.bucket_first.get(path, [0] * count)
        end = [f + n for f, n in zip(first, layout.file_bucket_images.get(path, [0] * count))]
        # per bucket: the next position, the slice being gathered and its items
        position, current, pending = list(first), [None] * count, [[] for _ in range(count)]
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
                b, bucket = result.bucket, geometry.buckets[result.bucket]
                for item in records.expand(result, position[b], bucket.slice_size, self.labels,
                                           (bucket.offset, bucket.first_slice)):
                    if item.slice != current[b]:
                        yield from self._flush(current[b], pending[b], first[b], end[b], geometry)
                        current[b], pending[b] = item.slice, []
                    pending[b].append(item)
                self.images.inc(result.num_images)
                position[b] += result.num_images
        for b in range(count):
            yield from self._flush(current[b], pending[b], first[b], end[b], geometry)
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


class WriteManifest(beam.PTransform):
    def __init__(self, out: str, settings: Settings | None = None):
        super().__init__()
        self.out, self.settings = out, settings

    def expand(self, inputs):
        layout, written, indexed = inputs
        settings = self.settings

        def write(_, layout: Layout, slice_ids, _indexed):
            rejects = sum(layout.rejects_by_reason.values())
            manifest = {"slice_size": layout.slice_size, "slices": len(slice_ids), "records": layout.records,
                        "images": layout.images, "rejects": rejects, "rejects_by_reason": layout.rejects_by_reason,
                        "input_rows": layout.rows, "input_files": len(layout.first)}
            expected = slicing.num_slices(layout.images, layout.slice_size)
            if settings is not None and settings.sizes:  # each size's records, images, slices and batch
                geometry = layout.geometry(runs.read(self.out).settings)
                manifest["buckets"] = [bucket.to_json() for bucket in geometry.buckets]
                expected = geometry.slices
            if layout.guided_by_records:
                manifest["guided_by_records"] = {"records": layout.guided_records, "first": layout.first_guided}
            if layout.records + rejects != layout.rows:
                raise PlanError(f"{layout.rows} input rows, but {layout.records} records and {rejects} rejects")
            if sorted(slice_ids) != list(range(expected)):
                raise PlanError(f"slices are not contiguous: {sorted(slice_ids)[:10]}")
            beamio.write_json(naming.manifest(self.out), manifest)
            return manifest

        return (written.pipeline
                | "Once" >> beam.Create([None])
                | "Write" >> beam.Map(write, beam.pvalue.AsSingleton(layout), beam.pvalue.AsList(written),
                                      beam.pvalue.AsList(indexed)))



class Plan(beam.PTransform):
    """The plan pipeline: ``settings.prompts`` (a pattern) -> the manifest (one element),
    written to ``settings.out`` with every slice and rejects file under ``plan/``.

    Applied to the pipeline itself (``p | "Plan" >> Plan(settings)``); the files are
    matched when the pipeline is built. ``cap_hosts``: the hosts that will generate the
    run, when its per-device batch was just chosen by ``--per-device-batch auto`` (the
    most that fits a device): the plan lowers it to what the run can fill
    (``decide_per_device_batch``).
    """

    def __init__(self, settings: Settings, cap_hosts: int | None = None):
        super().__init__()
        self.settings, self.cap_hosts = settings, cap_hosts

    def expand(self, pbegin):
        settings, out = self.settings, self.settings.out
        dedupe = settings.dedupe
        args = (settings.seed, input_root(settings.prompts), settings.prompt_field)
        sizes, num_buckets = settings.sizes, max(1, len(settings.sizes))
        matched = match_prompt_files(settings.prompts)
        labels = key_labels(settings, matched)
        files = (pbegin
                 | "MatchFiles" >> beam.Create(matched)
                 | "SpreadFiles" >> beam.Reshuffle())
        layout = (files
                  | "ScanFiles" >> beam.ParDo(_ScanFn(out, *args, sizes, dedupe, settings.guidance_scale,
                                                      settings.guidance_rule))
                  | "AllScans" >> beam.combiners.ToList()
                  | "Layout" >> beam.Map(layout_of_saved, dedupe, num_buckets)
                  | "Decide" >> beam.Map(decide, out, self.cap_hosts))
        placed = (files
                  | "PlaceRecords" >> beam.ParDo(_PlaceFn(out, *args, labels, settings), beam.pvalue.AsSingleton(layout))
                  .with_outputs(_PlaceFn.SHARED, main="written"))
        joined = (placed[_PlaceFn.SHARED]
                  | "GroupShared" >> beam.GroupByKey()
                  | "JoinShared" >> beam.ParDo(_JoinPartsFn(out)))
        written = (placed.written, joined) | "AllSlices" >> beam.Flatten()
        indexed = written | "PlanKeys" >> PlanKeys(out, layout)
        return (layout, written, indexed) | "WriteManifest" >> WriteManifest(out, settings)


def run_plan(settings: Settings, beam_args: list[str] | None = None, overwrite: bool = False,
             cap_hosts: int | None = None) -> dict:
    """Plan ``settings.prompts`` into ``settings.out``; returns the manifest.

    ``overwrite``: delete an earlier run in ``settings.out`` first (``prepare.prepare_out``).
    ``cap_hosts``: see ``Plan``.
    """
    settings, _ = prepare(settings, overwrite)
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
    return manifest


def counters(result) -> dict:
    """The ``plan`` Beam counters of a finished pipeline, by name (committed values)."""
    from apache_beam.metrics.metric import MetricsFilter

    found = result.metrics().query(MetricsFilter().with_namespace("plan"))["counters"]
    totals: dict[str, int] = {}
    for counter in found:
        totals[counter.key.metric.name] = totals.get(counter.key.metric.name, 0) + counter.committed
    return dict(sorted(totals.items()))
