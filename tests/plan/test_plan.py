import collections
import json
import os

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.io import storage
from pipeline.io import runs
from pipeline.output import key_index
from pipeline.plan import duplicates, index, input_table, layout, transforms as plan
from pipeline.plan.prepare import prepare

FILES = {
    "b.jsonl": [b'{"prompt": "b one", "id": "b1"}', b'{"prompt": "b two", "num_images": 0}',
                b'{"prompt": "b three", "id": "b3", "seed": 9}'],
    "a.jsonl": [b'{"prompt": "a one", "id": "a1", "num_images": 2}', b'{"prompt": ""}', b"{oops", b"",
                b'{"prompt": "a five"}'],
}


def write_files(folder, files):
    folder.mkdir(exist_ok=True)
    for name, lines in files.items():
        (folder / name).write_bytes(b"\n".join(lines) + b"\n")
    return str(folder)


def read_plan(out):
    """{slice index: [(key, position)]}, and [(file name, line, reason)] of every reject."""
    slices = {}
    for path in storage.glob(naming.join(out, "plan", "slices", "*.jsonl")):
        items = [json.loads(line) for line in storage.read_text(path).splitlines()]
        slices[int(path.rsplit("/", 1)[1].split(".")[0])] = [(i["key"], i["position"]) for i in items]
    rejects = [json.loads(line) for path in storage.glob(naming.join(out, "plan", "rejects", "*.jsonl"))
               for line in storage.read_text(path).splitlines()]
    return slices, sorted((r["source"].rsplit("/", 1)[1], r["line"], r["reason"]) for r in rejects)


def test_the_plan_pipeline_under_test_pipeline(tmp_path, model_cache):
    folder, out = write_files(tmp_path / "d", FILES), str(tmp_path / "out")
    settings, _ = prepare(Settings(prompts=folder, out=out, devices_per_host=2, batches_per_slice=1))
    p = TestPipeline()
    manifest = p | "Plan" >> plan.Plan(settings)
    assert_that(manifest | beam.Map(lambda m: (m["records"], m["images"], m["rejects"], m["input_rows"])),
                equal_to([(4, 5, 3, 7)]))
    result = p.run()
    result.wait_until_finish()
    slices, rejects = read_plan(out)
    # positions follow (source, line): a.jsonl first, then b.jsonl; both files share slice 1
    assert slices == {0: [("a1_0000", 0), ("a1_0001", 1)],
                      1: [("d-a--L5_0000", 2), ("b1_0000", 3)],  # a record without an id: file and line
                      2: [("b3_0000", 4)]}
    assert rejects == [("a.jsonl", 2, "empty_prompt"), ("a.jsonl", 3, "invalid_json"), ("b.jsonl", 2, "bad_num_images")]
    assert plan.counters(result) == {"images_planned": 5, "records_planned": 4, "rows_read": 7, "rows_rejected": 3,
                                     "slices_written": 3}  # slice 1 by the join of its two parts
    assert runs.read(out).settings.guided is True  # records at the run's guidance, 7.5


