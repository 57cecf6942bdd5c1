import os

from pipeline.bench import upload as upload_bench


def test_upload_bench_reports_each_parallelism(gcs_emulator):
    report = upload_bench.run(count=12, size=10_000, parallel=(4,))
    assert report["latencies_ms"] == [0] and report["results"][0]["repeats"] == 1
    assert [(r["latency_ms"], r["parallel"]) for r in report["results"]] == [(0, 1), (0, 4)]
    for r in report["results"]:
        assert r["objects"] == 12 and r["objects_per_s"] > 0 and r["mb_per_s"] > 0
        assert "requests" not in r  # no proxy at 0 ms
    assert report["results"][0]["speedup_vs_1"] == 1.0
    assert "objects/s" in upload_bench.table(report)


def test_upload_bench_with_added_latency_side_by_side(gcs_emulator):
    emulator_host = os.environ["STORAGE_EMULATOR_HOST"]
    report = upload_bench.run(count=6, size=5_000, parallel=(4,), latency_ms=(15, 0), repeats=2)
    assert report["latencies_ms"] == [0, 15]
    assert [(r["latency_ms"], r["parallel"]) for r in report["results"]] == [(0, 1), (0, 4), (15, 1), (15, 4)]
    for r in report["results"]:
        assert r["objects"] == 6 and r["repeats"] == 2 and len(r["objects_per_s_each"]) == 2
        assert r["objects_per_s"] > 0
    by_latency = {lat: [r for r in report["results"] if r["latency_ms"] == lat] for lat in (0, 15)}
    for rows in by_latency.values():  # ratios are against 1 worker at the same latency
        assert rows[0]["speedup_vs_1"] == 1.0
        assert rows[1]["speedup_vs_1"] == round(rows[1]["objects_per_s"] / rows[0]["objects_per_s"], 2)
    for r in by_latency[15]:  # one upload request per object went through the proxy, none failed
        assert r["requests"] == 6 * 2 and r["upstream_errors"] == 0 and r["connections"] >= 0
    assert "proxy" in report["latency"]  # the report says how the latency was added
    table = upload_bench.table(report)
    assert "latency_ms" in table and len(table.splitlines()) == 2 + 4
    # the client points at the emulator again, and still works
    assert os.environ["STORAGE_EMULATOR_HOST"] == emulator_host
    from pipeline.io import gcs, storage

    assert not [b.name for b in gcs.client().list_buckets() if b.name.startswith("promptmill-bench-")]
    storage.write_bytes(f"gs://{gcs_emulator}/after-bench.txt", b"ok")
    assert storage.read_bytes(f"gs://{gcs_emulator}/after-bench.txt") == b"ok"


def test_proxy_holds_each_request_for_its_latency(gcs_emulator):
    import time

    from pipeline.io import gcs, storage
    from pipeline.testing.fault_proxy import FaultyProxy

    upstream = int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
    previous = os.environ["STORAGE_EMULATOR_HOST"]
    with FaultyProxy(upstream, failure_rate=0.0, latency_s=0.2, max_upstream=1) as proxy:
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{proxy.port}"
        gcs.reset_client()
        try:
            storage.write_bytes(f"gs://{gcs_emulator}/latency/warm.bin", b"x")
            start = time.perf_counter()
            storage.write_bytes(f"gs://{gcs_emulator}/latency/one.bin", b"y")
            assert time.perf_counter() - start >= 0.2  # a lower bound only: sleeping is never shorter
            assert storage.read_bytes(f"gs://{gcs_emulator}/latency/one.bin") == b"y"
        finally:
            os.environ["STORAGE_EMULATOR_HOST"] = previous
            gcs.reset_client()
    assert proxy.counts["forwarded"] >= 3 and proxy.upstream_errors == 0
    assert sum(proxy.counts[k] for k in ("503", "429", "dropped")) == 0
