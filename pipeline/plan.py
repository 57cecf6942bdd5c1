"""``plan``: prompt shards in, fixed-size slices out (a Beam pipeline).

Stages, one PTransform each:
  ReadPromptRows   files matching the pattern -> (source, line, payload): raw line bytes
                   (jsonl, txt), a decoded row (csv, tsv, json, parquet) or a Reject
                   (``pipeline.inputs``)
  ValidateRows     -> Records, and Rejects (tagged 'rejects') with source, line, reason
  CutSlices        records -> (slice index, items) with global positions in
                   (source, line) order; a file's records are grouped to number them
  WriteSlices / WriteRejects / WriteManifest   under OUT/plan/
``run.json`` (resolved settings, model fingerprint, versions) is written first.
Inside the pipeline, files are read and written through Beam's FileSystems
(``pipeline.beamio``); before and after it, through ``pipeline.storage``.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
from importlib import metadata

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import __version__, beamio, inputs, logs, naming, records, slicing, storage
from pipeline.settings import Settings, fingerprint

_WILDCARD = re.compile(r"[*?\[]")


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


class _ReadRowsFn(beam.DoFn):
    def __init__(self, prompt_field: str):
        self.prompt_field = prompt_field

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, path: str):
        beamio.use_emulator_credentials()
        yield from inputs.read_rows(path, self.prompt_field)


class ReadPromptRows(beam.PTransform):
    """Files matching the pattern -> (source, line number, payload).

    The pattern is expanded with ``storage.glob`` (our match semantics: a folder lists
    the files under it, ``**``) when the pipeline is built; a file of an unknown format
    is a PlanError then. Each file is one element, read through Beam's FileSystems
    (local or gs://, ``.gz`` decompressed by name) by ``inputs.read_rows``: the payload
    is a raw line (jsonl, txt), a decoded row (csv, tsv, json, parquet) or a Reject.
    """

    def __init__(self, pattern: str, prompt_field: str = "prompt"):
        super().__init__()
        self.pattern, self.prompt_field = pattern, prompt_field

    def expand(self, pbegin):
        return (pbegin
                | "MatchFiles" >> beam.Create(match_prompt_files(self.pattern))
                | "SpreadFiles" >> beam.Reshuffle()
                | "ReadRows" >> beam.ParDo(_ReadRowsFn(self.prompt_field)))


def validate_payload(source: str, line: int, payload, run_seed: int, root: str,
                     prompt_field: str = "prompt") -> records.Record | records.Reject | None:
    """One element of ReadPromptRows to a Record, a Reject, or None (a blank line)."""
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


class _ValidateFn(beam.DoFn):
    def __init__(self, run_seed: int, root: str, prompt_field: str = "prompt"):
        self.run_seed, self.root, self.prompt_field = run_seed, root, prompt_field
        self.read = Metrics.counter("plan", "rows_read")
        self.rejected = Metrics.counter("plan", "rows_rejected")
        self.valid = Metrics.counter("plan", "records_valid")

    def process(self, row):
        source, line, payload = row
        result = validate_payload(source, line, payload, self.run_seed, self.root, self.prompt_field)
        if result is None:  # a blank line is not a row
            return
        self.read.inc()
        if isinstance(result, records.Reject):
            self.rejected.inc()
            yield beam.pvalue.TaggedOutput(ValidateRows.REJECTS, result)
        else:
            self.valid.inc()
            yield result


class ValidateRows(beam.PTransform):
    REJECTS = "rejects"

    def __init__(self, run_seed: int, root: str, prompt_field: str = "prompt"):
        super().__init__()
        self.run_seed, self.root, self.prompt_field = run_seed, root, prompt_field

    def expand(self, rows):
        return rows | "Validate" >> beam.ParDo(_ValidateFn(self.run_seed, self.root, self.prompt_field)).with_outputs(
            self.REJECTS, main="records")


def _file_offsets(counts: list[tuple[str, int]]) -> dict[str, int]:
    """First global position of each source, sources in sorted order."""
    offsets, total = {}, 0
    for source, count in sorted(counts):
        offsets[source] = total
        total += count
    return offsets


class _PlaceFn(beam.DoFn):
    def __init__(self, size: int):
        self.size = size
        self.planned = Metrics.counter("plan", "images_planned")

    def process(self, grouped, counts):
        source, file_records = grouped
        position = _file_offsets(counts)[source]
        for record in sorted(file_records, key=lambda r: r.line):
            for item in records.expand(record, position, self.size):
                self.planned.inc()
                yield item.slice, item
            position += record.num_images


class CutSlices(beam.PTransform):
    """Records -> (slice index, items sorted by position)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def expand(self, recs):
        counts = (recs
                  | "ImagesPerRecord" >> beam.Map(lambda r: (r.source, r.num_images))
                  | "ImagesPerSource" >> beam.CombinePerKey(sum))
        return (recs
                | "BySource" >> beam.Map(lambda r: (r.source, r))
                | "GroupSource" >> beam.GroupByKey()
                | "Place" >> beam.ParDo(_PlaceFn(self.size), counts=beam.pvalue.AsList(counts))
                | "GroupSlice" >> beam.GroupByKey()
                | "Order" >> beam.MapTuple(lambda index, items: (index, sorted(items, key=lambda i: i.position))))


def _jsonl(objects) -> str:
    return "".join(json.dumps(o, ensure_ascii=False, sort_keys=True) + "\n" for o in objects)


class WriteSlices(beam.PTransform):
    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def expand(self, slices):
        def write(index, items):
            beamio.write_text(naming.plan_slice(self.out, index), _jsonl(i.to_json() for i in items))
            return index

        return slices | "WriteSlice" >> beam.MapTuple(write)


class WriteRejects(beam.PTransform):
    """One rejects file per source, rows in line order; returns (reason, count) pairs."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def expand(self, rejects):
        def write(source, rows):
            rows = sorted(rows, key=lambda r: r.line)
            beamio.write_text(naming.rejects_file(self.out, source), _jsonl(r.to_json() for r in rows))
            return [r.reason for r in rows]

        return (rejects
                | "BySource" >> beam.Map(lambda r: (r.source, r))
                | "GroupSource" >> beam.GroupByKey()
                | "Write" >> beam.MapTuple(write)
                | "Reasons" >> beam.FlatMap(lambda reasons: reasons)
                | "CountReasons" >> beam.combiners.Count.PerElement())


class WriteManifest(beam.PTransform):
    def __init__(self, out: str, size: int):
        super().__init__()
        self.out, self.size = out, size

    def expand(self, inputs):
        recs, written_slices, reject_reasons = inputs

        def write(_, record_count, images, slice_ids, reasons):
            by_reason = dict(sorted(reasons))
            manifest = {"slice_size": self.size, "slices": len(slice_ids), "records": record_count,
                        "images": images, "rejects": sum(by_reason.values()), "rejects_by_reason": by_reason,
                        "input_rows": record_count + sum(by_reason.values())}
            if sorted(slice_ids) != list(range(len(slice_ids))):
                raise PlanError(f"slices are not contiguous: {sorted(slice_ids)[:10]}")
            beamio.write_json(naming.manifest(self.out), manifest)
            return manifest

        record_count = recs | "CountRecords" >> beam.combiners.Count.Globally()
        images = (recs | "Images" >> beam.Map(lambda r: r.num_images)
                  | "SumImages" >> beam.CombineGlobally(sum))
        return (recs.pipeline
                | "Once" >> beam.Create([None])
                | "Write" >> beam.Map(write, beam.pvalue.AsSingleton(record_count), beam.pvalue.AsSingleton(images),
                                      beam.pvalue.AsList(written_slices), beam.pvalue.AsList(reject_reasons)))


def build(p, pattern: str, out: str, settings: Settings):
    """The plan pipeline on ``p``; returns the PCollection of the manifest."""
    rows = p | "ReadPromptRows" >> ReadPromptRows(pattern, settings.prompt_field)
    validated = rows | "ValidateRows" >> ValidateRows(settings.seed, input_root(pattern), settings.prompt_field)
    recs = validated.records
    written = (recs | "CutSlices" >> CutSlices(settings.slice_size)
               | "WriteSlices" >> WriteSlices(out))
    reasons = validated[ValidateRows.REJECTS] | "WriteRejects" >> WriteRejects(out)
    return (recs, written, reasons) | "WriteManifest" >> WriteManifest(out, settings.slice_size)


def _versions() -> dict:
    names = ("jax", "jaxlib", "flax", "diffusers", "transformers", "apache-beam", "numpy", "pillow", "pyarrow")
    found = {"promptmill": __version__}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def resolve_settings(settings: Settings) -> tuple[Settings, dict]:
    """Settings with the model's defaults filled in, and the run.json document."""
    from pipeline import model

    settings.validate()
    described = model.describe(settings.model)
    size = described["native_size"]
    settings = settings.replace(width=settings.width or size, height=settings.height or size,
                                scheduler=settings.scheduler or described["scheduler"]).validate()
    run = {"settings": settings.to_dict(), "model_fingerprint": described["fingerprint"],
           "scheduler": settings.scheduler, "settings_fingerprint": fingerprint(settings, described["fingerprint"]),
           "versions": _versions(), "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    return settings, run


def prepare_out(out: str, run: dict, overwrite: bool = False) -> dict:
    """Make ``out`` ready for ``run``; returns the run.json document in force.

    * An empty OUT gets ``run``.
    * An OUT holding the same run (same settings fingerprint) is resumed: its run.json,
      and so its ``created_at``, is kept, so every rewritten object has the same bytes.
    * An OUT holding a run with other settings is refused, since it would mix two runs'
      slices in one dataset, unless ``overwrite``.
    ``overwrite`` deletes everything promptmill wrote under OUT (``naming.OWNED``) first.
    """
    path = naming.run_json(out)
    if overwrite:
        deleted = sum(storage.delete_prefix(naming.join(out, name)) for name in naming.OWNED)
        if deleted:
            logs.event("overwrite", out=out, objects_deleted=deleted)
    elif storage.exists(path):
        previous = storage.read_json(path)
        if previous.get("settings_fingerprint") == run["settings_fingerprint"]:
            return previous
        settings = json.loads(json.dumps(run["settings"]))  # as stored: tuples become lists
        changed = sorted(k for k, v in settings.items()
                         if k != "out" and previous.get("settings", {}).get(k) != v)  # a moved OUT is the same run
        if previous.get("model_fingerprint") != run["model_fingerprint"]:
            changed.append("model weights")
        raise PlanError(f"{out} already holds a run with other settings (changed: {', '.join(changed)}); "
                        "use another --out, or add --overwrite to delete the old run and start over")
    storage.write_json(path, run)
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
    options = PipelineOptions(beam_args or [])
    with beam.Pipeline(options=options) as p:
        build(p, settings.prompts, settings.out, settings)
    return storage.read_json(naming.manifest(settings.out))
