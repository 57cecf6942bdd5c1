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
  MergeSummaries the summaries -> one ``stats.Tally``, by a combiner: counts, per-host and
                 per-size figures, a bounded sample of problem keys, score sketches
  KeyIndex       each bucket of the plan's key index, with every slice's place in the parts
                 (O(slices) small tuples, merged by a combiner) -> ``dataset/index/BBBBB.parquet``
                 (key -> part, row group, row; ``pipeline.output.key_index``): no key is shuffled
  CountRejects   each rejects file -> its rows by reason, summed
  Gallery        the candidates (the plan-time sample's rows, or a score's top-k) ranked,
                 their thumbnails read from their slices' packs, each page rendered on its
                 own: ``dataset/index.html`` and ``dataset/gallery/``
  WriteStats     once all of the above is written: ``dataset/stats.json``, the dataset card
                 ``OUT/README.md``, and (zarr) the groups' consolidated metadata

What is gathered in one place is the merged tally, the rejects' counts and the gallery's
rows (at most its cap): never the run's rows. ``check_verified`` raises ``CollectError``
naming the bad keys with their slices, or a broken count. Inside the pipeline, objects
are read and written through Beam's FileSystems (``pipeline.io.beamio``); listings with
``storage``. Counters (namespace ``collect``): keys_ok, keys_missing, and one per verdict.
"""
from __future__ import annotations

import collections
import json
import logging
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.collect import card, gallery
from pipeline.collect.parts import GALLERY, PART_ROWS, ROWS, CollectPartFn, PartPlan, PlacesFn, write_index_bucket
from pipeline.collect.stats import StatsFn, dataset_stats
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


def _sum_counts(counters) -> collections.Counter:
    total = collections.Counter()
    for counter in counters:
        total.update(counter)
    return total


class CountRejects(beam.PTransform):
    """Rejects files (paths) -> one Counter of rows by reason over them all."""

    def expand(self, paths):
        return (paths
                | "CountByReason" >> beam.Map(count_rejects)
                | "SumCounts" >> beam.CombineGlobally(_sum_counts))


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


def _joined(parts: dict, label: str):
    """The PCollections of ``parts`` ({name: PCollection}) joined into one element, {name:
    [their elements]}, once every one of them is complete: a GroupByKey under one key, so
    that a step that must come last waits for its inputs through its main input (the
    DirectRunner has run a step before a side input it read was complete)."""
    tagged = [pcoll | f"{label}Tag{name}" >> beam.Map(lambda element, name=name: (None, (name, element)))
              for name, pcoll in sorted(parts.items())]

    def gather(element) -> dict:
        found = {name: [] for name in parts}
        for name, value in element[1]:
            found[name].append(value)
        return found

    return (tagged
            | f"{label}Flatten" >> beam.Flatten()
            | f"{label}Group" >> beam.GroupByKey()
            | f"{label}Gather" >> beam.Map(gather))


def _title(joined: dict, run: Run, order: str, page_size: int, out: str):
    """(page, ("title", the gallery's title, how many it shows)) for each of its pages;
    a gallery with nothing to show gets its first page, saying so, here."""
    [tally], [rows] = joined["tally"], joined["shown"]
    title = gallery.title(run.settings.model, tally.counts["ok"], tally.counts["ok"] + tally.counts["dropped"],
                          len(rows), order)
    if not rows:
        beamio.write_text(naming.dataset_file(out, "index.html"), gallery.render_page([], 1, 1, 0, title), "text/html")
    for page in range(-(-len(rows) // page_size)):
        yield page, ("title", (title, len(rows)))


def _with_thumb(ranked, out: str, page_size: int):
    """A gallery row with its thumbnail, read from its slice's pack where the slice's commit
    marker says it is (a dropped image has none), by page."""
    rank, row = ranked
    at = row.pop("thumb_at", None)
    thumb = storage.read_range(naming.thumb_pack(out, row["slice"]), *at) if at and not row["dropped"] else None
    return rank // page_size, ("row", (rank, {**row, "thumb": thumb}))


def _write_page(element, out: str, page_size: int) -> int:
    """One page of the gallery, from its rows and the gallery's title (grouped by page)."""
    page, found = element
    [(title, total)] = [value for kind, value in found if kind == "title"]
    rows = [row for _, row in sorted(value for kind, value in found if kind == "row")]
    html = gallery.render_page(rows, page + 1, gallery.page_count(total, page_size), total, title, page_size)
    beamio.write_text(naming.dataset_file(out, gallery.page_name(page + 1)), html, "text/html")
    return page


def _write_stats(joined: dict, out: str, run: Run, plan_args: tuple) -> dict:
    """stats.json and the card, once everything else is written; returns stats.json's content."""
    [manifest], [tally], [by_reason], [started] = (joined[name] for name in ("manifest", "tally", "rejects",
                                                                             "started"))
    plan = PartPlan.of(manifest, *plan_args)
    _delete_stale(out, plan.parts, joined.get("pages"))
    stats = dataset_stats(manifest, tally, by_reason or {}, collect_s=round(time.time() - started, 1),
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


def _delete_stale(out: str, parts: int, pages: list | None) -> None:
    """Delete the parts and gallery pages an earlier collect of this run wrote beyond this
    one's (another ``--part-rows`` or gallery size): they would be read as this dataset's."""
    stale = [path for path in storage.glob(naming.join(out, "dataset", "metadata", "part-*.parquet"))
             if int(path.rsplit("-", 1)[1].split(".")[0]) >= parts]
    if pages is not None:
        stale += [path for path in storage.glob(naming.join(out, "dataset", "gallery", "page-*.html"))
                  if int(path.rsplit("-", 1)[1].split(".")[0]) > max(1, pages[0])]
    if stale:
        beamio.delete(stale)
        logs.event("stale_outputs_deleted", out=out, objects=len(stale), first=stale[0])


class Collect(beam.PTransform):
    """The collect pipeline: the manifest (one element) -> stats.json's content (one element).

    Collect starts when the manifest element arrives, so a pipeline that also generates
    hands it over only once every slice is committed. ``thumbnails``: write the gallery;
    ``gallery_max``: the images it shows (None: ``gallery.SAMPLE_SIZE``); ``part_rows``:
    the images of a part of the metadata, about.
    """

    def __init__(self, out: str, run: Run, page_size: int = GALLERY_PAGE_SIZE, thumbnails: bool = True,
                 gallery_max: int | None = None, gallery_order: str = "position", part_rows: int = PART_ROWS):
        super().__init__()
        self.out, self.run, self.page_size, self.thumbnails = out, run, page_size, thumbnails
        self.gallery_max, self.gallery_order, self.part_rows = gallery_max, gallery_order, part_rows

    def expand(self, manifest):
        out, run, order, page_size = self.out, self.run, self.gallery_order, self.page_size
        cap = (gallery.SAMPLE_SIZE if self.gallery_max is None else self.gallery_max) if self.thumbnails else 0
        plan_args = (self.part_rows, cap, order)
        started = manifest | "StartClock" >> beam.Map(lambda _: time.time())
        checked = manifest | "CheckCard" >> beam.Map(_checked, out)
        parts = (checked
                 | "PartIndices" >> beam.FlatMap(lambda m: range(PartPlan.of(m, *plan_args).parts))
                 | "SpreadParts" >> beam.Reshuffle()
                 | "CollectParts" >> beam.ParDo(CollectPartFn(out, plan_args), beam.pvalue.AsSingleton(checked))
                 .with_outputs(ROWS, GALLERY, main="summaries"))
        tally = parts.summaries | "MergeSummaries" >> beam.CombineGlobally(StatsFn())
        places = _joined({"manifest": checked, "places": parts[ROWS] | "SlicePlaces" >> beam.CombineGlobally(
            PlacesFn())}, "Places")
        indexed = (places  # the buckets come out of the places, so each bucket's step reads them whole
                   | "IndexBuckets" >> beam.FlatMap(lambda j: range(key_index.bucket_count(j["manifest"][0]["images"])))
                   | "SpreadBuckets" >> beam.Reshuffle()
                   | "WriteIndexBucket" >> beam.Map(write_index_bucket, out, plan_args, beam.pvalue.AsSingleton(places))
                   | "CountBuckets" >> beam.combiners.Count.Globally())
        rejects = (checked
                   | "MatchRejects" >> beam.FlatMap(lambda _: storage.glob(naming.join(naming.rejects_dir(out),
                                                                                       "*.jsonl")))
                   | "CountRejects" >> CountRejects())
        last = {"manifest": checked, "tally": tally, "rejects": rejects, "started": started, "index": indexed}
        if self.thumbnails:
            picked = (parts[GALLERY] | "GalleryCandidates" >> beam.combiners.ToList() if order == "position" else
                      parts[GALLERY] | "GalleryTop" >> beam.combiners.Top.Of(cap, key=gallery.score_key(order)))
            shown = picked | "RankGallery" >> beam.Map(gallery_rows, order)
            titles = (_joined({"tally": tally, "shown": shown}, "Title")
                      | "GalleryTitle" >> beam.FlatMap(_title, run, order, page_size, out))
            rows = (shown
                    | "GalleryRanks" >> beam.FlatMap(lambda rows: list(enumerate(rows)))
                    | "SpreadRows" >> beam.Reshuffle()
                    | "ReadThumbs" >> beam.Map(_with_thumb, out, page_size))
            last["pages"] = ((titles, rows)
                             | "PageParts" >> beam.Flatten()
                             | "GroupByPage" >> beam.GroupByKey()
                             | "WritePage" >> beam.Map(_write_page, out, page_size)
                             | "CountPages" >> beam.combiners.Count.Globally())
        return _joined(last, "Stats") | "WriteStats" >> beam.Map(_write_stats, out, run, plan_args)


def check_verified(stats: dict) -> None:
    """Raise CollectError, naming the bad keys (a few of each kind, each with its slice)
    and a broken count, unless the dataset's stats.json content says it is verified."""
    if stats["verified"]:
        return
    lines = [f"{kind}: {v['count']} key(s), e.g. {', '.join(v['keys'])}" for kind, v in stats["problems"].items()]
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
                gallery_order: str = "position", part_rows: int = PART_ROWS) -> dict:
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
    with beam.Pipeline(options=PipelineOptions(beam_args or [])) as p:
        _ = (p
             | "Manifest" >> beam.Create([manifest])
             | "Collect" >> Collect(out, run, page_size, gallery_thumbnails, gallery_max, gallery_order, part_rows))
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    warn_if_all_dropped(stats)
    check_verified(stats)
    return stats
