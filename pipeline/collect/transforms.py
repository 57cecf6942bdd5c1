"""``collect``: committed shards in, a verified dataset out (a Beam pipeline with no serial
pass over the slices).

``Collect`` composes the stages below: the manifest (one element, released once every
slice may be read) -> the content of ``dataset/stats.json``. ``run_collect`` applies it
to the manifest that the plan wrote; the beam engine applies it to the manifest that
comes out of its generate -> collect barrier. Both then call ``check_verified``.

  StartClock     the manifest -> when collect began (for stats.json's ``collect_s``)
  CheckCard      the manifest, once ``OUT/README.md`` is known to be collect's or absent
                 (a user's is refused before anything is written)
  CollectParts   each part (a contiguous range of slices, ``parts.PartPlan``), in parallel:
                 its slices verified and written as ``dataset/metadata/part-NNNNN.parquet``,
                 with each slice's ``images/SLICE/metadata.jsonl`` and ``zarr/key`` chunk
                 (``pipeline.collect.parts``); out come slice summaries, each slice's
                 place in its part, and gallery candidates
  CountRejects   each rejects file -> its rows by reason
  Merge          all of those -> one ``Merged``, by a combiner: the ``stats.Tally`` (counts,
                 per-host and per-size figures, a bounded sample of problem keys, score
                 sketches), each slice's place (one small tuple a slice), the gallery's
                 candidates (the plan-time sample's rows, or a score's bounded top-k) and
                 the rejects by reason
  IndexBuckets   each bucket of the plan's key index with the slices' places ->
                 ``dataset/index/BBBBB.parquet`` (key -> part, row group, row;
                 ``pipeline.output.key_index``): no key crosses a shuffle
  GalleryRows    the candidates ranked, each row's thumbnail read from its slice's pack,
                 each page rendered on its own: ``dataset/index.html`` and ``dataset/gallery/``
  WriteStats     once all of the above is written (one GroupByKey of it all):
                 ``dataset/stats.json``, the dataset card ``OUT/README.md``, and (zarr) the
                 groups' consolidated metadata

What is gathered in one place is the ``Merged``: O(slices) small tuples and bounded
figures, never the run's rows or keys. ``check_verified`` raises ``CollectError``
naming the bad keys with their slices, or a broken count. Inside the pipeline, objects
are read and written through Beam's FileSystems (``pipeline.io.beamio``); listings with
``storage``. Counters (namespace ``collect``): keys_ok, keys_missing, and one per verdict.
"""
from __future__ import annotations

import collections
import heapq
import json
import logging
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.collect import card, gallery
from pipeline.collect.parts import GALLERY, PART_ROWS, PLACE, SUMMARY, CollectPartFn, PartPlan, write_index_bucket
from pipeline.collect.stats import Tally, dataset_stats
from pipeline.core import logs, naming
from pipeline.core.settings import Run
from pipeline.io import beamio, runs, storage
from pipeline.output import formats, key_index
from pipeline.plan import input_table

GALLERY_PAGE_SIZE = gallery.PAGE_SIZE


class CollectError(RuntimeError):
    pass


def count_rejects(path: str) -> collections.Counter:
    """The rows of one rejects file, by reason."""
    return collections.Counter(json.loads(raw)["reason"] for raw in beamio.iter_lines(path) if raw.strip())


class CountRejects(beam.PTransform):
    """Rejects files (paths) -> ("rejects", the file's rows by reason) each, as ``MergeFn`` sums them."""

    def expand(self, paths):
        return paths | "CountByReason" >> beam.Map(lambda path: ("rejects", count_rejects(path)))


def check_card(out: str) -> None:
    """Raise ``CollectError`` if ``OUT/README.md`` exists and is not a card collect wrote
    (``card.MARKER``): it is a user's, and collect never overwrites it."""
    path = naming.dataset_card(out)
    if storage.exists(path) and not card.is_ours(storage.read_text(path)):
        raise CollectError(f"{path} exists and is not a dataset card that promptmill wrote (its front matter "
                           f"has no {card.MARKER!r} line): collect writes the card there and never overwrites "
                           "a file of yours; move it elsewhere (or delete it) and collect again")


def _checked(manifest: dict, out: str) -> dict:
    beamio.use_emulator_credentials()
    check_card(out)
    return manifest


