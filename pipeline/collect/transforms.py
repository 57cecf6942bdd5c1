"""``collect``: committed shards in, a verified dataset out (a Beam pipeline that streams).

``Collect`` composes the stages below: the manifest (one element, released once every
slice may be read) -> the content of ``dataset/stats.json``. ``run_collect`` applies it
to the manifest that the plan wrote; the beam engine applies it to the manifest that
comes out of its generate -> collect barrier. Both then call ``check_verified``.

  StartClock     the manifest -> when collect began (for stats.json's ``collect_s``)
  SliceIndices   the manifest -> its slice indices
  VerifySlices   each planned slice, on its own: its plan items, its metadata rows (if
                 the slice is committed) and its image files are matched by key, and each
                 key is classified: ok, missing (planned, no row or no image), duplicated
                 (more than one row) or unexpected (a row or image never planned there).
                 Images and their thumbnails are checked by listing them, never read: a
                 thumbnail missing from a committed slice is a missing key, like a
                 missing image file. Only a slice committed before hosts wrote
                 thumbnails (its marker has no ``thumbnails`` count) has its images
                 read, to make its thumbnails (logged as ``thumbnails_made``).
  MatchRejects   the manifest -> the plan's rejects files
  CountRejects   each rejects file -> its rows by reason
  WriteDataset   once, walking the slices in order with one slice's rows in memory at a
                 time (a gallery ordered by a score keeps its shown rows): ``dataset/metadata.parquet``
                 (one row group per slice: every image made, a dropped one with its reason),
                 ``dataset/index.html`` and ``dataset/gallery/`` (the paginated gallery of
                 the thumbnails under ``OUT/thumbs/``, or an even sample of at most
                 ``gallery_max`` of them),
                 ``dataset/stats.json``, the dataset card ``OUT/README.md`` (refused, before
                 anything is written, where a README.md that collect did not write is
                 there), with ``files`` ``images/metadata.jsonl`` (the ``imagefolder``
                 builder's), with ``zarr`` the ``zarr/key`` coordinate

The pure parts live beside this module: ``pipeline.collect.verify`` (a slice's verdicts,
``verify_slice``) and ``pipeline.collect.stats`` (stats.json's content, ``dataset_stats``).
Conservation is checked from what the plan wrote, not from its manifest's say-so:
input rows = planned records (items with image index 0) + rows of the rejects files.
``check_verified`` raises ``CollectError`` naming the bad keys, or a broken count.
Inside the pipeline, objects are read and written through Beam's FileSystems
(``pipeline.io.beamio``); listings with ``storage.glob``. Counters (namespace
``collect``): keys_ok, keys_missing, keys_duplicated, keys_unexpected, thumbnails_made.

What collect reads grows with the number of slices, not with the dataset's bytes: per
slice its plan items, commit marker and metadata shard, and listings.
"""
from __future__ import annotations

import collections
import logging
import contextlib
import io
import json
import tarfile
import time

import apache_beam as beam
import pyarrow
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.collect import card, gallery
from pipeline.collect.stats import dataset_stats, score_stats
from pipeline.collect.verify import ACCOUNTED, unused_guidance, unused_negatives, verify_slice
from pipeline.core import choices, filters, logs, naming
from pipeline.core.settings import Run, Settings
from pipeline.generate import environment
from pipeline.io import beamio, runs, storage
from pipeline.output import formats, writer
from pipeline.plan import input_table

GALLERY_PAGE_SIZE = gallery.PAGE_SIZE


class CollectError(RuntimeError):
    pass


def _read_lines(path: str):
    for raw in beamio.iter_lines(path):
        if raw.strip():
            yield json.loads(raw)


def _read_table(path: str):
    return writer.parquet_table(beamio.read_bytes(path))


