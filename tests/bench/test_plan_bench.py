import json
import math
import os

import pytest

from pipeline.bench import plan_scale as plan_bench, prompts
from pipeline.core import records
from tests.conftest import ROOT


def test_generated_prompts_are_deterministic_and_parse_as_expected(tmp_path):
    rows, shards = 25_000, 3
    first = prompts.generate(str(tmp_path / "a"), rows, shards)
    second = prompts.generate(str(tmp_path / "b"), rows, shards)
    assert [os.path.basename(p) for p in first["paths"]] == [prompts.shard_name(k, 3) for k in range(3)]
    for a, b in zip(first["paths"], second["paths"]):
        with open(a, "rb") as fa, open(b, "rb") as fb:
            assert fa.read() == fb.read()
    assert first["bytes"] == sum(os.path.getsize(p) for p in first["paths"])
    reasons, lengths, fields = {}, [], set()
    for path in first["paths"]:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        assert lines.pop() == b""  # every row ends with a newline
        for number, raw in enumerate(lines, start=1):
            row = records.parse_jsonl_line(raw, path, number, 0, f"{path}:{number}")
            if isinstance(row, records.Reject):
                reasons[row.reason] = reasons.get(row.reason, 0) + 1
            else:
                lengths.append(len(row.prompt))
                fields.update(json.loads(raw))
    assert reasons == prompts.expected_rejects(rows) == {"invalid_json": 1, "empty_prompt": 1, "bad_num_images": 1}
    assert len(lengths) == rows - 3
    assert min(lengths) >= prompts.MIN_CHARS and max(lengths) <= prompts.MAX_CHARS
    assert 80 < sum(lengths) / len(lengths) < 150
    assert {"prompt", "id", "seed", "num_images", "negative_prompt", "guidance_scale", "collection"} <= fields
    # one row in 10 repeats the id of the row before it; a repeat of a bad row's id is no repeat
    repeated = prompts.generate(str(tmp_path / "c"), rows, shards, duplicates=10)
    seen, later = set(), 0
    for path in repeated["paths"]:
        with open(path, "rb") as f:
            for number, raw in enumerate(f.read().split(b"\n")[:-1], start=1):
                row = records.parse_jsonl_line(raw, path, number, 0, f"{path}:{number}")
                if isinstance(row, records.Record):
                    later += row.id in seen
                    seen.add(row.id)
    assert later == prompts.expected_duplicate_ids(rows, 10) == 2499  # bad row 9990: row 9991 gives the id first


def test_a_sweep_gives_the_growth_of_the_plan_and_of_its_reference(monkeypatch):
    def run(prompts, workdir=None, **options):  # a plan whose peak grows 1 byte a record, its reference 3
        return {"rows": prompts, "peak_rss_mib": prompts / 2**20, "tree_peak_rss_mib": 2 * prompts / 2**20,
                "reference": {"peak_rss_mib": 3 * prompts / 2**20}}

    monkeypatch.setattr(plan_bench, "run", run)
    assert plan_bench.sweep([10, 30])["growth"] == [
        {"from": 10, "to": 30, "peak_rss_bytes_per_record": 1.0, "tree_peak_rss_bytes_per_record": 2.0,
         "reference_peak_rss_bytes_per_record": 3.0}]


def test_a_reference_plan_is_the_same_when_every_object_it_wrote_is_ours_byte_for_byte():
    """An earlier version may not write an object this one adds (the key index): that is said,
    not a difference; an object of its that differs or that this version did not write is."""
    theirs = {"objects": {"plan/manifest.json": "a", "plan/slices/0": "b"}}
    ours = {"objects": {"plan/manifest.json": "a", "plan/slices/0": "b", "plan/keys/00000.parquet": "k",
                        "plan/keys/00001.parquet": "l"}}
    assert plan_bench.compare_plans(ours, theirs) == {"same_plan_bytes": True, "objects_compared": 2, "differ": [],
                                                      "missing": [], "only_ours": {"plan/keys": 2}}
    changed = {"objects": {**ours["objects"], "plan/slices/0": "c"}}
    assert plan_bench.compare_plans(changed, theirs)["differ"] == ["plan/slices/0"]
    lost = {"objects": {"plan/manifest.json": "a"}}
    assert plan_bench.compare_plans(lost, theirs)["missing"] == ["plan/slices/0"]
    assert not plan_bench.compare_plans(lost, theirs)["same_plan_bytes"]