def gallery_rows(candidates: list[dict], order: str) -> list[dict]:
    """The gallery's rows in its order: plan order, or a score's, highest first (pure)."""
    if order == "position":
        return sorted(candidates, key=lambda row: row["position"])
    return sorted(candidates, key=gallery.score_key(order), reverse=True)


class Merged:
    """What collect gathers in one place, from every part's step and every rejects file:
    the slices' ``stats.Tally``, each slice's place in its part (for the key index: one small
    tuple a slice), the gallery's candidates (at most its cap) and the rejects by reason."""

    def __init__(self, order: str, cap: int):
        self.order, self.cap = order, cap
        self.tally, self.places, self.candidates = Tally(), {}, []
        self.by_reason = collections.Counter()

    def add(self, kind: str, value) -> "Merged":
        if kind == SUMMARY:
            self.tally.add(value)
        elif kind == PLACE:
            self.places[value[0]] = value
        elif kind == GALLERY:
            self._keep([value])
        else:  # a rejects file's counts
            self.by_reason.update(value)
        return self

    def merge(self, other: "Merged") -> "Merged":
        self.tally.merge(other.tally)
        self.places.update(other.places)
        self._keep(other.candidates)
        self.by_reason.update(other.by_reason)
        return self

    def _keep(self, rows: list) -> None:
        """The candidates, with ``rows``: every one of the plan-time sample (at most its
        size), or a score's highest ``cap`` (a bounded top-k)."""
        self.candidates += rows
        if self.order != "position" and len(self.candidates) > self.cap:
            self.candidates = heapq.nlargest(self.cap, self.candidates, key=gallery.score_key(self.order))


class MergeFn(beam.CombineFn):
    """(kind, value) pairs of the parts' steps and the rejects' counts -> one ``Merged``."""

    def __init__(self, order: str, cap: int):
        self.order, self.cap = order, cap

    def create_accumulator(self):
        return Merged(self.order, self.cap)

    def add_input(self, merged, pair):
        return merged.add(*pair)

    def merge_accumulators(self, many):
        many = iter(many)
        merged = next(many)
        for other in many:
            merged.merge(other)
        return merged

    def extract_output(self, merged):
        return merged


def _gallery_rows(merged: Merged, out: str, model: str, page_size: int):
    """Each row the gallery shows, ranked, with its page's title and the gallery's size; a
    gallery with nothing to show gets its first page, saying so, here."""
    rows = gallery_rows(merged.candidates, merged.order)
    counts = merged.tally.counts
    title = gallery.title(model, counts["ok"], counts["ok"] + counts["dropped"], len(rows), merged.order)
    if not rows:
        beamio.write_text(naming.dataset_file(out, "index.html"), gallery.render_page([], 1, 1, 0, title), "text/html")
    for rank, row in enumerate(rows):
        yield rank, row, title, len(rows)


def _with_thumb(ranked, out: str, page_size: int):
    """A gallery row with its thumbnail, read from its slice's pack where the slice's commit
    marker says it is (a dropped image has none), by page."""
    rank, row, title, total = ranked
    at = row.pop("thumb_at", None)
    thumb = storage.read_range(naming.thumb_pack(out, row["slice"]), *at) if at and not row["dropped"] else None
    return rank // page_size, (rank, {**row, "thumb": thumb}, title, total)


def _write_page(element, out: str, page_size: int) -> int:
    """One page of the gallery, from its rows (grouped by page)."""
    page, found = element
    found = sorted(found, key=lambda item: item[0])
    rows, (_, _, title, total) = [row for _, row, _, _ in found], found[0]
    html = gallery.render_page(rows, page + 1, gallery.page_count(total, page_size), total, title, page_size)
    beamio.write_text(naming.dataset_file(out, gallery.page_name(page + 1)), html, "text/html")
    return page


def _index_buckets(merged: Merged, manifest: dict):
    return range(key_index.bucket_count(manifest["images"]))