def slice_images(out: str, settings: Settings, index: int, rows: list[dict]) -> dict[str, bytes]:
    """Encoded images of a committed slice by key, from the first format that holds them."""
    chosen = settings.formats
    if "files" in chosen:
        return {row["key"]: beamio.read_bytes(naming.join(out, row["path"])) for row in rows}
    if "webdataset" in chosen:
        members = {}
        with tarfile.open(fileobj=io.BytesIO(beamio.read_bytes(naming.shard_tar(out, index)))) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                if ext not in ("json", "txt"):
                    members[key] = tar.extractfile(member).read()
        return members
    if "parquet" in chosen:
        table = _read_table(naming.image_parquet(out, index)).select(["key", "image"]).to_pylist()
        return {row["key"]: row["image"]["bytes"] for row in table}
    arrays, found = {}, {}
    for row in rows:  # "zarr/images#I", or "zarr/WxH/images#I" in a run of several sizes
        place, _, index = row["path"].partition("#")
        group = place[len("zarr/"):-len("/images")].strip("/")
        if group not in arrays:
            arrays[group] = formats.read_zarr_images(out, group)
        found[row["key"]] = formats.encode(arrays[group][int(index)].read().result(), "png")
    return found


def whole_objects(out: str, settings: Settings, index: int) -> list[str]:
    """The objects that hold a committed slice's images whole (its tar, its image
    parquet), for the formats the run writes."""
    found = []
    if "webdataset" in settings.formats:
        found.append(naming.shard_tar(out, index))
    if "parquet" in settings.formats:
        found.append(naming.image_parquet(out, index))
    return found


def listed_images(out: str, settings: Settings, index: int) -> list[str] | None:
    """What says a committed slice's images are stored, from listings alone: its image
    files (``files``), or None when no format writes one file per image. A tar or image
    parquet missing from the slice counts as every image missing (an empty list)."""
    if any(not storage.exists(path) for path in whole_objects(out, settings, index)):
        return []
    if "files" not in settings.formats:
        return None
    return sorted(storage.files(naming.join(out, "images", naming.slice_name(index)), "*"))


