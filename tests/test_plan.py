import json

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from pipeline import naming, plan, storage
from pipeline.settings import Settings

ROWS = [
    ("/d/b.jsonl", 1, b'{"prompt": "b one", "id": "b1"}'),
    ("/d/a.jsonl", 1, b'{"prompt": "a one", "id": "a1", "num_images": 3}'),
    ("/d/a.jsonl", 2, b'{"prompt": ""}'),
    ("/d/a.jsonl", 3, b"{oops"),
    ("/d/a.jsonl", 4, b""),
    ("/d/a.jsonl", 5, b'{"prompt": "a five"}'),
    ("/d/b.jsonl", 2, b'{"prompt": "b two", "num_images": 0}'),
    ("/d/b.jsonl", 3, b'{"prompt": "b three", "id": "b3", "seed": 9}'),
]


def test_validate_and_cut_slices_under_test_pipeline():
    with TestPipeline() as p:
        validated = p | beam.Create(ROWS) | plan.ValidateRows(run_seed=0, root="/d")
        rejects = validated[plan.ValidateRows.REJECTS] | "R" >> beam.Map(lambda r: (r.source, r.line, r.reason))
        assert_that(rejects, equal_to([("/d/a.jsonl", 2, "empty_prompt"), ("/d/a.jsonl", 3, "invalid_json"),
                                       ("/d/b.jsonl", 2, "bad_num_images")]), label="rejects")
        slices = validated.records | plan.CutSlices(size=2)
        keys = slices | "K" >> beam.MapTuple(lambda index, items: (index, [(i.key, i.position) for i in items]))
        # positions follow (source, line): a.jsonl first, then b.jsonl
        assert_that(keys, equal_to([
            (0, [("a1_0000", 0), ("a1_0001", 1)]),
            (1, [("a1_0002", 2), (naming.output_key("a.jsonl:5", 0), 3)]),
            (2, [("b1_0000", 4), ("b3_0000", 5)]),
        ]), label="slices")


def test_read_prompt_rows_numbers_lines_per_file(tmp_path):
    (tmp_path / "x.jsonl").write_bytes(b'{"prompt": "1"}\n\n{"prompt": "3"}\r\n')
    with TestPipeline() as p:
        rows = p | plan.ReadPromptRows(str(tmp_path / "*.jsonl"))
        assert_that(rows | beam.MapTuple(lambda s, n, raw: (s.rsplit("/", 1)[-1], n, raw)),
                    equal_to([("x.jsonl", 1, b'{"prompt": "1"}'), ("x.jsonl", 2, b""),
                              ("x.jsonl", 3, b'{"prompt": "3"}')]))


@pytest.mark.parametrize("pattern,root", [("/d/*.jsonl", "/d/"), ("/d/sub/a.jsonl", "/d/sub"),
                                          ("gs://b/p/**/x*.jsonl", "gs://b/p/"), ("/d/a?.jsonl", "/d")])
def test_input_root(pattern, root):
    assert plan.input_root(pattern) == root


def test_run_plan_writes_run_manifest_slices_and_rejects(tmp_path, model_cache):
    prompts = tmp_path / "in"
    prompts.mkdir()
    (prompts / "p.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "one"}, {"prompt": "two", "num_images": 2}, {"no": "prompt"}, {"prompt": "four"}]) + "\n")
    out = str(tmp_path / "out")
    settings = Settings(prompts=str(prompts / "*.jsonl"), out=out, devices_per_host=2, batches_per_slice=1)
    manifest = plan.run_plan(settings)
    assert manifest == {"slice_size": 2, "slices": 2, "records": 3, "images": 4, "rejects": 1,
                        "rejects_by_reason": {"missing_prompt": 1}, "input_rows": 4}
    run = storage.read_json(naming.run_json(out))
    assert run["settings"]["width"] == run["settings"]["height"] == 32  # the tiny model's native size
    assert len(run["model_fingerprint"]) == 64 and run["scheduler"] == run["settings"]["scheduler"] == "ddim"
    items = [json.loads(line) for i in range(2) for line in storage.read_text(naming.plan_slice(out, i)).splitlines()]
    assert [(i["id"], i["image_index"]) for i in items] == [("p.jsonl:1", 0), ("p.jsonl:2", 0), ("p.jsonl:2", 1),
                                                            ("p.jsonl:4", 0)]
    [rejects] = storage.glob(naming.join(out, "plan", "rejects", "*.jsonl"))
    [reject] = [json.loads(line) for line in storage.read_text(rejects).splitlines()]
    assert (reject["line"], reject["reason"]) == (3, "missing_prompt")
    assert reject["source"].endswith("p.jsonl")


def test_run_plan_without_matching_files_is_a_clear_error(tmp_path):
    with pytest.raises(plan.PlanError, match="no prompt files match"):
        plan.run_plan(Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "o")))


def test_replanning_the_same_out_with_other_settings_is_refused(tmp_path, model_cache):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n')
    settings = Settings(prompts=str(tmp_path / "p.jsonl"), out=str(tmp_path / "out"))
    first = plan.run_plan(settings)
    assert plan.run_plan(settings) == first  # the same settings: idempotent
    with pytest.raises(plan.PlanError, match=r"other settings \(changed: steps\)"):
        plan.run_plan(settings.replace(steps=settings.steps + 1))
