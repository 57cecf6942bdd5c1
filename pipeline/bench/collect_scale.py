"""``promptmill bench collect --images N``: collect, look-ups and status at scale, without a model.

The bench fabricates a committed run of N images (``pipeline.testing.fabricate``: a real
plan's files and the hosts' own writer, several hosts' worth, each image a small flat
PNG), then measures, each in a fresh process started from a small launcher
(``pipeline.bench.process_memory.run_measured``: the kernel's peak RSS of the process, the largest
RSS sum over its process tree):

  collect     ``promptmill collect --out OUT``: wall and CPU seconds, peak RSS
  lookups     ``reproduce``'s look-up (``reproduce.find_rows``: the plan's key index, then
              the slice's metadata shard) of ``--lookups`` random keys, one after the
              other: seconds per key
  lookup      the same for one key: peak RSS, and the bytes it read against the bytes of
              the dataset's metadata (``dataset/metadata/``)
  status      ``promptmill status OUT --json``: wall seconds

and counts the objects the plan and the hosts, then collect, wrote, by kind: per image, per slice, per
part, per index bucket, per run. The report's ``write_ops_per_billion`` carries those
counts to 10^9 images at the same slice size (object counts follow from the layout:
they are arithmetic, not a measurement), with their cost at ``CLASS_A_USD_PER_1000``.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time

from pipeline.bench.process_memory import mib, run_measured
from pipeline.core import naming
from pipeline.io import storage
from pipeline.output import key_index
from pipeline.testing import fabricate

# GCS Standard storage, Class A operations (object writes, listings): USD per 1,000, as
# https://cloud.google.com/storage/pricing lists them for a region (2025); an assumption
# of the report, not a measurement
CLASS_A_USD_PER_1000 = 0.005
BILLION = 10 ** 9
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def count_objects(out: str, slices: int) -> dict:
    """Objects under ``out`` by what they are per: image, slice, part, bucket or run (pure
    of the names: a per-slice object holds a slice's spread name or number)."""
    names = [path[len(out.rstrip("/")) + 1:] for path in sorted(storage.files(out))]
    kinds = {"per_image": 0, "per_slice": 0, "per_part": 0, "per_bucket": 0, "per_run": 0}
    for name in names:
        if name.startswith("images/") and not name.endswith("metadata.jsonl"):
            kinds["per_image"] += 1
        elif name.startswith(("shards/", "thumbs/", "parquet/", "images/", "plan/slices/", "zarr/images/c/",
                              "zarr/key/c/", "zarr/dropped/c/")):
            kinds["per_slice"] += 1
        elif name.startswith("dataset/metadata/"):
            kinds["per_part"] += 1
        elif name.startswith(("dataset/index/", "plan/keys/")):
            kinds["per_bucket"] += 1
        else:
            kinds["per_run"] += 1
    return {**kinds, "total": len(names), "per_slice_each": round(kinds["per_slice"] / slices, 3)}


def per_billion(written_before: dict, collect_objects: dict, slice_size: int, part_rows: int) -> dict:
    """Write operations (one per object written) at 10^9 images of the same layout, and their
    cost (pure): objects per image as counted, per slice at 10^9 / slice size slices, per
    part and per index bucket likewise."""
    slices = BILLION / slice_size
    per_slice = (written_before["per_slice_each"] + collect_objects["per_slice_each"])
    writes = {"per_image": BILLION * (written_before["per_image"] / max(1, written_before["images"])),
              "per_slice": slices * per_slice,
              "per_part": BILLION / part_rows, "per_bucket": 2 * key_index.bucket_count(BILLION)}
    total = sum(writes.values())
    return {**{k: round(v) for k, v in writes.items()}, "total": round(total),
            "usd": round(total / 1000 * CLASS_A_USD_PER_1000, 2), "usd_per_1000_writes": CLASS_A_USD_PER_1000}


def lookup(out: str, report: str, keys: list[str]) -> int:
    """In a child process (``python -m pipeline.bench.collect_scale lookup OUT REPORT KEY...``):
    look the keys up one after the other; write seconds and bytes read to REPORT."""
    from pipeline.generate import reproduce

    reads, started = [], time.perf_counter()
    for key in keys:
        if key not in reproduce.find_rows(out, [key], reads):
            raise SystemExit(f"{key} not found")
    seconds = time.perf_counter() - started
    with open(report, "w") as f:
        json.dump({"keys": len(keys), "seconds": seconds, "bytes_read": sum(size for _, size in reads),
                   "objects_read": len(reads)}, f)
    return 0


def _measure(argv: list[str], workdir: str, name: str) -> dict:
    result = run_measured(argv, dict(os.environ), ROOT, os.path.join(workdir, name))
    return {"wall_s": round(result["wall_s"], 2), "cpu_s": round(result["cpu_s"], 2),
            "peak_rss_mib": mib(result["peak_rss_kib"]), "tree_peak_rss_mib": mib(result["tree_peak_rss_kib"])}


def run(images: int, workdir: str | None = None, slice_size: int = 1024, hosts: int = 4, chosen=("files",), *,
        lookups: int = 100, part_rows: int | None = None, seed: int = 0) -> dict:
    """Fabricate, collect, look up and ask the status of a run of ``images``; returns the report."""
    from pipeline.collect.parts import PART_ROWS

    part_rows = part_rows or PART_ROWS
    keep = workdir is not None
    workdir = workdir or tempfile.mkdtemp(prefix="bench-collect-")
    out = os.path.join(workdir, "out")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(workdir, exist_ok=True)
    watch = time.perf_counter()
    fabricate.fabricate(out, images, slice_size=slice_size, hosts=hosts, chosen=chosen,
                        prompts=os.path.join(workdir, "prompts.jsonl"))
    fabricated_s = time.perf_counter() - watch
    slices = -(-images // slice_size)
    written_before = {**count_objects(out, slices), "images": images}
    python = [sys.executable, "-m"]
    collected = _measure([*python, "jobs.cli", "collect", "--out", out, "--part-rows", str(part_rows),
                          "--log-level", "warning"], workdir, "collect")
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    after = count_objects(out, slices)
    collect_objects = {k: after[k] - written_before[k] for k in ("per_image", "per_slice", "per_part", "per_bucket",
                                                                 "per_run", "total")}
    collect_objects["per_slice_each"] = round(collect_objects["per_slice"] / slices, 3)
    rng = random.Random(seed)
    keys = [naming.output_key(f"r{rng.randrange(images):07d}", 0) for _ in range(lookups)]
    measured = {}
    for name, chosen_keys in (("lookups", keys), ("lookup", keys[:1])):
        report_path = os.path.join(workdir, f"{name}.json")
        measured[name] = _measure([*python, "pipeline.bench.collect_scale", "lookup", out, report_path,
                                   *chosen_keys], workdir, name)
        with open(report_path) as f:
            measured[name].update(json.load(f))
    metadata_bytes = sum(os.path.getsize(p) for p in storage.files(naming.join(out, "dataset", "metadata"), "*"))
    status = _measure([*python, "jobs.cli", "status", out, "--json"], workdir, "status")
    report = {
        "bench": "collect", "images": images, "slice_size": slice_size, "slices": slices, "hosts": hosts,
        "formats": list(chosen), "part_rows": part_rows, "verified": stats["verified"],
        "fabricate_s": round(fabricated_s, 1), "collect": collected,
        "collect_s_per_million_images": round(collected["wall_s"] / images * 1e6, 1),
        "lookups": {**measured["lookups"], "seconds_per_key": round(measured["lookups"]["seconds"] / lookups, 4)},
        "lookup_one_key": {**measured["lookup"], "metadata_bytes": metadata_bytes,
                           "share_of_metadata_read": round(measured["lookup"]["bytes_read"] / metadata_bytes, 6)},
        "status": status, "objects_written": {"plan_and_hosts": written_before, "collect": collect_objects},
        "objects_per_image": round((written_before["total"] + collect_objects["total"]) / images, 4),
        "write_ops_per_billion": per_billion(written_before, collect_objects, slice_size, part_rows),
        "machine": {"nproc": os.cpu_count(), "loadavg": list(os.getloadavg())},
    }
    if not keep:
        shutil.rmtree(workdir)
    return report


def table(report: dict) -> str:
    """The report for people."""
    c, one, many = report["collect"], report["lookup_one_key"], report["lookups"]
    w = report["write_ops_per_billion"]
    return "\n".join([
        f"bench collect: {report['images']:,} images, slices of {report['slice_size']}, {report['hosts']} hosts, "
        f"{','.join(report['formats'])} (verified: {report['verified']})",
        f"  collect   {c['wall_s']:>9.1f} s wall, {c['cpu_s']:.1f} s CPU, peak RSS {c['peak_rss_mib']} MiB "
        f"(tree {c['tree_peak_rss_mib']} MiB)",
        f"  look-ups  {many['seconds_per_key'] * 1000:>9.1f} ms a key ({many['keys']} keys); one key: peak RSS "
        f"{one['peak_rss_mib']} MiB, {one['bytes_read']:,} bytes read of {one['metadata_bytes']:,} "
        f"({one['share_of_metadata_read']:.4%})",
        f"  status    {report['status']['wall_s']:>9.2f} s",
        f"  objects   {report['objects_per_image']} per image (plan, hosts and collect)",
        f"  at 10^9 images: {w['total']:,} writes, ${w['usd']:,} at ${w['usd_per_1000_writes']} per 1,000",
    ])


def _main(argv: list[str]) -> int:
    if argv[:1] == ["lookup"] and len(argv) >= 4:
        return lookup(argv[1], argv[2], argv[3:])
    raise SystemExit("usage: python -m pipeline.bench.collect_scale lookup OUT REPORT KEY [KEY ...]")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
