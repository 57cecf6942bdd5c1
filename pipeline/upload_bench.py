"""``promptmill bench upload``: objects/s and MB/s to GCS with N parallel uploads vs 1.

Runs against a GCS emulator on 127.0.0.1 (started here unless ``STORAGE_EMULATOR_HOST``
is already set), through the same storage layer the hosts use.
"""
from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline import emulator, storage


def measure(prefix: str, count: int, size: int, parallel: int) -> dict:
    """Upload ``count`` objects of ``size`` bytes with ``parallel`` workers; returns rates."""
    payloads = [os.urandom(size) for _ in range(count)]
    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda n: storage.write_bytes(f"{prefix}/p{parallel}/{n:06d}.bin", payloads[n]), range(count)))
    seconds = time.perf_counter() - start
    return {"parallel": parallel, "objects": count, "object_bytes": size, "seconds": round(seconds, 3),
            "objects_per_s": round(count / seconds, 1), "mb_per_s": round(count * size / seconds / 1e6, 2)}


def run(count: int = 200, size: int = 100_000, parallel: tuple[int, ...] = (1, 4, 16)) -> dict:
    """Measure each parallelism side by side in one process; ratios are against 1 worker."""
    context = contextlib.nullcontext() if os.environ.get("STORAGE_EMULATOR_HOST") else \
        emulator.running("promptmill-bench")
    with context:
        bucket = "promptmill-bench"
        with contextlib.suppress(Exception):
            storage._gcs_client().create_bucket(bucket)
        results = [measure(f"gs://{bucket}/upload-bench", count, size, p) for p in sorted(set(parallel) | {1})]
    base = next(r for r in results if r["parallel"] == 1)["objects_per_s"]
    for r in results:
        r["speedup_vs_1"] = round(r["objects_per_s"] / base, 2)
    return {"target": "gcp-storage-emulator on 127.0.0.1", "results": results}


def table(report: dict) -> str:
    lines = [f"upload to {report['target']}", "parallel  objects/s     MB/s  speedup"]
    for r in report["results"]:
        lines.append(f"{r['parallel']:>8}  {r['objects_per_s']:>9}  {r['mb_per_s']:>7}  {r['speedup_vs_1']:>6}x")
    return "\n".join(lines)