class _VerifySliceFn(beam.DoFn):
    """One slice index -> its summary (``verify_slice``'s verdicts, counts, its stats).

    Images and thumbnails are verified by listing them; no image is read. Only a slice
    committed before hosts wrote thumbnails (its marker has no ``thumbnails``) has its
    images read, once, to make its thumbnails, when ``thumbnails`` asks for the gallery.
    """

    def __init__(self, out: str, settings: Settings, thumbnails: bool):
        self.out, self.settings, self.thumbnails = out, settings, thumbnails
        self.environment = None  # the fingerprint every row must carry: read once slices are committed
        self.counters = {}
        self.thumbs = Metrics.counter("collect", "thumbnails_made")

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, index: int):
        if self.environment is None:  # after generation (a pipeline that generates too builds this before)
            recorded = environment.recorded(self.out)
            self.environment = environment.fingerprint(recorded) if recorded else "(no environment.json)"
        items = list(_read_lines(naming.plan_slice(self.out, index)))
        stats_path = naming.shard_stats(self.out, index)
        committed = storage.exists(stats_path)
        try:
            slice_stats = beamio.read_json(stats_path) if committed else None
            rows = _read_table(naming.shard_metadata(self.out, index)).to_pylist() if committed else []
        except (ValueError, OSError, pyarrow.ArrowException) as e:  # a torn or foreign object of a committed slice
            yield self._unreadable(index, items, e)
            return
        image_paths = listed_images(self.out, self.settings, index) if committed else None
        has_thumbs = committed and "thumbnails" in slice_stats
        thumb_paths = sorted(storage.files(naming.thumbs_dir(self.out, index), "*")) if has_thumbs else None
        verdicts = verify_slice([i["key"] for i in items], rows, image_paths, thumb_paths, self.environment)
        for verdict, keys in verdicts.items():
            if verdict not in self.counters:
                self.counters[verdict] = Metrics.counter("collect", f"keys_{verdict}")
            self.counters[verdict].inc(len(keys))
        ok, dropped = set(verdicts["ok"]), set(verdicts["dropped"])
        good_rows = [row for row in rows if row["key"] in ok or row["key"] in dropped]  # every image made
        if self.thumbnails and ok and not has_thumbs:
            self._make_thumbnails(index, [row for row in good_rows if row["key"] in ok])
        unused_records, unused_images = unused_negatives(good_rows, self.settings.guidance_rule)
        guidance_records, guidance_images = unused_guidance(good_rows, self.settings.guidance_rule)
        filtered = {}
        if filters.active_rules(self.settings):  # the images a filter kept out, by rule
            filtered = {"dropped": len(dropped), "dropped_by_rule": dict(collections.Counter(
                rule for row in good_rows if row["key"] in dropped for rule in filters.rules_of(row["dropped"])))}
        yield {"slice": index, "records": sum(1 for i in items if i["image_index"] == 0),
               "planned_images": len(items), "stats": slice_stats,
               "verdicts": {v: keys for v, keys in verdicts.items() if v not in ACCOUNTED and keys},
               "ok": len(ok), "all_ok": len(ok) + len(dropped) == len(items) == len(rows), **filtered,
               "truncated_images": sum(1 for row in good_rows if row.get("prompt_truncated")),
               "truncated_records": sum(1 for row in good_rows if row.get("prompt_truncated")
                                        and row["image_index"] == 0),
               "unused_negative_records": unused_records, "unused_negative_images": unused_images,
               "unused_guidance_records": guidance_records, "unused_guidance_images": guidance_images}

    def _unreadable(self, index: int, items: list[dict], error: Exception) -> dict:
        """The summary of a committed slice whose marker or metadata cannot be read: every
        planned key of it is unaccounted for, and how to redo it is said."""
        redo = (f"slice {index}'s commit marker or metadata cannot be read ({type(error).__name__}: "
                f"{str(error)[:200]}); delete {naming.shard_stats(self.out, index)} and run the same command again: "
                f"the slice is made again")
        logs.event("slice_unreadable", logging.ERROR, slice=index, redo=redo)
        keys = [item["key"] for item in items]
        return {"slice": index, "records": sum(1 for i in items if i["image_index"] == 0),
                "planned_images": len(items), "stats": None, "verdicts": {"unreadable": keys}, "ok": 0,
                "all_ok": False, "unreadable": redo, "truncated_images": 0, "truncated_records": 0,
                "unused_negative_records": 0, "unused_negative_images": 0, "unused_guidance_records": 0,
                "unused_guidance_images": 0}

    def _make_thumbnails(self, index: int, rows: list[dict]) -> None:
        """A slice committed before hosts wrote thumbnails: make them from its images,
        where the hosts write them now, so the gallery is the same for every slice."""
        images = slice_images(self.out, self.settings, index, rows)
        for row in rows:
            beamio.write_bytes(naming.thumb_file(self.out, index, row["key"]), formats.thumbnail(images[row["key"]]),
                               "image/jpeg")
            self.thumbs.inc()
        logs.event("thumbnails_made", slice=index, images=len(rows),
                   why="the slice was committed without thumbnails; its images were read to make them")


class VerifySlices(beam.PTransform):
    """Slice indices -> one summary per slice: its records, planned images, committed
    stats, ok count and the keys of every other verdict. With ``thumbnails``, a slice
    committed without thumbnails gets them, made from its images."""

    def __init__(self, out: str, settings: Settings, thumbnails: bool = True):
        super().__init__()
        self.out, self.settings, self.thumbnails = out, settings, thumbnails

    def expand(self, indices):
        return (indices
                | "SpreadSlices" >> beam.Reshuffle()
                | "VerifySlice" >> beam.ParDo(_VerifySliceFn(self.out, self.settings, self.thumbnails)))


def count_rejects(path: str) -> collections.Counter:
    """The rows of one rejects file, by reason."""
    return collections.Counter(row["reason"] for row in _read_lines(path))


class CountRejects(beam.PTransform):
    """Rejects files (paths) -> one Counter of rows by reason per file."""

    def expand(self, paths):
        return paths | "CountByReason" >> beam.Map(count_rejects)


