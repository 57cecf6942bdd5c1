"""The dataset's stats (the content of ``dataset/stats.json``), merged without holding the run.

Each slice's verification gives a small summary (``pipeline.collect.parts``); ``Tally``
folds summaries into one, in any order and any grouping (collect's combiner,
``transforms.MergeFn``, accumulates one), holding only counts, per-host and per-size figures, at most
``MAX_KEYS_IN_MESSAGE`` problem keys of each kind (the first by slice and key) and a
``sketch.Scores`` per score. ``dataset_stats`` (pure) turns the merged tally, the rejects
by reason and the manifest into stats.json.

``verified`` holds when no key is missing, duplicated, unexpected, of another run or
damaged, and conservation holds: input rows = planned records + rejects. With score
filters, every planned image is accounted for too: planned images = images + dropped
images (each dropped one has its metadata row, with the rules it failed).
"""
from __future__ import annotations

import collections
import datetime as dt

from pipeline.collect.sketch import Scores

QUANTILES = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
QUANTILE_NAMES = tuple(f"p{round(q * 100):02d}" for q in QUANTILES)
MAX_KEYS_IN_MESSAGE = 20  # keys kept per kind of problem
HOST_TIMES = ("input_s", "device_wait_s", "output_s", "device_busy_s")  # per slice, from pipeline.generate.host_loop
COUNTS = ("slices", "records", "planned_images", "ok", "dropped", "truncated_images", "truncated_records",
          "unused_negative_records", "unused_negative_images", "unused_guidance_records", "unused_guidance_images",
          "committed_slices", "compiles_after_warmup", "flagged")


class Tally:
    """Slice summaries folded together (see the module's docstring)."""

    def __init__(self):
        self.counts = dict.fromkeys(COUNTS, 0)
        self.filtered = False  # some slice was written with a score filter
        self.by_rule = collections.Counter()
        self.problems: dict[str, dict] = {}  # kind -> {"count", "keys": [[slice, key], ...]}
        self.hosts: dict[int, dict] = {}
        self.span = [None, None]  # the first slice's start, the last slice's end (unix seconds)
        self.sizes: dict[int, dict] = {}  # size index -> {"images", "dropped"}
        self.scores: dict[str, Scores] = {}
        self.unreadable: list[str] = []  # how to redo the first committed slices that cannot be read
        self.unreadable_count = 0

    def add(self, summary: dict) -> "Tally":
        """Fold in one slice's summary (``parts.slice_summary``); returns self."""
        for name in COUNTS:
            self.counts[name] += summary.get(name, 0)
        self.filtered |= "dropped" in summary
        self.by_rule.update(summary.get("dropped_by_rule") or {})
        for kind, found in summary.get("problems", {}).items():
            self._problem(kind, found["count"], [[summary["slice"], key] for key in found["keys"]])
        size = self.sizes.setdefault(summary.get("size", 0), {"images": 0, "dropped": 0})
        size["images"] += summary["ok"]
        size["dropped"] += summary.get("dropped", 0)
        if summary.get("host_stats"):
            self._host(summary["host_stats"])
        for name, values in (summary.get("scores") or {}).items():
            self.scores.setdefault(name, Scores()).add(values)
        if summary.get("unreadable"):
            self._unreadable(1, [summary["unreadable"]])
        return self

    def _unreadable(self, count: int, redo: list[str]) -> None:
        self.unreadable_count += count
        self.unreadable = sorted(self.unreadable + redo)[:MAX_KEYS_IN_MESSAGE]

    def merge(self, other: "Tally") -> "Tally":
        """Fold in another tally; returns self."""
        for name in COUNTS:
            self.counts[name] += other.counts[name]
        self.filtered |= other.filtered
        self.by_rule.update(other.by_rule)
        for kind, found in other.problems.items():
            self._problem(kind, found["count"], found["keys"])
        for index, size in other.sizes.items():
            mine = self.sizes.setdefault(index, {"images": 0, "dropped": 0})
            mine["images"] += size["images"]
            mine["dropped"] += size["dropped"]
        for host, figures in other.hosts.items():
            self._host({"host": host, **figures}, slices=figures["slices"])
        self._span(*other.span)
        for name, scores in other.scores.items():
            self.scores.setdefault(name, Scores()).merge(scores)
        self._unreadable(other.unreadable_count, other.unreadable)
        return self

    def _problem(self, kind: str, count: int, keys: list) -> None:
        found = self.problems.setdefault(kind, {"count": 0, "keys": []})
        found["count"] += count
        found["keys"] = sorted(found["keys"] + keys)[:MAX_KEYS_IN_MESSAGE]

    def _host(self, stats: dict, slices: int = 1) -> None:
        host = self.hosts.setdefault(stats["host"], {"images": 0, "seconds": 0.0, "slices": 0,
                                                     **{name: 0.0 for name in HOST_TIMES}})
        host["images"] += stats["images"]
        host["seconds"] += stats["seconds"]
        host["slices"] += slices
        for name in HOST_TIMES:
            host[name] += stats.get(name, 0.0)
        if slices == 1:  # a slice's own stats: when it ran
            self._span(*slice_span(stats))

    def _span(self, start, end) -> None:
        if start is not None:
            self.span = [start if self.span[0] is None else min(self.span[0], start),
                         end if self.span[1] is None else max(self.span[1], end)]


