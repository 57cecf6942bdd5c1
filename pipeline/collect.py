"""``collect``: committed shards in, a verified dataset out (a Beam pipeline).

Joins, by key, the planned items (``plan/slices``), the metadata rows of committed
slices (those with ``shards/NNNNN_stats.json``) and the image files, and classifies
every key: ok, missing (planned, no row or no image), duplicated (more than one row),
or unexpected (a row that was never planned). Writes ``dataset/metadata.parquet`` and
``dataset/stats.json``; ``run_collect`` raises ``CollectError`` naming the bad keys.
Inside the pipeline, objects are read and written through Beam's FileSystems
(``pipeline.beamio``); listings are expanded with ``storage.glob`` when the pipeline
is built, and ``run_collect`` reads the manifest and stats with ``pipeline.storage``.
"""
from __future__ import annotations

import json

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import beamio, naming, storage, writer

MAX_KEYS_IN_MESSAGE = 20


class CollectError(RuntimeError):
    pass


def _read_lines(path: str):
    for raw in beamio.iter_lines(path):
        if raw.strip():
            yield json.loads(raw)


def _read_parquet_rows(path: str) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(beamio.read_bytes(path))).to_pylist()


def _key_of_image(path: str) -> str:
    return path.rsplit("/", 1)[-1].rsplit(".", 1)[0]


def classify(key: str, grouped: dict) -> tuple[str, dict | None]:
    """The verdict for one key: ('ok', row) or (problem, None).

    ``grouped["images"]`` is absent when the run writes no image files (its other
    formats are written whole per slice, before the slice's commit marker).
    """
    planned, rows = list(grouped["planned"]), list(grouped["rows"])
    if not planned:
        return "unexpected", None
    if len(planned) > 1 or len(rows) > 1:
        return "duplicated", None
    if not rows or ("images" in grouped and not list(grouped["images"])):
        return "missing", None
    return "ok", rows[0]


class _ClassifyFn(beam.DoFn):
    def __init__(self):
        self.counters = {}

    def process(self, element):
        key, grouped = element
        verdict, row = classify(key, grouped)
        if verdict not in self.counters:
            self.counters[verdict] = Metrics.counter("collect", f"keys_{verdict}")
        self.counters[verdict].inc()
        if verdict == "ok":
            yield row
        else:
            yield beam.pvalue.TaggedOutput("problems", (verdict, key))


class VerifyKeys(beam.PTransform):
    """{planned, rows, images} keyed collections -> ok rows, and (problem, key) pairs."""

    def expand(self, keyed):
        return (keyed
                | "Join" >> beam.CoGroupByKey()
                | "Classify" >> beam.ParDo(_ClassifyFn()).with_outputs("problems", main="rows"))


def _write_dataset(_, rows, problems, slice_stats, manifest, out):
    rows = sorted(rows, key=lambda r: r["position"])
    beamio.write_bytes(naming.dataset_file(out, "metadata.parquet"), writer.parquet_bytes(rows))
    by_kind: dict[str, list[str]] = {}
    for kind, key in sorted(problems):
        by_kind.setdefault(kind, []).append(key)
    hosts: dict[int, dict] = {}
    for stats in slice_stats:
        host = hosts.setdefault(stats["host"], {"images": 0, "seconds": 0.0, "slices": 0})
        host["images"] += stats["images"]
        host["seconds"] += stats["seconds"]
        host["slices"] += 1
    for host in hosts.values():
        host["images_per_s"] = round(host["images"] / host["seconds"], 3) if host["seconds"] else None
    stats = {
        "verified": not by_kind, "images": len(rows), "records": manifest["records"],
        "planned_images": manifest["images"], "rejects": manifest["rejects"],
        "rejects_by_reason": manifest["rejects_by_reason"], "input_rows": manifest["input_rows"],
        "slices": manifest["slices"], "committed_slices": len(slice_stats),
        "problems": {kind: {"count": len(keys), "keys": keys[:MAX_KEYS_IN_MESSAGE]} for kind, keys in by_kind.items()},
        "hosts": {str(h): v for h, v in sorted(hosts.items())},
        "compiles_after_warmup": sum(s.get("compiles_after_warmup", 0) for s in slice_stats),
    }
    beamio.write_json(naming.dataset_file(out, "stats.json"), stats)


def build(p, out: str, manifest: dict, image_files: bool = True):
    # Listings are expanded here with storage.glob (Beam's match semantics differ, see
    # pipeline.beamio); every object is read inside the pipeline through beamio.
    planned = (p
               | "MatchPlan" >> beam.Create(storage.glob(naming.join(out, "plan", "slices", "*.jsonl")))
               | "PlanItems" >> beam.FlatMap(_read_lines)
               | "KeyPlanned" >> beam.Map(lambda item: (item["key"], item["slice"])))
    slice_stats = (p
                   | "MatchCommits" >> beam.Create(storage.glob(naming.join(out, "shards", "*_stats.json")))
                   | "ReadCommits" >> beam.Map(beamio.read_json))
    rows = (slice_stats
            | "ReadShard" >> beam.FlatMap(lambda s: _read_parquet_rows(naming.shard_metadata(out, s["slice"])))
            | "KeyRows" >> beam.Map(lambda row: (row["key"], row)))
    keyed = {"planned": planned, "rows": rows}
    if image_files:
        keyed["images"] = (p
                           | "MatchImages" >> beam.Create(storage.glob(naming.join(out, "images", "*", "*")))
                           | "KeyImages" >> beam.Map(lambda path: (_key_of_image(path), path)))
    verified = keyed | "VerifyKeys" >> VerifyKeys()
    (p
     | "Once" >> beam.Create([None])
     | "WriteDataset" >> beam.Map(_write_dataset, beam.pvalue.AsList(verified.rows),
                                  beam.pvalue.AsList(verified.problems), beam.pvalue.AsList(slice_stats),
                                  manifest, out))


def run_collect(out: str, beam_args: list[str] | None = None) -> dict:
    """Collect ``out`` into ``out/dataset``; returns stats, or raises CollectError."""
    beamio.require_filesystem(out)
    manifest_path = naming.manifest(out)
    if not storage.exists(manifest_path):
        raise CollectError(f"{manifest_path} does not exist: nothing was planned in {out}")
    manifest = storage.read_json(manifest_path)
    settings = storage.read_json(naming.run_json(out))["settings"]
    with beam.Pipeline(options=PipelineOptions(beam_args or [])) as p:
        build(p, out, manifest, image_files="files" in settings.get("formats", ["files"]))
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    if not stats["verified"]:
        lines = [f"{kind}: {v['count']} key(s), e.g. {', '.join(v['keys'])}" for kind, v in stats["problems"].items()]
        raise CollectError("the dataset does not match the plan:\n  " + "\n  ".join(lines))
    return stats