def _conform(table, schema):
    """``table`` with ``schema``'s columns in order; a column it lacks (a shard written by
    an older version) is all nulls."""
    import pyarrow as pa

    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
               else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def _ok_rows_table(out: str, summary: dict):
    table = _read_table(naming.shard_metadata(out, summary["slice"]))
    if not summary["all_ok"]:
        bad = {key for keys in summary["verdicts"].values() for key in keys}
        table = table.filter([key not in bad for key in table.column("key").to_pylist()])
    return _conform(table.sort_by("position"), writer.metadata_schema())


def write_dataset(manifest: dict, summaries: list[dict], reject_counts: list, started: float, out: str,
                  page_size: int, thumbnails: bool, gallery_max: int | None = None,
                  gallery_order: str = "position") -> dict:
    """Writes the dataset's files from every slice's summary and every rejects file's
    counts; returns stats.json's content. ``started``: when collect began (for its wall time).
    The gallery shows every row (a dropped image's without a picture), or an even sample of
    ``gallery_max`` in plan order; ``gallery_order``: a score's order instead, highest first
    (with ``gallery_max``, the highest ones). The card describes the run as ``run.json``
    holds it now, with the plan's decisions."""
    import numpy as np
    import pyarrow.parquet as pq

    run = runs.read(out)
    check_card(out)  # before anything is written
    summaries = sorted(summaries, key=lambda s: s["slice"])
    images = sum(s["ok"] for s in summaries)
    total = images + sum(s.get("dropped", 0) for s in summaries)  # the rows: every image made
    values: dict[str, list] = collections.defaultdict(list)  # each score's values, slice by slice
    flagged = [0]

    files = "files" in run.settings.formats
    zarr_keys = {} if "zarr" in run.settings.formats else None  # position -> key

    def rows():  # one slice's rows in memory at a time, in position order
        with contextlib.ExitStack() as stack:
            f = stack.enter_context(beamio.open_write(naming.dataset_file(out, "metadata.parquet"),
                                                      "application/vnd.apache.parquet"))
            parquet = stack.enter_context(pq.ParquetWriter(f, writer.metadata_schema()))
            jsonl = stack.enter_context(beamio.open_write(naming.images_metadata(out), "application/jsonl")) \
                if files else None
            for summary in summaries:
                if summary["ok"] or summary.get("dropped"):
                    table = _ok_rows_table(out, summary)
                    parquet.write_table(table)
                    if jsonl is not None:
                        jsonl.write(image_lines(table.to_pylist(), run.settings.scores))
                    if zarr_keys is not None:
                        zarr_keys.update(zip(table.column("position").to_pylist(), table.column("key").to_pylist()))
                    for name in ("clip_similarity", "aesthetic", "nsfw_score"):
                        column = table.column(name).drop_null().to_numpy()
                        if len(column):
                            values[name].append(column)
                    flagged[0] += sum(1 for v in table.column("nsfw").to_pylist() if v)
                    yield from table.to_pylist()

    if thumbnails:
        if gallery_order == "position":
            shown = gallery.sample_size(total, gallery_max)
            picked = gallery.even_sample(rows(), total, gallery_max)
        else:
            picked = gallery.ranked(rows(), gallery_order, gallery_max)
            shown = len(picked)
        title = f"promptmill dataset: {run.settings.model}, {images} images"
        if total > images:
            title += f" and {total - images} dropped by filters"
        if shown < total:
            title += f", {shown} shown" + (" (an even sample)" if gallery_order == "position" else
                                          f" (the highest {gallery_order})")
        elif gallery_order != "position":
            title += f", by {gallery_order}"
        for name, html in gallery.pages(picked, shown, page_size, title):
            beamio.write_text(naming.dataset_file(out, name), html, "text/html")
    else:
        collections.deque(rows(), maxlen=0)

    scores = None
    if run.settings.scores:
        scores = score_stats({name: np.concatenate(parts) for name, parts in values.items()},
                             flagged[0] if "safety" in run.settings.scores else None)
    stats = dataset_stats(manifest, summaries, reject_counts, collect_s=round(time.time() - started, 1),
                          scores=scores)
    if "zarr" in run.settings.formats:
        for group, offset in zarr_groups(manifest):
            size = formats.read_zarr_images(out, group).shape[0]
            formats.write_zarr_keys(out, [zarr_keys.get(offset + i, "") for i in range(size)], group)
            formats.consolidate_zarr(out, group)
        if manifest.get("buckets"):
            formats.consolidate_zarr_sizes(out, [group for group, _ in zarr_groups(manifest)])
    beamio.write_json(naming.dataset_file(out, "stats.json"), stats)
    beamio.write_text(naming.dataset_card(out), card.render(run, stats), "text/markdown")
    return stats