def _write_stats(element, manifest: dict, started: float, out: str, run: Run, plan_args: tuple) -> dict:
    """stats.json and the card, once everything else is written (grouped under one key, so
    this waits for every bucket and page through its main input); returns stats.json's content."""
    [merged] = [value for kind, value in element[1] if kind == "merged"]
    pages = sum(1 for kind, _ in element[1] if kind == "page")
    plan = PartPlan.of(manifest, *plan_args)
    _delete_stale(out, plan.parts, pages if plan.gallery_shown else None)
    stats = dataset_stats(manifest, merged.tally, dict(merged.by_reason), collect_s=round(time.time() - started, 1),
                          safety="safety" in run.settings.scores, parts=plan.describe())
    if "zarr" in run.settings.formats:
        groups = [bucket["size"] for bucket in manifest.get("buckets") or ()] or [""]
        for group in groups:
            formats.consolidate_zarr(out, group)
        if manifest.get("buckets"):
            formats.consolidate_zarr_sizes(out, groups)
    beamio.write_json(naming.dataset_file(out, "stats.json"), stats)
    # the card describes the run as run.json holds it now, with the plan's decisions
    beamio.write_text(naming.dataset_card(out), card.render(runs.read(out), stats), "text/markdown")
    return stats


def _delete_stale(out: str, parts: int, pages: int | None) -> None:
    """Delete the parts and gallery pages an earlier collect of this run wrote beyond this
    one's (another ``--part-rows`` or gallery size): they would be read as this dataset's."""
    stale = [path for path in sorted(storage.files(naming.join(out, "dataset", "metadata"), "part-*.parquet"))
             if int(path.rsplit("-", 1)[1].split(".")[0]) >= parts]
    if pages is not None:
        stale += [path for path in sorted(storage.files(naming.join(out, "dataset", "gallery"), "page-*.html"))
                  if int(path.rsplit("-", 1)[1].split(".")[0]) > max(1, pages)]
    if stale:
        beamio.delete(stale)
        logs.event("stale_outputs_deleted", out=out, objects=len(stale), first=stale[0])


def _tagged(kind: str):
    return lambda value: (None, (kind, value))


class Collect(beam.PTransform):
    """The collect pipeline: the manifest (one element) -> stats.json's content (one element).

    Collect starts when the manifest element arrives, so a pipeline that also generates
    hands it over only once every slice is committed. ``thumbnails``: write the gallery;
    ``gallery_max``: the images it shows (None: ``gallery.SAMPLE_SIZE``); ``part_rows``:
    the images of a part of the metadata, about.

    Every step that must wait for others takes them as its main input (a side input is
    only ever read by a step whose main input comes after it): the DirectRunner has run a
    step whose main input was ready early before a side input it read was complete.
    """

    def __init__(self, out: str, run: Run, page_size: int = GALLERY_PAGE_SIZE, thumbnails: bool = True,
                 gallery_max: int | None = None, gallery_order: str = "position", *, part_rows: int = PART_ROWS):
        super().__init__()
        self.out, self.run, self.page_size, self.thumbnails = out, run, page_size, thumbnails
        self.gallery_max, self.gallery_order, self.part_rows = gallery_max, gallery_order, part_rows

    def expand(self, manifest):
        out, run, order, page_size = self.out, self.run, self.gallery_order, self.page_size
        cap = (gallery.SAMPLE_SIZE if self.gallery_max is None else self.gallery_max) if self.thumbnails else 0
        plan_args = (self.part_rows, cap, order)
        started = manifest | "StartClock" >> beam.Map(lambda _: time.time())
        checked = manifest | "CheckCard" >> beam.Map(_checked, out)
        the_manifest = beam.pvalue.AsSingleton(checked)
        parts = (checked
                 | "PartIndices" >> beam.FlatMap(lambda m: range(PartPlan.of(m, *plan_args).parts))
                 | "SpreadParts" >> beam.Reshuffle()
                 | "CollectParts" >> beam.ParDo(CollectPartFn(out, plan_args), the_manifest))
        rejects = (checked
                   | "MatchRejects" >> beam.FlatMap(lambda _: sorted(storage.files(naming.rejects_dir(out), "*.jsonl")))
                   | "CountRejects" >> CountRejects())
        merged = ((parts, rejects)
                  | "PartsAndRejects" >> beam.Flatten()
                  | "Merge" >> beam.CombineGlobally(MergeFn(order, cap)))
        row_groups = PartPlan.of({"slices": 1, "slice_size": 1, "images": 1}, self.part_rows).row_group_rows
        done = [merged | "TagMerged" >> beam.Map(_tagged("merged")),
                (merged  # the buckets come out of the merged places, so each bucket's step reads them whole
                 | "IndexBuckets" >> beam.FlatMap(_index_buckets, the_manifest)
                 | "SpreadBuckets" >> beam.Reshuffle()
                 | "WriteIndexBucket" >> beam.Map(
                     lambda bucket, m: write_index_bucket(bucket, out, row_groups, m.places),
                     beam.pvalue.AsSingleton(merged))
                 | "TagBucket" >> beam.Map(_tagged("bucket")))]
        if self.thumbnails:
            done.append(merged
                        | "GalleryRows" >> beam.FlatMap(_gallery_rows, out, run.settings.model, page_size)
                        | "SpreadRows" >> beam.Reshuffle()
                        | "ReadThumbs" >> beam.Map(_with_thumb, out, page_size)
                        | "GroupByPage" >> beam.GroupByKey()
                        | "WritePage" >> beam.Map(_write_page, out, page_size)
                        | "TagPage" >> beam.Map(_tagged("page")))
        return (done
                | "AllWritten" >> beam.Flatten()
                | "Together" >> beam.GroupByKey()
                | "WriteStats" >> beam.Map(_write_stats, the_manifest, beam.pvalue.AsSingleton(started), out, run,
                                           plan_args))


