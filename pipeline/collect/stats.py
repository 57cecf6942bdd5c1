"""The dataset's stats (the content of ``dataset/stats.json``), without Beam: from every
slice's verification summary, every rejects file's counts by reason, and the manifest.

``verified`` holds when no key is missing, duplicated or unexpected and conservation
holds: input rows = planned records + rejects. With score filters, every planned image
is accounted for too: planned images = images + dropped images (each dropped one has
its metadata row, with the rules it failed).
"""
from __future__ import annotations

import collections
import datetime as dt

import numpy as np

from pipeline.core import buckets

QUANTILES = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)


def score_stats(values: dict[str, np.ndarray], flagged: int | None = None) -> dict:
    """Each score's count, mean, min, quantiles (``QUANTILES``, numpy's linear
    interpolation) and max (pure), from its values over every scored image, kept or
    dropped; ``flagged``: how many images the safety checker flagged."""
    found = {}
    for name, array in sorted(values.items()):
        array = np.asarray(array, np.float64)
        if not len(array):
            continue
        found[name] = {"count": int(len(array)), "mean": round(float(array.mean()), 6),
                       "min": round(float(array.min()), 6),
                       "quantiles": {f"p{round(q * 100):02d}": round(float(v), 6)
                                     for q, v in zip(QUANTILES, np.quantile(array, QUANTILES))},
                       "max": round(float(array.max()), 6)}
    if flagged is not None:
        found["nsfw"] = {"flagged": int(flagged)}
    return found

MAX_KEYS_IN_MESSAGE = 20  # keys kept per kind of problem


def size_counts(manifest: dict, summaries: list[dict]) -> dict:
    """{size: {planned, images, dropped, records, per_device_batch}} of a run of several sizes
    (pure): each slice's images counted under its size."""
    geometry = buckets.Geometry.of_manifest(manifest, 0, 0, 0)
    found = {b.name: {"planned_images": b.images, "images": 0, "dropped": 0, "records": b.records,
                      "per_device_batch": b.per_device_batch} for b in geometry.buckets}
    for summary in summaries:
        counts = found[geometry.buckets[geometry.bucket_of_slice(summary["slice"])].name]
        counts["images"] += summary["ok"]
        counts["dropped"] += summary.get("dropped", 0)
    return found


def dataset_stats(manifest: dict, summaries: list[dict], reject_counts: list, collect_s: float,
                  scores: dict | None = None) -> dict:
    """stats.json's content (pure), from ``VerifySlices``'s summaries (any order) and
    ``CountRejects``'s counts; ``collect_s``: collect's wall time so far; ``scores``:
    ``score_stats`` of a run with --score."""
    summaries = sorted(summaries, key=lambda s: s["slice"])
    problems: dict[str, list[str]] = {}
    for summary in summaries:
        for kind, keys in summary["verdicts"].items():
            problems.setdefault(kind, []).extend(keys)
    images = sum(s["ok"] for s in summaries)
    by_reason = collections.Counter()
    for counts in reject_counts:
        by_reason.update(counts)
    slice_stats = [s["stats"] for s in summaries if s["stats"]]
    records = sum(s["records"] for s in summaries)
    rejects = sum(by_reason.values())
    input_rows = manifest["input_rows"]
    dropped = sum(s.get("dropped", 0) for s in summaries)
    by_rule = collections.Counter()
    for summary in summaries:
        by_rule.update(summary.get("dropped_by_rule") or {})
    extra = {}
    if manifest.get("buckets"):
        extra["sizes"] = size_counts(manifest, summaries)
    if scores:
        extra["scores"] = scores
    unreadable = [s["unreadable"] for s in summaries if s.get("unreadable")]
    if unreadable:  # committed slices whose marker or metadata cannot be read, each with how to redo it
        extra["unreadable_slices"] = {"count": len(unreadable), "first": unreadable[:MAX_KEYS_IN_MESSAGE]}
    if dropped or any("dropped" in s for s in summaries):
        # every planned image is an image, a dropped one, or a problem above
        extra["dropped"] = {"images": dropped, "by_rule": dict(sorted(by_rule.items()))}
        extra["image_conservation"] = {"planned_images": manifest["images"], "images": images, "dropped": dropped,
                                       "holds": images + dropped == manifest["images"]}
    return {
        "verified": not problems and records + rejects == input_rows, "images": images, "records": records,
        "planned_images": manifest["images"], "input_rows": input_rows, "rejects": rejects,
        "rejects_by_reason": dict(sorted(by_reason.items())),
        "conservation": {"input_rows": input_rows, "records": records, "rejects": rejects,
                         "holds": records + rejects == input_rows},
        "duplicates": {"ids": by_reason.get("duplicate_id", 0), "prompts": by_reason.get("duplicate_prompt", 0)},
        "truncated_prompts": {"records": sum(s["truncated_records"] for s in summaries),
                              "images": sum(s["truncated_images"] for s in summaries)},
        # negative prompts of unguided images (guidance <= 1; every image of a family without
        # classifier-free guidance): they played no part
        "negative_prompts_unused": {"records": sum(s["unused_negative_records"] for s in summaries),
                                    "images": sum(s["unused_negative_images"] for s in summaries)},
        # a guidance given to a model that takes none (FLUX.1 [schnell]): it played no part
        "guidance_unused": {"records": sum(s.get("unused_guidance_records", 0) for s in summaries),
                            "images": sum(s.get("unused_guidance_images", 0) for s in summaries)},
        "slices": manifest["slices"], "committed_slices": len(slice_stats),
        "problems": {kind: {"count": len(keys), "keys": keys[:MAX_KEYS_IN_MESSAGE]}
                     for kind, keys in sorted(problems.items())},
        "hosts": host_stats(slice_stats),
        "wall_times": {"generate_s": generate_wall_s(slice_stats), "collect_s": collect_s},
        "compiles_after_warmup": sum(s.get("compiles_after_warmup", 0) for s in slice_stats),
        **extra,
    }


HOST_TIMES = ("input_s", "device_wait_s", "output_s", "device_busy_s")  # per slice, from pipeline.generate.host_loop


def host_stats(slice_stats: list[dict]) -> dict:
    """Per host: images, slices, seconds and images/s, and the slices' summed time spent
    preparing inputs, waiting for the devices, and handing images to the writers, and the
    devices' busy time."""
    hosts: dict[int, dict] = {}
    for stats in slice_stats:
        host = hosts.setdefault(stats["host"], {"images": 0, "seconds": 0.0, "slices": 0,
                                                **{name: 0.0 for name in HOST_TIMES}})
        host["images"] += stats["images"]
        host["seconds"] += stats["seconds"]
        host["slices"] += 1
        for name in HOST_TIMES:
            host[name] += stats.get(name, 0.0)
    for host in hosts.values():
        for name in ("seconds", *HOST_TIMES):
            host[name] = round(host[name], 3)
        host["images_per_s"] = round(host["images"] / host["seconds"], 3) if host["seconds"] else None
    return {str(h): v for h, v in sorted(hosts.items())}


def generate_wall_s(slice_stats: list[dict]) -> float | None:
    """From the first slice's start to the last slice's end, as the hosts recorded them."""
    spans = []
    for stats in slice_stats:
        if "committed_ts" in stats:
            spans.append((stats["started_ts"], stats["committed_ts"]))
        elif "finished_at" in stats:
            end = dt.datetime.fromisoformat(stats["finished_at"]).timestamp()
            spans.append((end - stats["seconds"], end))
    return round(max(e for _, e in spans) - min(s for s, _ in spans), 1) if spans else None