def test_the_plan_decides_per_run_whether_it_is_guided_and_keeps_that_decision(tmp_path, model_cache, capsys):
    folder, out = tmp_path / "in", str(tmp_path / "out")
    folder.mkdir()
    lines = [{"prompt": "a fox"}, {"prompt": "a whale", "guidance_scale": 1.0}, {"prompt": "a cat", "guidance_scale": 4}]
    (folder / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    settings = Settings(prompts=str(folder / "*.jsonl"), out=out, guidance_scale=0.0)
    plan.run_plan(settings)
    first = runs.read(out)
    assert first.settings.guided is False  # guidance 0 and 1: no image is guided
    plan.run_plan(settings)  # a re-plan resumes the same run
    assert runs.read(out) == first
    (folder / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(layout.PlanError, match="p.jsonl: its content changed"):  # the input table sees it first
        plan.run_plan(settings)
    assert "guided_by_records" not in storage.read_json(naming.manifest(out))
    # were the table to miss the change, a plan made again (here: one stopped before its manifest) still refuses
    input_table.record(out, settings.prompts)
    os.remove(naming.manifest(out))
    with pytest.raises(layout.PlanError, match="holds a guidance-free run, but now some record's guidance is > 1"):
        plan.run_plan(settings)
    capsys.readouterr()
    manifest = plan.run_plan(settings, overwrite=True)
    assert runs.read(out).settings.guided is True
    assert runs.read(out).settings_fingerprint != first.settings_fingerprint
    # one record made the guidance-free run guided: the plan says so, once for people, once in the manifest
    asked = manifest["guided_by_records"]
    assert asked["records"] == 1 and asked["first"].endswith("p.jsonl line 3"), asked
    err = capsys.readouterr().err
    assert ("promptmill plan: 1 record(s) ask for guidance (the first: " in err
            and "the whole run is guided and pays for classifier-free guidance on every image" in err)
    from pipeline.collect import status
    assert "guidance  1 record(s) ask for guidance" in status.format_text(status.status(out))


def test_slices_shared_by_many_files_and_files_without_records(tmp_path, monkeypatch):
    files = {f"f{n}.jsonl": [json.dumps({"prompt": f"p{n}-{i}", "id": f"f{n}-{i}"}).encode() for i in range(count)]
             for n, count in enumerate([1, 0, 2, 7, 1, 1])}
    files["f1.jsonl"] = [b'{"no": "prompt"}']  # a file with rejects only
    folder, out = write_files(tmp_path / "d", files), str(tmp_path / "out")
    # the key index in 6 buckets, 3 ranges of them, a placing step's keys written every 3
    monkeypatch.setattr(key_index, "KEYS_PER_BUCKET", 2)
    monkeypatch.setattr(index, "BUCKETS_PER_RANGE", 2)
    monkeypatch.setattr(index, "CHUNK", 3)
    manifest = plan.run_plan(Settings(prompts=folder, out=out, devices_per_host=3, batches_per_slice=1))
    slices, rejects = read_plan(out)
    expected = [f"f{n}-{i}_0000" for n, count in enumerate([1, 0, 2, 7, 1, 1]) for i in range(count)]
    assert [key for index in sorted(slices) for key, _ in slices[index]] == expected
    assert sorted(slices) == list(range(4)) and [len(slices[i]) for i in range(4)] == [3, 3, 3, 3]
    assert [pos for index in sorted(slices) for _, pos in slices[index]] == list(range(12))
    assert rejects == [("f1.jsonl", 1, "missing_prompt")]
    assert storage.glob(naming.join(out, "plan", "parts", "*")) == []  # joined into slices, then deleted
    assert storage.glob(naming.join(out, "plan", "scans", "*")) == []  # read by the layout, then deleted
    assert (manifest["slices"], manifest["records"], manifest["input_rows"], manifest["input_files"]) == (4, 12, 13, 6)
    # each bucket of the key index holds what the slices' items give, byte for byte
    items = [json.loads(line) for index_ in sorted(slices) for line in
             storage.read_text(naming.plan_slice(out, index_)).splitlines()]
    columns = {name: [i[name] for i in items] for name in key_index.PLAN_COLUMNS}
    expected = dict(key_index.split(columns, key_index.bucket_count(12)))
    assert len(expected) > 3
    assert {b: storage.read_bytes(naming.plan_keys(out, b)) for b in expected} == {
        b: key_index.bucket_bytes([piece]) for b, piece in expected.items()}
    assert len(storage.glob(naming.join(out, "plan", "keys", "*"))) == len(expected)


def scan(source, ids, prompts, images=None, guided=None):
    n = len(ids)
    digest = lambda texts: np.frombuffer(b"".join(layout.digest(t) for t in texts), dtype="S16")  # noqa: E731
    return layout.FileScan(source, n, {}, np.arange(1, n + 1, dtype=np.int32),
                           np.asarray(images or [1] * n, np.int32), digest(ids), digest(prompts),
                           np.asarray(guided or [False] * n, bool))


def first_pass(scans, dedupe, ranges=1):
    """The plan's first pass in memory, step by step as its Beam steps run it: each file's
    sections, each range's id check (and the rows it leaves out of the prompt check), each
    range's prompt check, each file's drops and counts; then the layout. What a step
    writes for another goes through the same bytes. Returns the layout and {source:
    {line: (reason, message)}}."""
    written = lambda drops: duplicates.Drops.from_bytes(drops.to_bytes())  # noqa: E731
    sections = {s.source: duplicates.section(s.id_hashes, s.lines, s.prompt_hashes if dedupe else None)
                for s in scans}
    found, excluded = collections.defaultdict(list), collections.defaultdict(list)
    for r in range(ranges):
        parts = [(source, rows[a:b]) for source, rows in sections.items()
                 for k, a, b in duplicates.segments(rows, ranges) if k == r]
        drops, where = duplicates.check_range(parts, "duplicate_id")
        left = collections.defaultdict(dict)
        for source, d in drops.items():
            found[source].append(written(d))
            if dedupe:
                for k, lines in duplicates.exclusions(dict(parts)[source], where[source], ranges).items():
                    left[k][source] = lines
        for k, lines in left.items():
            excluded[k].append(duplicates.lines_to_bytes(lines))
    if dedupe:
        prompts = {s.source: duplicates.section(s.prompt_hashes, s.lines) for s in scans}
        for r in range(ranges):
            parts = [(source, rows[a:b]) for source, rows in prompts.items()
                     for k, a, b in duplicates.segments(rows, ranges) if k == r]
            left_out = {}
            for data in excluded[r]:
                for source, lines in duplicates.lines_from_bytes(data).items():
                    left_out[source] = np.concatenate([left_out.get(source, np.zeros(0, np.int32)), lines])
            for source, d in duplicates.check_range(parts, "duplicate_prompt", left_out)[0].items():
                found[source].append(written(d))
    merged = {s.source: written(duplicates.Drops.merged(found[s.source])) for s in scans}
    placed = layout.make_layout([layout.count_file(s, merged[s.source]) for s in scans])
    return placed, {source: {int(line): d.get(line) for line in d.lines} for source, d in merged.items() if len(d)}


@pytest.mark.parametrize("ranges", [1, 2, 7, 64])
def test_layout_rejects_later_duplicate_ids_and_with_dedupe_later_duplicate_prompts(ranges):
    scans = [scan("b", ["x", "y", "z"], ["cat", "dog", "cat"], [1, 2, 1]),
             scan("a", ["x", "w"], ["dog", "dog"], [3, 1])]
    placed, drops = first_pass(scans, dedupe=False, ranges=ranges)
    assert drops == {"b": {1: ("duplicate_id", "the same id as a line 1")}}
    assert (placed.records, placed.images, placed.first, placed.images_of) == (4, 7, {"a": 0, "b": 4}, {"a": 4, "b": 3})
    placed, drops = first_pass(scans, dedupe=True, ranges=ranges)
    # b line 1 is dropped for its id, so the first kept "cat" is b line 3, which stays
    assert drops == {"a": {2: ("duplicate_prompt", "the same prompt as a line 1")},
                     "b": {1: ("duplicate_id", "the same id as a line 1"),
                           2: ("duplicate_prompt", "the same prompt as a line 1")}}
    assert (placed.records, placed.images, placed.first, placed.rejects_by_reason) == (
        2, 4, {"a": 0, "b": 3}, {"duplicate_id": 1, "duplicate_prompt": 2})
    assert first_pass([], dedupe=True, ranges=ranges)[0].images == 0


def test_the_duplicate_checks_find_the_same_rows_whatever_the_hash_ranges():
    """Many files of repeated ids and prompts: every range count gives the drops of one
    check over every record, which a dict over the records in (source, line) order gives."""
    rng = np.random.default_rng(5)
    scans = [scan(f"f{n:02d}", [f"id{k}" for k in rng.integers(0, 60, 25)],
                  [f"p{k}" for k in rng.integers(0, 40, 25)]) for n in range(8)]
    expected, first_id, first_prompt = {}, {}, {}
    for s in scans:  # the rule, record by record
        for line, id_hash, prompt_hash in zip(s.lines.tolist(), s.id_hashes.tolist(), s.prompt_hashes.tolist()):
            if id_hash in first_id:
                expected.setdefault(s.source, {})[line] = ("duplicate_id", f"the same id as {first_id[id_hash]}")
            elif prompt_hash in first_prompt:
                expected.setdefault(s.source, {})[line] = ("duplicate_prompt",
                                                           f"the same prompt as {first_prompt[prompt_hash]}")
            else:
                first_id[id_hash] = first_prompt[prompt_hash] = f"{s.source} line {line}"
            first_id.setdefault(id_hash, f"{s.source} line {line}")
    assert sum(map(len, expected.values())) > 100
    for ranges in (1, 3, 16, 200):
        assert first_pass(scans, dedupe=True, ranges=ranges)[1] == expected, ranges


def test_layout_is_guided_only_if_a_kept_record_is():
    guided_duplicate = [scan("a", ["x"], ["cat"], guided=[False]), scan("b", ["x", "y"], ["dog", "cow"],
                                                                        guided=[True, False])]
    assert not first_pass(guided_duplicate, dedupe=False)[0].guided  # b's guided row repeats a's id
    assert first_pass([scan("a", ["x", "y"], ["cat", "dog"], guided=[False, True])], dedupe=False)[0].guided
    assert not first_pass([], dedupe=False)[0].guided
    several = first_pass([scan("b", ["p", "q"], ["1", "2"], guided=[True, True]),
                          scan("a", ["x", "y", "z"], ["3", "4", "5"], guided=[False, True, False])], dedupe=False)[0]
    assert (several.guided_records, several.first_guided) == (3, "a line 2")  # (source, line) order


@pytest.mark.parametrize("pattern,root", [("/d/*.jsonl", "/d/"), ("/d/sub/a.jsonl", "/d/sub"),
                                          ("gs://b/p/**/x*.jsonl", "gs://b/p/"), ("/d/a?.jsonl", "/d")])
def test_input_root(pattern, root):
    assert layout.input_root(pattern) == root


def test_run_plan_writes_run_manifest_slices_and_rejects(tmp_path, model_cache):
    prompts = tmp_path / "in"
    prompts.mkdir()
    (prompts / "p.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "one"}, {"prompt": "two", "num_images": 2}, {"no": "prompt"}, {"prompt": "four"}]) + "\n")
    out = str(tmp_path / "out")
    settings = Settings(prompts=str(prompts / "*.jsonl"), out=out, devices_per_host=2, batches_per_slice=1)
    manifest = plan.run_plan(settings)
    assert manifest == {"slice_size": 2, "slices": 2, "records": 3, "images": 4, "rejects": 1,
                        "rejects_by_reason": {"missing_prompt": 1}, "input_rows": 4, "input_files": 1}
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


def test_batches_per_slice_auto_is_decided_by_the_plan_recorded_and_kept(tmp_path, model_cache, caplog):
    """auto (the default) is 2 for a small run, decided once the plan has counted its images
    and written to run.json; from a million images, slices of about 1,024 images; a number
    given wins; a resumed run keeps its own."""
    import logging

    from pipeline.plan import decide

    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    settings = Settings(prompts=str(tmp_path / "p.jsonl"), out=str(tmp_path / "auto"), devices_per_host=4,
                        per_device_batch=8)
    assert settings.batches_per_slice == "auto"
    with caplog.at_level(logging.INFO, logger="promptmill"):
        manifest = plan.run_plan(settings)
    assert runs.read(settings.out).settings.batches_per_slice == 2 and manifest["slice_size"] == 64
    assert [r.fields["batches_per_slice"] for r in caplog.records if r.getMessage() == "batches_per_slice_decided"] \
        == [2]
    assert plan.run_plan(settings) == manifest  # resumed: run.json's 2, not auto again
    counted = layout.make_layout([layout.FileCounts("p", 1_500_000, {}, (1_500_000,), (1_500_000,))])
    assert decide.decide_batches_per_slice(counted, settings.out).batches_per_slice == 2  # decided: kept
    big = str(tmp_path / "big")
    prepare(settings.replace(out=big))
    assert decide.decide_batches_per_slice(counted, big).slice_size == 1024
    assert runs.read(big).settings.batches_per_slice == 32
    given = settings.replace(out=str(tmp_path / "given"), batches_per_slice=3)
    assert plan.run_plan(given)["slice_size"] == 96
    with pytest.raises(plan.PlanError, match=r"other settings \(changed: batches_per_slice\)"):
        plan.run_plan(given.replace(batches_per_slice=4))
    assert plan.run_plan(given.replace(batches_per_slice="auto"))["slice_size"] == 96  # keeps its own


def test_run_plan_without_matching_files_is_a_clear_error(tmp_path):
    with pytest.raises(plan.PlanError, match="no prompt files match"):
        plan.run_plan(Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "o")))


def test_replanning_the_same_out_with_other_settings_is_refused(tmp_path, model_cache):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n')
    settings = Settings(prompts=str(tmp_path / "p.jsonl"), out=str(tmp_path / "out"))
    first = plan.run_plan(settings)
    assert plan.run_plan(settings) == first  # the same settings: idempotent
    with pytest.raises(plan.PlanError, match=r"other settings \(changed: steps\)"):
        plan.run_plan(settings.replace(steps=21))


def test_steps_default_per_family_at_plan_time_and_a_resumed_run_keeps_its_own(tmp_path, model_cache, caplog):
    """Left out, --steps is the model's default, recorded in run.json: SD 20, FLUX.1
    [schnell] 4 and [dev] 28, klein 4; an OUT planned at another number (an earlier
    version's default of 20 for every family) resumes with its own."""
    import logging

    from pipeline.io import runs

    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n')
    for model, steps in (("tiny", 20), ("tiny-flux", 4), ("tiny-flux-dev", 28), ("tiny-klein", 4)):
        out = str(tmp_path / model)
        plan.run_plan(Settings(prompts=str(tmp_path / "p.jsonl"), out=out, model=model))
        assert runs.read(out).settings.steps == steps, model
    old = str(tmp_path / "old")
    first = plan.run_plan(Settings(prompts=str(tmp_path / "p.jsonl"), out=old, model="tiny-flux", steps=20))
    with caplog.at_level(logging.INFO):
        again = plan.run_plan(Settings(prompts=str(tmp_path / "p.jsonl"), out=old, model="tiny-flux"))
    assert again == first and runs.read(old).settings.steps == 20
    assert "steps_kept" in caplog.text
    with pytest.raises(plan.PlanError, match=r"changed: steps"):  # asked for, another number: another run
        plan.run_plan(Settings(prompts=str(tmp_path / "p.jsonl"), out=old, model="tiny-flux", steps=4))


def test_a_record_without_an_id_gets_a_readable_key(tmp_path, model_cache):
    """Its file's label and line: the id (FILE:LINE) and the seed derived from it are those
    of its file and line."""
    folder = tmp_path / "in"
    for sub in ("a", "b"):
        (folder / sub).mkdir(parents=True)
        (folder / sub / "p.txt").write_text(f"a fox from {sub}\n")
    out = str(tmp_path / "out")
    plan.run_plan(Settings(prompts=str(folder / "*" / "p.txt"), out=out))
    items = [json.loads(line) for line in storage.read_text(naming.plan_slice(out, 0)).splitlines()]
    assert {(i["key"], i["id"]) for i in items} == {("a-p--L1_0000", "a/p.txt:1"), ("b-p--L1_0000", "b/p.txt:1")}
    assert len({i["seed"] for i in items}) == 2


def test_the_batch_auto_chose_is_logged_as_run_json_records_it(tmp_path, model_cache, caplog):
    """--per-device-batch auto: the plan lowers the largest batch that fits to what the run's
    images fill on its hosts, and ``per_device_batch_chosen`` says the batch run.json holds,
    beside the one that fits (``per_device_batch_fits`` comes from the fit, before)."""
    import logging

    from pipeline.plan import decide

    (tmp_path / "p.jsonl").write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(7)))
    settings = Settings(prompts=str(tmp_path / "p.jsonl"), out=str(tmp_path / "out"), per_device_batch=256,
                        devices_per_host=2)
    prepare(settings)
    counted = layout.make_layout([layout.FileCounts("p", 7, {}, (7,), (7,))])
    with caplog.at_level(logging.INFO, logger="promptmill"):
        decided = decide.decide_per_device_batch(counted, settings.out, cap_hosts=2)
    chosen = [r.fields for r in caplog.records if r.getMessage() == "per_device_batch_chosen"]
    assert decided.per_device_batch == runs.read(settings.out).settings.per_device_batch == 2  # 7 images, 4 devices
    assert [(c["per_device_batch"], c["fits"]) for c in chosen] == [(2, 256)]
