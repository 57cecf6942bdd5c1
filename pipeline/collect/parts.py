"""One part of the dataset: a contiguous range of slices verified and written by one step.

Collect cuts the plan's slices into parts of about ``part_rows`` images (``PartPlan``,
pure), and ``CollectPartFn`` runs each part on its own, in parallel with the others: for
each of its slices, in order, it reads the plan's items, the slice's commit marker and
metadata shard, and the listings of the slice's objects (never an image), verifies every
key (``verify.verify_slice``) and checks each object the slice wrote whole against the
size its marker recorded; then it

  * appends the slice's rows (every image made, a dropped one with its reason, in
    position order) to ``dataset/metadata/part-NNNNN.parquet``, in row groups of
    ``row_group_rows`` (so a part holds at most one row group in memory);
  * writes the slice's ``images/SLICE/metadata.jsonl`` (``--format files``: the
    ``imagefolder`` builder's) and its chunk of ``zarr/key`` (``--format zarr``);
  * yields, as (kind, value) pairs: the slice's summary (``SUMMARY``: counts, at most
    ``MAX_KEYS_IN_MESSAGE`` problem keys of each kind, its scores), where its rows are in the
    part (``PLACE``: for the key index, ``place_keys``) and, once a part is done, its gallery
    candidates (``GALLERY``: the rows of the positions the plan-time sample picks, or a
    bounded top-k of a score).

Nothing here holds more than a row group and a few slices read ahead, however large the
run. The key index is then written bucket by bucket from the plan's own (key -> slice,
position) and the slices' places (``place_keys``): no key crosses a shuffle.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import json
import logging
import math

import apache_beam as beam
import pyarrow
from apache_beam.metrics import Metrics

from pipeline.collect import gallery
from pipeline.collect.stats import HOST_TIMES, MAX_KEYS_IN_MESSAGE
from pipeline.collect.verify import ACCOUNTED, VERDICTS, unused_guidance, unused_negatives, verify_slice
from pipeline.core import buckets, choices, filters, logs, naming
from pipeline.core.settings import Run
from pipeline.generate import environment as environment_lib
from pipeline.io import beamio, inventory, runs, storage
from pipeline.output import formats, key_index, writer

PART_ROWS = 1_000_000  # images a part holds, about: whole slices
ROW_GROUP_ROWS = 100_000  # rows a row group of a part holds (the last of a part: fewer)
SUMMARY, PLACE, GALLERY = "slice", "place", "gallery"  # the kinds of what a part's step yields
HOST_FIELDS = ("host", "images", "seconds", *HOST_TIMES, "started_ts", "committed_ts", "finished_at")
READ_AHEAD = 8  # slices read while the one before is written
VERIFY_COLUMNS = ("key", "dropped", "settings_fingerprint", "environment", "image_bytes", "image_md5")
GALLERY_COLUMNS = ("key", "prompt", "seed", "width", "height", "slice", "position", "path", "dropped", "nsfw",
                   "clip_similarity", "aesthetic", "nsfw_score")


@dataclasses.dataclass(frozen=True)
class PartPlan:
    """How collect cuts a plan into parts, and what each part's step needs to know (pure)."""
    slices: int  # the plan's slices
    slices_per_part: int
    row_group_rows: int
    images: int  # the plan's images: the key index's buckets, the gallery's sample
    gallery_shown: int  # images the gallery shows at most (0: no gallery)
    gallery_order: str = "position"

    @classmethod
    def of(cls, manifest: dict, part_rows: int = PART_ROWS, gallery_shown: int = 0,
           gallery_order: str = "position") -> "PartPlan":
        if not isinstance(part_rows, int) or isinstance(part_rows, bool) or part_rows < 1:
            raise ValueError(f"--part-rows must be a whole number >= 1, got {part_rows!r}")
        largest = max([b["slice_size"] for b in manifest.get("buckets") or ()] or [manifest["slice_size"]])
        return cls(manifest["slices"], max(1, part_rows // largest), min(part_rows, ROW_GROUP_ROWS),
                   manifest["images"], gallery_shown, gallery_order)

    @property
    def parts(self) -> int:
        return max(1, math.ceil(self.slices / self.slices_per_part))

    def slices_of(self, part: int) -> range:
        first = part * self.slices_per_part
        return range(first, min(first + self.slices_per_part, self.slices))

    def describe(self) -> dict:
        """stats.json's ``parts``."""
        return {"count": self.parts, "slices_per_part": self.slices_per_part, "row_group_rows": self.row_group_rows}


@dataclasses.dataclass
class SliceFiles:
    """What collect reads of one slice: its plan items, marker, rows, and listings."""
    index: int
    items: list[dict]
    marker: dict | None
    table: object  # pyarrow Table of its metadata shard, or None
    images: dict | None  # {path: {"size", "md5"}} of its image files; None: the run writes none
    objects: dict  # {path: {"size", "md5"}} of its whole objects that are there
    unreadable: str | None = None  # a committed slice whose marker or metadata cannot be read: how to redo it


def read_slice(out: str, run: Run, index: int) -> SliceFiles:
    """One slice's files, from reads of its plan items, marker and metadata shard, and
    listings of everything else (``inventory.listed_objects``)."""
    items = [{name: item[name] for name in ("key", "image_index")}  # what verifying needs of each item
             for item in (json.loads(raw) for raw in beamio.iter_lines(naming.plan_slice(out, index)) if raw.strip())]
    marker_path = naming.shard_stats(out, index)
    objects = inventory.listed_paths([marker_path, *writer.whole_objects(out, run.settings, index)])
    committed = marker_path in objects
    table, images = None, None
    shard = naming.shard_metadata(out, index)
    try:
        marker = beamio.read_json(marker_path) if committed else None
        if committed and shard in objects:
            table = writer.parquet_table(beamio.read_bytes(shard))
    except (ValueError, OSError, pyarrow.ArrowException) as e:  # a torn or foreign object of a committed slice
        redo = (f"slice {index}'s commit marker or metadata cannot be read ({type(e).__name__}: {str(e)[:200]}); "
                f"delete {marker_path} and run the same command again: the slice is made again")
        logs.event("slice_unreadable", logging.ERROR, slice=index, redo=redo)
        return SliceFiles(index, items, None, None, None, objects, redo)
    if committed and "files" in run.settings.formats:
        images = {path: listed for path, listed in inventory.listed_objects(naming.images_dir(out, index) + "/").items()
                  if not path.endswith("/metadata.jsonl")}
    return SliceFiles(index, items, marker, table, images, objects)


def broken_objects(out: str, files: SliceFiles) -> tuple[str, list[str]] | None:
    """("missing" or "damaged", the objects' names) when a whole object of a committed
    slice is not there, or not of the size its commit marker recorded; else None (pure)."""
    recorded = (files.marker or {}).get("objects", {})
    missing, damaged = [], []
    for name, size in sorted(recorded.items()):
        listed = files.objects.get(naming.join(out, name))
        if listed is None:
            missing.append(name)
        elif listed["size"] != size:
            damaged.append(name)
    if missing:
        return "missing", missing
    return ("damaged", damaged) if damaged else None


def conformed(table):
    """``table`` with the metadata schema's columns in order (``writer.metadata_schema``)."""
    import pyarrow as pa

    schema = writer.metadata_schema()
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
               else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def check_slice(out: str, run: Run, files: SliceFiles, environment: str | None = None
                ) -> tuple[dict[str, list[str]], object]:
    """(keys by verdict, the table of the slice's accounted rows in position order);
    ``environment``: the fingerprint every row must carry (``pipeline.generate.environment``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if files.unreadable:  # none of its keys is accounted for
        verdicts = {v: [] for v in VERDICTS}
        verdicts["unreadable"] = sorted(item["key"] for item in files.items)
        return verdicts, conformed(pa.table({"key": pa.array([], pa.string())}))
    rows = files.table.select(list(VERIFY_COLUMNS)).to_pylist() if files.table is not None else []
    verdicts = verify_slice([item["key"] for item in files.items], rows, files.images, run.settings_fingerprint,
                            environment)
    broken = broken_objects(out, files) if files.marker is not None else None
    if files.marker is not None and files.table is None:
        broken = broken or ("missing", [naming.shard_metadata(out, files.index)])
    if broken:  # a whole object is missing or damaged: no key of the slice is where it should be
        verdicts[broken[0]] = sorted(verdicts[broken[0]] + verdicts["ok"] + verdicts["dropped"])
        verdicts["ok"], verdicts["dropped"] = [], []
    good = set(verdicts["ok"]) | set(verdicts["dropped"])
    if not good:
        return verdicts, conformed(pa.table({"key": pa.array([], pa.string())}))
    table = files.table.filter(pc.is_in(files.table.column("key"), pa.array(sorted(good), pa.string())))
    return verdicts, conformed(table.sort_by("position"))


def slice_summary(run: Run, files: SliceFiles, verdicts: dict, table, size: int) -> dict:
    """The slice's summary, as ``stats.Tally`` folds it (``size``: its size's index)."""
    import pyarrow.compute as pc

    settings = run.settings
    dropped = set(verdicts["dropped"])
    light = table.select(["image_index", "negative_prompt", "guidance_scale", "prompt_truncated"]).to_pylist()
    negatives = unused_negatives(light, settings.guidance_rule)
    guidance = unused_guidance(light, settings.guidance_rule)
    summary = {"slice": files.index, "size": size, "slices": 1, "planned_images": len(files.items),
               "records": sum(1 for item in files.items if item["image_index"] == 0), "ok": len(verdicts["ok"]),
               "problems": {kind: {"count": len(keys), "keys": keys[:MAX_KEYS_IN_MESSAGE]}
                            for kind, keys in verdicts.items() if kind not in ACCOUNTED and keys},
               "truncated_images": sum(1 for row in light if row["prompt_truncated"]),
               "truncated_records": sum(1 for row in light if row["prompt_truncated"] and row["image_index"] == 0),
               "unused_negative_records": negatives[0], "unused_negative_images": negatives[1],
               "unused_guidance_records": guidance[0], "unused_guidance_images": guidance[1]}
    if files.unreadable:
        summary["unreadable"] = files.unreadable
    if filters.active_rules(settings):  # the images a filter kept out, by rule
        reasons = table.filter(pc.is_valid(table.column("dropped"))).column("dropped").to_pylist()
        summary.update(dropped=len(dropped), dropped_by_rule=dict(collections.Counter(
            rule for reason in reasons for rule in filters.rules_of(reason))))
    if files.marker is not None:  # the figures per host that stats.json sums (not the marker's indexes)
        summary.update(committed_slices=1, compiles_after_warmup=files.marker.get("compiles_after_warmup", 0),
                       host_stats={name: files.marker[name] for name in HOST_FIELDS if name in files.marker})
    if settings.scores:
        summary["scores"] = {name: table.column(name).drop_null().to_numpy()
                             for name in ("clip_similarity", "aesthetic", "nsfw_score")}
        summary["flagged"] = sum(1 for v in table.column("nsfw").to_pylist() if v)
    return summary


def image_lines(rows: list[dict], scores) -> bytes:
    """A slice's ``images/SLICE/metadata.jsonl`` lines for its metadata ``rows`` (a ``files``
    run's): one per image file (a dropped image has none), its ``file_name`` relative to
    the slice's folder and the row's columns (the score columns of the ``scores`` the run
    computes; ``dropped``, always null here, left out): what the ``imagefolder`` builder
    reads with the images."""
    skipped = {"dropped"} | {c for name, columns in choices.SCORE_COLUMNS.items() if name not in scores
                             for c in columns}
    lines = []
    for row in rows:
        if row["dropped"] is not None or not row["path"].startswith("images/"):
            continue
        line = {"file_name": row["path"].rsplit("/", 1)[-1]}
        line.update((name, value) for name, value in row.items() if name not in skipped)
        lines.append(json.dumps(line, ensure_ascii=False) + "\n")
    return "".join(lines).encode("utf-8")


def write_slice_outputs(out: str, run: Run, geometry, files: SliceFiles, table, grouped: bool) -> None:
    """The slice's own outputs of collect: its ``metadata.jsonl`` (files) and its chunk of
    ``zarr/key`` (zarr; ``grouped``: in its size's group, a run of several sizes), each
    written whole."""
    settings = run.settings
    if "files" in settings.formats and table.num_rows:
        lines = image_lines(table.to_pylist(), settings.scores)
        if lines:
            beamio.write_bytes(naming.images_metadata(out, files.index), lines, "application/jsonl")
    if "zarr" in settings.formats:
        bucket = geometry.buckets[geometry.bucket_of_slice(files.index)]
        group = bucket.name if grouped else ""
        start, stop = geometry.slice_span(files.index)
        found = dict(zip(table.column("position").to_pylist(), table.column("key").to_pylist()))
        formats.write_zarr_key_chunk(out, [found.get(p, "") for p in range(start, stop)], bucket.images,
                                     bucket.slice_size, (start - bucket.offset) // bucket.slice_size, group)


class CollectPartFn(beam.DoFn):
    """A part's index (and the manifest, a side input) -> (``SUMMARY``, a slice's summary),
    (``PLACE``, its place in the part) and (``GALLERY``, a candidate row); writes the
    part, and each slice's own outputs. ``plan_args``: ``PartPlan.of``'s after the manifest."""

    def __init__(self, out: str, plan_args: tuple):
        self.out, self.plan_args = out, plan_args
        self.run = None  # read from OUT by the first part (``process``)
        self.counters = {}

    def setup(self):
        beamio.use_emulator_credentials()

    def _count(self, verdicts: dict) -> None:
        for verdict, keys in verdicts.items():
            if verdict not in self.counters:
                self.counters[verdict] = Metrics.counter("collect", f"keys_{verdict}")
            self.counters[verdict].inc(len(keys))

    def process(self, part: int, manifest: dict):
        import pyarrow.parquet as pq

        if self.run is None:  # run.json as the plan left it: its decisions change the settings fingerprint
            self.run = runs.read(self.out)
            recorded = environment_lib.recorded(self.out)  # every row carries its fingerprint
            self.environment = environment_lib.fingerprint(recorded) if recorded else "(no environment.json)"
        settings = self.run.settings
        self.manifest, self.plan = manifest, PartPlan.of(manifest, *self.plan_args)
        self.geometry = buckets.Geometry.of_manifest(manifest, settings.width, settings.height,
                                                     settings.per_device_batch)
        plan, out = self.plan, self.out
        pending, candidates = [], []
        written = 0
        with beamio.open_write(naming.dataset_part(out, part), "application/vnd.apache.parquet") as sink, \
                pq.ParquetWriter(sink, writer.metadata_schema()) as parquet, \
                concurrent.futures.ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="collect-read") as pool:
            for files in _read_ahead(pool, lambda i: read_slice(out, self.run, i), plan.slices_of(part)):
                verdicts, table = check_slice(out, self.run, files, self.environment)
                self._count(verdicts)
                yield PLACE, slice_place(files, table, part, written, self.geometry.slice_span(files.index)[0])
                written += table.num_rows
                pending += [table] if table.num_rows else []
                while sum(t.num_rows for t in pending) >= plan.row_group_rows:
                    pending = _write_group(parquet, pending, plan.row_group_rows)
                write_slice_outputs(out, self.run, self.geometry, files, table, bool(self.manifest.get("buckets")))
                candidates = self._gallery(candidates, table, files)
                yield SUMMARY, slice_summary(self.run, files, verdicts, table,
                                             self.geometry.bucket_of_slice(files.index))
            while pending:
                pending = _write_group(parquet, pending, plan.row_group_rows)
        for row in candidates:
            yield GALLERY, row

    def _gallery(self, candidates: list, table, files: SliceFiles) -> list:
        """The part's gallery candidates so far, with the slice's: the rows of the positions
        the plan-time sample picks, or (a score's order) the part's highest ``gallery_shown``."""
        plan = self.plan
        if not plan.gallery_shown or not table.num_rows:
            return candidates
        if plan.gallery_order == "position":
            picked = [p for p in table.column("position").to_pylist()
                      if gallery.sample_rank(p, plan.images, plan.gallery_shown) is not None]
            if not picked:
                return candidates
            import pyarrow as pa
            import pyarrow.compute as pc

            table = table.filter(pc.is_in(table.column("position"), pa.array(picked, pa.int64())))
            return candidates + self._located(table.select(list(GALLERY_COLUMNS)).to_pylist(), files)
        rows = table.select(list(GALLERY_COLUMNS)).to_pylist()
        top = heapq.nlargest(plan.gallery_shown, candidates + rows, key=gallery.score_key(plan.gallery_order))
        return [row if "thumb_at" in row else self._located([row], files)[0] for row in top]

    @staticmethod
    def _located(rows: list[dict], files: SliceFiles) -> list[dict]:
        """The rows with where their thumbnail is in their slice's pack (None: it has none)."""
        index = (files.marker or {}).get("thumbnail_index", {})
        return [{**row, "thumb_at": index.get(row["key"])} for row in rows]


def slice_place(files: SliceFiles, table, part: int, first_row: int, start: int) -> tuple:
    """(slice, part, its first row in the part, its first position, and the positions of its
    rows when they are not exactly its planned positions in order; else None) (pure)."""
    positions = table.column("position").to_pylist()
    whole = positions == list(range(start, start + len(files.items)))
    return files.index, part, first_row, start, None if whole else positions


def place_keys(plan_entries: dict[str, list], places: dict[int, tuple], row_group_rows: int) -> dict[str, list]:
    """The dataset's key index entries (``key_index.DATASET_COLUMNS``) of a bucket, from the
    plan's entries of that bucket (key, slice, position) and each slice's place in the
    dataset (``slice_place``, by slice); a key without a row in the dataset has none (pure)."""
    import bisect

    found = {name: [] for name in key_index.DATASET_COLUMNS}
    for key, index, position in zip(plan_entries["key"], plan_entries["slice"], plan_entries["position"]):
        if index not in places:
            continue
        _, part, first_row, start, positions = places[index]
        if positions is None:
            offset = position - start
        else:
            offset = bisect.bisect_left(positions, position)
            if offset == len(positions) or positions[offset] != position:
                continue
        row = first_row + offset
        for name, value in (("key", key), ("part", part), ("row_group", row // row_group_rows),
                            ("row", row % row_group_rows), ("slice", index)):
            found[name].append(value)
    return found


def write_index_bucket(bucket: int, out: str, row_group_rows: int, places: dict) -> int:
    """Bucket ``bucket`` of the dataset's key index, from the plan's and the slices' places
    ({slice: ``slice_place``})."""
    entries = key_index.read_bucket(naming.plan_keys(out, bucket))
    found = place_keys(entries, places, row_group_rows) if entries else {}
    if found and found["key"]:
        beamio.write_bytes(naming.dataset_index(out, bucket), key_index.columns_bytes(found),
                           "application/vnd.apache.parquet")
    return bucket


def dataset_rows(out: str) -> list[dict]:
    """Every row of a collected dataset, in plan order, from its parts (for tests and
    benchmarks: a reader of a large dataset reads the parts as one table instead)."""
    return [row for path in sorted(storage.files(naming.join(out, "dataset", "metadata"), "part-*.parquet"))
            for row in writer.read_parquet_rows(path)]


def _read_ahead(pool, read, indices):
    """``read(i)`` for each of ``indices``, in order, at most ``READ_AHEAD`` in flight."""
    window = collections.deque()
    for i in indices:
        window.append(pool.submit(read, i))
        if len(window) >= READ_AHEAD:
            yield window.popleft().result()
    while window:
        yield window.popleft().result()


def _write_group(parquet, pending: list, size: int) -> list:
    """Write one row group of at most ``size`` rows from the front of ``pending``; returns the rest."""
    import pyarrow as pa

    table = pa.concat_tables(pending)
    parquet.write_table(table.slice(0, size), row_group_size=size)
    rest = table.slice(size)
    return [rest] if rest.num_rows else []