def zarr_groups(manifest: dict) -> list[tuple[str, int]]:
    """(zarr group, its first image's position) of each size of a plan: ("", 0) for a
    single-size run's ``OUT/zarr``, ("WxH", offset) for each size of a run of several (every
    host opens every size's arrays, so a size without images has them too)."""
    if not manifest.get("buckets"):
        return [("", 0)]
    return [(bucket["size"], bucket["offset"]) for bucket in manifest["buckets"]]


def image_lines(rows: list[dict], scores) -> bytes:
    """``images/metadata.jsonl``'s lines for metadata ``rows`` (a ``files`` run's): one per
    image file (a dropped image has none), its ``file_name`` relative to ``images/`` and
    the row's columns (the score columns of the ``scores`` the run computes; ``dropped``,
    always null here, left out): what the ``imagefolder`` builder reads with the images."""
    skipped = {"dropped"} | {c for name, columns in choices.SCORE_COLUMNS.items() if name not in scores
                             for c in columns}
    lines = []
    for row in rows:
        if row["dropped"] is not None or not row["path"].startswith("images/"):
            continue
        line = {"file_name": row["path"][len("images/"):]}
        line.update((name, value) for name, value in row.items() if name not in skipped)
        lines.append(json.dumps(line, ensure_ascii=False) + "\n")
    return "".join(lines).encode("utf-8")


def check_card(out: str) -> None:
    """Raise ``CollectError`` if ``OUT/README.md`` exists and is not a card collect wrote
    (``card.MARKER``): it is a user's, and collect never overwrites it."""
    path = naming.dataset_card(out)
    if storage.exists(path) and not card.is_ours(storage.read_text(path)):
        raise CollectError(f"{path} exists and is not a dataset card that promptmill wrote (its front matter "
                           f"has no {card.MARKER!r} line): collect writes the card there and never overwrites "
                           "a file of yours; move it elsewhere (or delete it) and collect again")


class WriteDataset(beam.PTransform):
    """Every slice's summary and every rejects file's counts -> stats.json's content (one
    element), once: metadata.parquet, the gallery, stats.json and the card are written.

    Its input is a dict of PCollections: ``manifest`` (one element), ``started`` (one
    element: when collect began), ``summaries`` (``VerifySlices``'s) and
    ``reject_counts`` (``CountRejects``'s).
    """

    def __init__(self, out: str, page_size: int = GALLERY_PAGE_SIZE, thumbnails: bool = True,
                 gallery_max: int | None = None, gallery_order: str = "position"):
        super().__init__()
        self.out, self.page_size, self.thumbnails, self.gallery_max = out, page_size, thumbnails, gallery_max
        self.gallery_order = gallery_order

    def expand(self, parts):
        return (parts["manifest"]
                | "Write" >> beam.Map(write_dataset, beam.pvalue.AsList(parts["summaries"]),
                                      beam.pvalue.AsList(parts["reject_counts"]),
                                      beam.pvalue.AsSingleton(parts["started"]), self.out,
                                      self.page_size, self.thumbnails, self.gallery_max, self.gallery_order))