COLLECT_FOLDERS = ("", "dataset", "dataset/gallery", "dataset/metadata", "dataset/index", "zarr")  # where collect writes whole files


def check_verified(stats: dict) -> None:
    """Raise CollectError, naming the bad keys (a few of each kind, each with its slice)
    and a broken count, unless the dataset's stats.json content says it is verified."""
    if stats["verified"]:
        return
    lines = [f"{kind}: {v['count']} key(s), e.g. {', '.join(v['keys'])}" for kind, v in stats["problems"].items()]
    lines += stats.get("unreadable_slices", {}).get("first", [])
    if not stats["conservation"]["holds"]:
        c = stats["conservation"]
        lines.append(f"input rows {c['input_rows']} != planned records {c['records']} + rejects {c['rejects']}")
    raise CollectError("the dataset does not match the plan:\n  " + "\n  ".join(lines))


def warn_if_all_dropped(stats: dict) -> None:
    """Log ``all_images_dropped`` (a warning) when the filters dropped every image."""
    message = card.all_dropped(stats)
    if message:
        logs.event("all_images_dropped", level=logging.WARNING, message=message,
                   dropped=stats["dropped"]["images"], by_rule=stats["dropped"].get("by_rule") or {})


def run_collect(out: str, beam_args: list[str] | None = None, page_size: int = GALLERY_PAGE_SIZE,
                gallery_thumbnails: bool = True, gallery_max: int | None = None,
                gallery_order: str = "position", *, part_rows: int = PART_ROWS) -> dict:
    """Collect ``out`` into ``out/dataset``; returns stats, or raises CollectError.
    ``gallery_max``: the gallery shows an even sample of at most this many images (None:
    ``gallery.SAMPLE_SIZE``); ``gallery_order``: or a score's order, highest first
    (``gallery.ORDERS``); ``part_rows``: the images of each part of the metadata, about."""
    gallery.sample_size(0, gallery_max)  # a bad cap fails before the pipeline
    beamio.require_filesystem(out)
    manifest_path = naming.manifest(out)
    run = runs.read(out)  # first: a run of another layout is refused before anything else
    if not storage.exists(manifest_path):
        raise CollectError(f"{manifest_path} does not exist: nothing was planned in {out}")
    manifest = storage.read_json(manifest_path)
    PartPlan.of(manifest, part_rows)  # a bad part size fails before the pipeline
    gallery.check_order(gallery_order, run.settings.scores)
    input_table.check(out, run.settings.prompts, "collect")  # the slices were planned from these inputs
    check_card(out)  # a user's OUT/README.md: refused before the pipeline writes anything
    for folder in COLLECT_FOLDERS:  # what a collect killed midway left half-written (local files only)
        storage.remove_temporaries(naming.join(out, folder) if folder else out)
    with beam.Pipeline(options=PipelineOptions(beam_args or [])) as p:
        _ = (p
             | "Manifest" >> beam.Create([manifest])
             | "Collect" >> Collect(out, run, page_size, gallery_thumbnails, gallery_max, gallery_order,
                                    part_rows=part_rows))
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    warn_if_all_dropped(stats)
    check_verified(stats)
    return stats
