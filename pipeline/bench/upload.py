"""``promptmill bench upload``: objects/s and MB/s to GCS with N parallel uploads vs 1.

Runs against a GCS emulator on 127.0.0.1 (started here unless ``STORAGE_EMULATOR_HOST``
is already set), through the same storage layer the hosts use. The emulator answers one
request at a time in about 10 ms, so on its own it hides what parallel uploads buy on
real GCS, where a request takes 20-50 ms of round trip and the service scales out. With
``latency_ms`` the uploads go through a ``fault_proxy.FaultyProxy`` that holds each request
that long (concurrent requests wait at the same time) and then passes at most
``MAX_UPSTREAM`` at a time to the emulator (it serves one at a time anyway, and drops
connections beyond its listen backlog of 5). Each latency is measured with every
parallelism, ratios against 1 worker at the same latency.

The emulator rewrites the metadata of every object it holds on each upload, so it slows
down as objects pile up: every measurement starts with an empty bucket (soft delete
off, so deleted objects are gone), and ``repeats`` runs the whole grid that many times
in turns, so that drift in a shared machine's speed hits every cell alike.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from pipeline.io import gcs, storage
from pipeline.testing import emulator, fault_proxy

BUCKET = "promptmill-bench"
MAX_UPSTREAM = 4


def measure(prefix: str, count: int, size: int, parallel: int) -> dict:
    """Upload ``count`` objects of ``size`` bytes with ``parallel`` workers; returns rates."""
    payloads = [os.urandom(size) for _ in range(count)]
    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda n: storage.write_bytes(f"{prefix}/p{parallel}/{n:06d}.bin", payloads[n]), range(count)))
    seconds = time.perf_counter() - start
    return {"parallel": parallel, "objects": count, "object_bytes": size, "seconds": round(seconds, 3),
            "objects_per_s": round(count / seconds, 1), "mb_per_s": round(count * size / seconds / 1e6, 2)}


@contextlib.contextmanager
def _through_proxy(latency_ms: float, bucket: str):
    """Point the GCS client at a proxy adding ``latency_ms`` per request (none for 0);
    yields the proxy or None. The environment and the client are restored after."""
    if latency_ms <= 0:
        yield None
        return
    previous = os.environ["STORAGE_EMULATOR_HOST"]
    upstream = int(previous.rstrip("/").rsplit(":", 1)[1])
    with fault_proxy.FaultyProxy(upstream, failure_rate=0.0, latency_s=latency_ms / 1000,
                              max_upstream=MAX_UPSTREAM) as proxy:
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{proxy.port}"
        gcs.reset_client()
        try:
            storage.write_bytes(f"gs://{bucket}/warm-up.bin", b"")  # a new client's first use also reads
            yield proxy  # the bucket: keep that out of the measurement
        finally:
            os.environ["STORAGE_EMULATOR_HOST"] = previous
            gcs.reset_client()


def _proxy_counts(proxy) -> dict:
    if proxy is None:
        return {}
    return {"requests": proxy.counts["forwarded"], "upstream_errors": proxy.upstream_errors,
            "connections": proxy.connections}


def _empty(client, bucket: str) -> None:
    for blob in client.list_blobs(bucket):
        blob.delete()


def _latencies(latency_ms: float | Iterable[float]) -> list[float]:
    values = [latency_ms] if isinstance(latency_ms, (int, float)) else list(latency_ms)
    return sorted(set(values))


def run(count: int = 200, size: int = 100_000, parallel: tuple[int, ...] = (1, 4, 16),
        latency_ms: float | Iterable[float] = 0, repeats: int = 1) -> dict:
    """Measure each parallelism (1 always included) at each added latency, in one process.

    Rates are the median over ``repeats``; ``speedup_vs_1`` is against 1 worker at the
    same latency. Rows measured through the proxy also say how many requests it
    forwarded in all (one per object unless some were retried), how many of those the
    emulator failed, and how many connections the client opened to the proxy.
    """
    latencies, workers = _latencies(latency_ms), sorted(set(parallel) | {1})
    samples: dict[tuple[float, int], list[dict]] = {(lat, p): [] for lat in latencies for p in workers}
    context = contextlib.nullcontext() if os.environ.get("STORAGE_EMULATOR_HOST") else emulator.running(BUCKET)
    with context:
        admin = gcs.client()  # straight to the emulator, for setting up and cleaning up
        bucket = f"{BUCKET}-{uuid.uuid4().hex[:8]}"
        admin.create_bucket(bucket)
        policy = admin.bucket(bucket)
        policy.soft_delete_policy.retention_duration_seconds = 0
        policy.patch()
        try:
            for _ in range(repeats):
                for (lat, p), runs in samples.items():
                    with _through_proxy(lat, bucket) as proxy:
                        before = _proxy_counts(proxy)
                        sample = measure(f"gs://{bucket}/upload-bench", count, size, p)
                        sample.update({k: v - before[k] for k, v in _proxy_counts(proxy).items()})
                    runs.append(sample)
                    _empty(admin, bucket)
        finally:
            _empty(admin, bucket)
            admin.bucket(bucket).delete()
    results = []
    for (lat, p), runs in samples.items():
        row = {"latency_ms": lat, "parallel": p, "objects": count, "object_bytes": size, "repeats": repeats,
               **{k: statistics.median(r[k] for r in runs) for k in ("seconds", "objects_per_s", "mb_per_s")},
               "objects_per_s_each": [r["objects_per_s"] for r in runs]}
        for key in ("requests", "upstream_errors", "connections"):
            if key in runs[0]:
                row[key] = sum(r[key] for r in runs)
        results.append(row)
    for row in results:
        base = next(r for r in results if r["latency_ms"] == row["latency_ms"] and r["parallel"] == 1)
        row["speedup_vs_1"] = round(row["objects_per_s"] / base["objects_per_s"], 2)
    return {"target": "gcp-storage-emulator on 127.0.0.1", "latencies_ms": latencies,
            "latency": "added to each request by a proxy in front of the emulator (pipeline/testing/fault_proxy.py); "
                       f"concurrent requests wait at the same time, then at most {MAX_UPSTREAM} at a time go "
                       "on to the emulator",
            "results": results}


def table(report: dict) -> str:
    lines = [f"upload to {report['target']} (median of {report['results'][0]['repeats']})",
             "latency_ms  parallel  objects/s     MB/s  speedup  requests  errors  connections"]
    for r in report["results"]:
        lines.append(f"{r['latency_ms']:>10g}  {r['parallel']:>8}  {r['objects_per_s']:>9}  {r['mb_per_s']:>7}  "
                     f"{r['speedup_vs_1']:>6}x  {r.get('requests', '-'):>8}  {r.get('upstream_errors', '-'):>6}  "
                     f"{r.get('connections', '-'):>11}")
    return "\n".join(lines)