def _slice_indices(manifest: dict):
    return range(manifest["slices"])


def _rejects_files(_manifest: dict, out: str) -> list[str]:
    return sorted(storage.files(naming.rejects_dir(out), "*.jsonl"))


def _now(_) -> float:
    return time.time()


class Collect(beam.PTransform):
    """The collect pipeline: the manifest (one element) -> stats.json's content (one element).

    Collect starts when the manifest element arrives, so a pipeline that also generates
    hands it over only once every slice is committed.
    """

    def __init__(self, out: str, run: Run, page_size: int = GALLERY_PAGE_SIZE, thumbnails: bool = True,
                 gallery_max: int | None = None, gallery_order: str = "position"):
        super().__init__()
        self.out, self.run, self.page_size, self.thumbnails = out, run, page_size, thumbnails
        self.gallery_max, self.gallery_order = gallery_max, gallery_order

    def expand(self, manifest):
        started = manifest | "StartClock" >> beam.Map(_now)
        summaries = (manifest
                     | "SliceIndices" >> beam.FlatMap(_slice_indices)
                     | "VerifySlices" >> VerifySlices(self.out, self.run.settings, self.thumbnails))
        reject_counts = (manifest
                         | "MatchRejects" >> beam.FlatMap(_rejects_files, self.out)
                         | "CountRejects" >> CountRejects())
        return ({"manifest": manifest, "started": started, "summaries": summaries, "reject_counts": reject_counts}
                | "WriteDataset" >> WriteDataset(self.out, self.page_size, self.thumbnails, self.gallery_max,
                                                 self.gallery_order))


COLLECT_FOLDERS = ("", "dataset", "dataset/gallery", "images", "zarr")  # where collect writes whole files


def check_verified(stats: dict) -> None:
    """Raise CollectError, naming the bad keys (a few of each kind) and a broken count,
    unless the dataset's stats.json content says it is verified."""
    if stats["verified"]:
        return
    lines = [f"{kind}: {v['count']} key(s), e.g. {', '.join(v['keys'])}" for kind, v in stats["problems"].items()]
    lines += stats.get("unreadable_slices", {}).get("first", [])
    if not stats["conservation"]["holds"]:
        c = stats["conservation"]
        lines.append(f"input rows {c['input_rows']} != planned records {c['records']} + rejects {c['rejects']}")
    raise CollectError("the dataset does not match the plan:\n  " + "\n  ".join(lines))


def run_collect(out: str, beam_args: list[str] | None = None, page_size: int = GALLERY_PAGE_SIZE,
                gallery_thumbnails: bool = True, gallery_max: int | None = None,
                gallery_order: str = "position") -> dict:
    """Collect ``out`` into ``out/dataset``; returns stats, or raises CollectError.
    ``gallery_max``: the gallery shows an even sample of at most this many images;
    ``gallery_order``: or a score's order, highest first (``gallery.ORDERS``)."""
    gallery.sample_size(0, gallery_max)  # a bad cap fails before the pipeline
    beamio.require_filesystem(out)
    manifest_path = naming.manifest(out)
    if not storage.exists(manifest_path):
        raise CollectError(f"{manifest_path} does not exist: nothing was planned in {out}")
    manifest = storage.read_json(manifest_path)
    run = runs.read(out)
    gallery.check_order(gallery_order, run.settings.scores)
    input_table.check(out, run.settings.prompts, "collect")  # the slices were planned from these inputs
    check_card(out)  # a user's OUT/README.md: refused before the pipeline writes anything
    for folder in COLLECT_FOLDERS:  # what a collect killed midway left half-written (local files only)
        storage.remove_temporaries(naming.join(out, folder) if folder else out)
    with beam.Pipeline(options=PipelineOptions(beam_args or [])) as p:
        _ = (p
             | "Manifest" >> beam.Create([manifest])
             | "Collect" >> Collect(out, run, page_size, gallery_thumbnails, gallery_max, gallery_order))
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    check_verified(stats)
    return stats