def slice_span(stats: dict) -> tuple[float | None, float | None]:
    """When a slice started and was committed, as its host recorded them (unix seconds)."""
    if "committed_ts" in stats:
        return stats["started_ts"], stats["committed_ts"]
    if "finished_at" in stats:
        end = dt.datetime.fromisoformat(stats["finished_at"]).timestamp()
        return end - stats["seconds"], end
    return None, None


def host_figures(hosts: dict) -> dict:
    """Per host: images, slices, seconds and images/s, and the slices' summed time spent
    preparing inputs, waiting for the devices, and handing images to the writers, and the
    devices' busy time (pure)."""
    found = {}
    for host, figures in sorted(hosts.items()):
        figures = {**figures, **{name: round(figures[name], 3) for name in ("seconds", *HOST_TIMES)}}
        figures["images_per_s"] = round(figures["images"] / figures["seconds"], 3) if figures["seconds"] else None
        found[str(host)] = figures
    return found


def score_figures(scores: dict[str, Scores], flagged: int | None = None) -> dict:
    """Each score's count, mean, min, quantiles (``QUANTILES``: exact up to
    ``sketch.EXACT_LIMIT`` images, else sketched) and max; ``flagged``: how many images the
    safety checker flagged (pure)."""
    found = {name: scores[name].summary(QUANTILES, QUANTILE_NAMES) for name in sorted(scores) if scores[name].count}
    if flagged is not None:
        found["nsfw"] = {"flagged": int(flagged)}
    return found


def size_counts(manifest: dict, tally: Tally) -> dict:
    """{size: {planned_images, images, dropped, records, per_device_batch}} of a run of
    several sizes (pure)."""
    found = {}
    for index, bucket in enumerate(manifest["buckets"]):
        got = tally.sizes.get(index, {"images": 0, "dropped": 0})
        found[bucket["size"]] = {"planned_images": bucket["images"], "images": got["images"],
                                 "dropped": got["dropped"], "records": bucket["records"],
                                 "per_device_batch": bucket["per_device_batch"]}
    return found


def dataset_stats(manifest: dict, tally: Tally, by_reason: dict, collect_s: float, safety: bool = False,
                  parts: dict | None = None) -> dict:
    """stats.json's content (pure), from the merged ``tally`` of every slice, the rejects
    by reason, and ``collect_s``: collect's wall time so far; ``safety``: the run ran the
    safety checker (its flagged count is reported); ``parts``: how the metadata was cut."""
    c = tally.counts
    images, records, dropped = c["ok"], c["records"], c["dropped"]
    rejects = sum(by_reason.values())
    input_rows = manifest["input_rows"]
    problems = {kind: {"count": found["count"], "keys": [f"{key} (slice {index})" for index, key in found["keys"]]}
                for kind, found in sorted(tally.problems.items())}
    extra = {}
    if manifest.get("buckets"):
        extra["sizes"] = size_counts(manifest, tally)
    if tally.scores or safety:
        extra["scores"] = score_figures(tally.scores, c["flagged"] if safety else None)
    if tally.unreadable:  # committed slices whose marker or metadata cannot be read, each with how to redo it
        extra["unreadable_slices"] = {"count": tally.unreadable_count, "first": tally.unreadable}
    if dropped or tally.filtered:
        # every planned image is an image, a dropped one, or a problem above
        extra["dropped"] = {"images": dropped, "by_rule": dict(sorted(tally.by_rule.items()))}
        extra["image_conservation"] = {"planned_images": manifest["images"], "images": images, "dropped": dropped,
                                       "holds": images + dropped == manifest["images"]}
    if parts:
        extra["parts"] = parts
    start, end = tally.span
    return {
        "verified": not problems and records + rejects == input_rows, "images": images, "records": records,
        "planned_images": manifest["images"], "input_rows": input_rows, "rejects": rejects,
        "rejects_by_reason": dict(sorted(by_reason.items())),
        "conservation": {"input_rows": input_rows, "records": records, "rejects": rejects,
                         "holds": records + rejects == input_rows},
        "duplicates": {"ids": by_reason.get("duplicate_id", 0), "prompts": by_reason.get("duplicate_prompt", 0)},
        "truncated_prompts": {"records": c["truncated_records"], "images": c["truncated_images"]},
        # negative prompts of unguided images (guidance <= 1; every image of a family without
        # classifier-free guidance): they played no part
        "negative_prompts_unused": {"records": c["unused_negative_records"], "images": c["unused_negative_images"]},
        # a guidance given to a model that takes none (FLUX.1 [schnell]): it played no part
        "guidance_unused": {"records": c["unused_guidance_records"], "images": c["unused_guidance_images"]},
        "slices": manifest["slices"], "committed_slices": c["committed_slices"],
        "problems": problems,
        "hosts": host_figures(tally.hosts),
        "wall_times": {"generate_s": round(end - start, 1) if start is not None else None, "collect_s": collect_s},
        "compiles_after_warmup": c["compiles_after_warmup"],
        **extra,
    }