def test_plan_bench_small(tmp_path, model_cache):
    rows, shards = 3_000, 3
    workdir = tmp_path / "bench"
    report = plan_bench.run(prompts=rows, shards=shards, workdir=str(workdir), devices_per_host=2,
                            per_device_batch=4, batches_per_slice=64, dedupe=True, duplicates=0.1, again=True,
                            reference=ROOT)
    assert report["verified"] and report["workdir"] == str(workdir)
    assert report["settings"]["slice_size"] == 512 and report["settings"]["shards"] == shards
    manifest = report["manifest"]
    assert manifest["records"] + manifest["rejects"] == rows == report["rows"]
    assert {k: v for k, v in manifest["rejects_by_reason"].items() if k != "duplicate_prompt"} == {
        "invalid_json": 1, "duplicate_id": 300}
    # the same plan again kept the plan: no plan object written again, and timed
    # the manifest, a rejects file a shard and the plan's key index (one bucket at this size)
    assert report["again"]["plan_objects_unchanged"] == report["slice_files"] + 1 + shards + 1
    assert 0 < report["again"]["wall_s"] and report["again"]["over_first"] == pytest.approx(
        report["again"]["wall_s"] / report["wall_s"], abs=0.01)
    assert 0 < report["again"]["stage_s"] < report["stage_s"] < report["wall_s"]  # the plan stage, without start-up
    # a reference checkout (this one here) plans the same input into the same plan/ bytes
    assert report["reference"]["same_plan_bytes"] and report["reference"]["peak_rss_mib"] > 0
    assert report["peak_rss_bytes_per_record"] == pytest.approx(report["peak_rss_mib"] * 2**20 / rows, rel=0.01)
    assert report["slice_files"] == manifest["slices"] == math.ceil(manifest["records"] / 512)
    assert report["slice_items"] == manifest["images"] == manifest["records"]
    assert (report["held_records"], report["held_rejects"]) == (rows - 1, 1)  # every row parsed; the duplicates too
    assert report["wall_s"] > 0 and report["cpu_s"] > 0 and report["rows_per_s"] > 0
    assert report["input_bytes"] == sum(p.stat().st_size for p in (workdir / "prompts").iterdir())
    assert 0 < report["prompt_bytes"] < report["input_bytes"]
    # the plan process's own peak: more than the bare imports, and not the bench's (parent's) memory
    assert 0 < report["baseline_rss_mib"] < report["peak_rss_mib"] < 2048
    assert report["tree_peak_rss_mib"] > 0 and report["processes_seen"] >= 1
    # the kernel's peak and the /proc samples agree: the peak is not the bench's memory carried over exec
    assert report["peak_rss_mib"] - 64 <= report["sampled_hwm_mib"] <= report["peak_rss_mib"] + 1
    assert report["held_in_memory_rss_mib"] > 0
    assert report["held_in_memory_total_rss_mib"] >= report["baseline_rss_mib"]
    # both sides are rounded to 0.1 MiB on their own
    assert report["plan_increment_mib"] == pytest.approx(report["peak_rss_mib"] - report["baseline_rss_mib"], abs=0.11)
    assert json.loads(json.dumps(report)) == report
    table = plan_bench.table(report)
    assert "peak RSS" in table and "held in memory" in table and "verified" in table and "plan again" in table
    swept = {"runs": [report, {**report, "rows": 2 * rows}], "growth": [
        {"from": rows, "to": 2 * rows, "peak_rss_bytes_per_record": 1.0, "tree_peak_rss_bytes_per_record": 2.0}]}
    assert "peak RSS grew 1.0 bytes a record from 3,000 to 6,000 prompts (tree: 2.0)" in plan_bench.table(swept)
    swept["growth"][0]["reference_peak_rss_bytes_per_record"] = 3.0
    assert "(tree: 2.0; reference: 3.0)" in plan_bench.table(swept)
    assert "3,000 reference: " in plan_bench.table(swept) and "the same plan/ bytes: True" in plan_bench.table(swept)

    # the check fails loudly when the plan's output does not match the input
    os.remove(workdir / "out" / "plan" / "slices" / sorted(os.listdir(workdir / "out" / "plan" / "slices"))[-1])
    with pytest.raises(plan_bench.BenchError, match="slice files"):
        plan_bench.verify(str(workdir / "out"), rows, 512, 10, dedupe=True)
    with pytest.raises(plan_bench.BenchError, match="records"):
        plan_bench.verify(str(workdir / "out"), rows + 1, 512, 10, dedupe=True)
    # a workdir the bench did not make is refused
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(plan_bench.BenchError, match="not empty"):
        plan_bench.run(prompts=10, shards=1, workdir=str(tmp_path / "other"))
