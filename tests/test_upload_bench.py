from pipeline import upload_bench


def test_upload_bench_reports_each_parallelism(gcs_emulator):
    report = upload_bench.run(count=12, size=10_000, parallel=(4,))
    assert [r["parallel"] for r in report["results"]] == [1, 4]
    for r in report["results"]:
        assert r["objects"] == 12 and r["objects_per_s"] > 0 and r["mb_per_s"] > 0
    assert report["results"][0]["speedup_vs_1"] == 1.0
    assert "objects/s" in upload_bench.table(report)
