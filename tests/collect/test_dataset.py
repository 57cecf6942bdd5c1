"""A dirty corpus in, a dataset people can use out: one real ``promptmill run --dedupe``
over shards in five formats holding every kind of bad row, then what collect made of it:
exact reject counts by reason, conservation, truncation counts, the metadata's parts
loaded by Hugging Face ``datasets``, the dataset card, the gallery in Chromium, and the
collect transforms (CollectPartFn, CountRejects, Collect) run again under TestPipeline;
then the pure parts of verification and stats (``verify``, ``stats.Tally``, ``sketch``)."""
import json
import os
import shutil

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from pipeline.collect import parts, sketch, stats as dataset_stats, transforms as collect, verify
from pipeline.core import naming
from pipeline.io import runs, storage
from pipeline.output import writer
from tests import chromium, trees
from tests.conftest import run_cli

LONG_PROMPT = "a very detailed painting of " + ", ".join(f"element number {n}" for n in range(40))

JSONL = [  # a.jsonl, line by line
    b'{"id": "a1", "prompt": "a lighthouse at dusk"}',
    b'{"prompt": "broken json"',                             # invalid_json
    b'{"prompt": "caf\xff"}',                                # invalid_utf8
    b'{"id": "a4"}',                                         # missing_prompt
    b'{"prompt": "   "}',                                    # empty_prompt
    b'{"prompt": 42}',                                       # prompt_not_string
    b'{"prompt": "negative count", "num_images": -1}',       # bad_num_images
    b'{"prompt": "huge count", "num_images": 1000000}',      # bad_num_images
    b'{"prompt": "bad seed", "seed": "abc"}',                # bad_seed
    b'{"prompt": "bad guidance", "guidance_scale": 1000}',   # bad_guidance_scale
    b"",                                                     # blank: not a row
    json.dumps({"id": "long", "prompt": LONG_PROMPT}).encode(),  # kept, truncated
    b'{"id": "dup-id", "prompt": "the first record with this id", "num_images": 2}',
]
CSV = ("prompt,id,seed\n"
       "a red bicycle,b1,5\n"
       "another record with this id,dup-id,\n"   # duplicate_id
       "too,many,fields,here\n"                  # bad_row
       "a lighthouse at dusk,b4,\n")             # duplicate_prompt (of a1)
TXT = "a quiet harbour\n\na lighthouse at dusk\na quiet harbour\n"  # lines 3 and 4: duplicate_prompt
JSON_ARRAY = [{"prompt": "a snowy owl", "id": "c1"}, 5, "a paper boat"]  # element 2: not_an_object
PARQUET = [{"id": "e1", "prompt": "a glass teapot"}, {"id": "e2", "prompt": None}]  # row 2: missing_prompt

EXPECTED_REJECTS = {"bad_guidance_scale": 1, "bad_num_images": 2, "bad_row": 1, "bad_seed": 1, "duplicate_id": 1,
                    "duplicate_prompt": 3, "empty_prompt": 1, "invalid_json": 1, "invalid_utf8": 1,
                    "missing_prompt": 2, "not_an_array": 1, "not_an_object": 1, "prompt_not_string": 1,
                    "unreadable_file": 1}
# a1, long, dup-id (2 images) / b1 / "a quiet harbour" / c1, "a paper boat" / e1
EXPECTED_RECORDS, EXPECTED_IMAGES = 8, 9


def write_corpus(folder):
    folder.mkdir(parents=True)
    (folder / "a.jsonl").write_bytes(b"\n".join(JSONL) + b"\n")
    (folder / "b.csv").write_text(CSV)
    (folder / "c.json").write_text(json.dumps(JSON_ARRAY))
    (folder / "d.txt").write_text(TXT)
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(PARQUET), buffer)
    (folder / "e.parquet").write_bytes(buffer.getvalue().to_pybytes())
    (folder / "f.parquet").write_bytes(b"this is not parquet")  # unreadable_file
    (folder / "g.json").write_text('{"prompt": "an object, not an array"}')  # not_an_array
    return str(folder)


@pytest.fixture(scope="module")
def dirty_run(tmp_path_factory, model_cache):
    base = tmp_path_factory.mktemp("dirty")
    prompts, out = write_corpus(base / "in"), str(base / "out")
    result = run_cli(["run", "--prompts", prompts, "--out", out, "--model", "tiny", "--hosts", "1",
                      "--devices-per-host", "2", "--steps", "2", "--batches-per-slice", "2", "--dedupe",
                      "--no-progress"], model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result


def all_rejects(out):
    return [json.loads(line) for path in storage.glob(naming.join(out, "plan", "rejects", "*.jsonl"))
            for line in storage.read_text(path).splitlines()]


def test_every_bad_row_is_a_reject_with_its_reason_and_the_job_succeeds(dirty_run):
    out, _ = dirty_run
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    assert stats["rejects_by_reason"] == EXPECTED_REJECTS
    assert storage.read_json(naming.manifest(out))["rejects_by_reason"] == EXPECTED_REJECTS
    rejects = all_rejects(out)
    assert len(rejects) == sum(EXPECTED_REJECTS.values())
    assert all(r["source"].startswith(out.rsplit("/", 1)[0]) and r["message"] and r["reason"] for r in rejects)
    where = {(os.path.basename(r["source"]), r["line"]): r["reason"] for r in rejects}
    assert where[("a.jsonl", 3)] == "invalid_utf8" and where[("b.csv", 3)] == "duplicate_id"
    assert where[("b.csv", 5)] == "duplicate_prompt" and where[("d.txt", 3)] == where[("d.txt", 4)] == "duplicate_prompt"
    assert where[("c.json", 2)] == "not_an_object" and where[("f.parquet", 0)] == "unreadable_file"
    [duplicate_id] = [r for r in rejects if r["reason"] == "duplicate_id"]
    assert duplicate_id["message"].endswith("a.jsonl line 13") and "another record" in duplicate_id["raw"]


def test_conservation_duplicates_and_truncation_are_in_the_stats(dirty_run):
    out, _ = dirty_run
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    rows = sum(EXPECTED_REJECTS.values()) + EXPECTED_RECORDS
    assert stats["verified"] and (stats["records"], stats["images"]) == (EXPECTED_RECORDS, EXPECTED_IMAGES)
    assert stats["conservation"] == {"input_rows": rows, "records": EXPECTED_RECORDS,
                                     "rejects": sum(EXPECTED_REJECTS.values()), "holds": True}
    assert stats["duplicates"] == {"ids": 1, "prompts": 3}
    assert stats["truncated_prompts"] == {"records": 1, "images": 1}
    truncated = {row["key"] for row in parts.dataset_rows(out) if row["prompt_truncated"]}
    assert truncated == {"long_0000"}
    host = stats["hosts"]["0"]
    assert host["images"] == EXPECTED_IMAGES and host["images_per_s"] > 0
    # the host loop's time, summed over its slices: preparing inputs, waiting on devices, handing over outputs
    assert host["device_wait_s"] > 0 and host["input_s"] > 0 and host["output_s"] > 0
    assert host["input_s"] + host["device_wait_s"] + host["output_s"] <= host["seconds"]
    assert 0 < host["device_busy_s"] <= host["seconds"]
    assert stats["wall_times"]["generate_s"] >= 0 and stats["wall_times"]["collect_s"] >= 0


def test_the_collect_transforms_under_test_pipeline(dirty_run, tmp_path):
    """CollectPartFn and CountRejects on the run's files, and Collect composing them into
    the same stats (less the wall times) as the run's own collect, on a copy of OUT."""
    out = str(tmp_path / "out")
    shutil.copytree(dirty_run[0], out)
    manifest, run = storage.read_json(naming.manifest(out)), runs.read(out)
    expected = storage.read_json(naming.dataset_file(out, "stats.json"))
    shutil.rmtree(naming.join(out, "dataset"))
    plan_args = (2, 0, "position")  # parts of 2 images: one slice (of 4) a part
    with TestPipeline() as p:
        manifests = p | "Manifest" >> beam.Create([manifest])
        summaries = (p
                     | "Parts" >> beam.Create(range(parts.PartPlan.of(manifest, *plan_args).parts))
                     | "CollectParts" >> beam.ParDo(parts.CollectPartFn(out, plan_args),
                                                    beam.pvalue.AsSingleton(manifests))
                     | "Summaries" >> beam.FlatMap(lambda pair: [pair[1]] if pair[0] == parts.SUMMARY else []))
        assert_that(summaries | "Problems" >> beam.Map(lambda s: (s["slice"], s["problems"])),
                    equal_to([(i, {}) for i in range(manifest["slices"])]), label="AllOk")
        assert_that(summaries | "Ok" >> beam.Map(lambda s: s["ok"]) | "Sum" >> beam.CombineGlobally(sum),
                    equal_to([EXPECTED_IMAGES]), label="OkImages")
        counts = (p
                  | "Rejects" >> beam.Create(storage.glob(naming.join(naming.rejects_dir(out), "*.jsonl")))
                  | "CountRejects" >> collect.CountRejects()
                  | "Reasons" >> beam.FlatMap(lambda pair: pair[1].items())
                  | "SumByReason" >> beam.CombinePerKey(sum))
        assert_that(counts, equal_to(list(EXPECTED_REJECTS.items())), label="ByReason")
    assert len(storage.glob(naming.join(out, "dataset", "metadata", "*"))) == manifest["slices"]  # a part a slice
    without_times = lambda stats: {k: v for k, v in stats.items() if k not in ("wall_times", "parts")}  # noqa: E731
    with TestPipeline() as p:
        collected = (p
                     | "Manifest" >> beam.Create([manifest])
                     | "Collect" >> collect.Collect(out, run, thumbnails=False))
        assert_that(collected | "Stats" >> beam.Map(without_times), equal_to([without_times(expected)]))
    assert without_times(storage.read_json(naming.dataset_file(out, "stats.json"))) == without_times(expected)
    assert storage.glob(naming.join(out, "dataset", "metadata", "*")) == [naming.dataset_part(out, 0)]


LISTED = {"size": 10, "md5": None}


@pytest.mark.parametrize("images, f_verdict", [({"s/a.png": LISTED, "s/b.png": LISTED, "s/e.png": LISTED}, "missing"),
                                               (None, "ok")])
def test_verify_slice_gives_every_key_one_verdict(images, f_verdict):
    """a: all there; b: two rows; c, d: no row; e: never planned; f: a row, and an image
    file only where the run writes files (``images`` None: it writes none)."""
    rows = [{"key": k, "image_bytes": 10} for k in ("a", "b", "b", "e", "f")]
    verdicts = verify.verify_slice(["a", "b", "c", "d", "f"], rows, images)
    expected = {v: [] for v in verify.VERDICTS}
    expected.update(ok=["a"], missing=["c", "d"], duplicated=["b"], unexpected=["e"])
    expected[f_verdict] = sorted(expected[f_verdict] + ["f"])
    assert verdicts == expected
    assert verify.verify_slice(["a", "a"], [{"key": "a"}], None)["duplicated"] == ["a"]


def test_a_row_of_another_run_and_a_damaged_image_fail_verification():
    """Issue 55, items 2 and 4: a row whose settings fingerprint is not run.json's (a mixed
    OUT, whatever the cause), and an image file whose listed size (or md5, where the store
    lists one) is not what its row recorded (an empty file), are problems of their own."""
    rows = [{"key": k, "settings_fingerprint": "run", "image_bytes": 10, "image_md5": "m"} for k in "abcde"]
    rows[1]["settings_fingerprint"] = "another"
    images = {"s/a.png": {"size": 10, "md5": None}, "s/b.png": {"size": 10, "md5": None},
              "s/c.png": {"size": 0, "md5": None}, "s/d.png": {"size": 10, "md5": "other"},
              "s/e.png": {"size": 10, "md5": "m"}}
    verdicts = verify.verify_slice(list("abcde"), rows, images, "run")
    assert (verdicts["ok"], verdicts["other_run"], verdicts["damaged"]) == (["a", "e"], ["b"], ["c", "d"])
    # a dropped row of another run is of another run too; without a fingerprint to check, no row is
    assert verify.classify(["k"], [{"key": "k", "dropped": "x", "settings_fingerprint": "old"}], None, "run") == \
        "other_run"
    assert verify.verify_slice(list("ab"), rows[:2], None)["ok"] == ["a", "b"]


def test_a_whole_object_missing_or_not_its_recorded_size_fails_its_slice():
    """The objects a slice writes whole (metadata shard, thumbnail pack, tar, image parquet)
    are checked against the sizes its commit marker recorded, from listings."""
    marker = {"objects": {"shards/x.tar": 100, "thumbs/x.tar": 50}}
    files = parts.SliceFiles(3, [], marker, None, None, {"o/shards/x.tar": {"size": 100, "md5": None},
                                                          "o/thumbs/x.tar": {"size": 50, "md5": None}})
    assert parts.broken_objects("o", files) is None
    files.objects["o/shards/x.tar"] = {"size": 0, "md5": None}
    assert parts.broken_objects("o", files) == ("damaged", ["shards/x.tar"])
    del files.objects["o/thumbs/x.tar"]
    assert parts.broken_objects("o", files) == ("missing", ["thumbs/x.tar"])


def test_the_key_index_places_each_key_from_the_plan_and_the_slices_places():
    """A whole slice's key sits at its first row plus its offset in the slice; a slice with
    problems lists its rows' positions, and a key without a row has no entry."""
    plan = {"key": ["a", "b", "c", "d", "e"], "slice": [0, 0, 1, 1, 2], "position": [0, 1, 2, 3, 4]}
    places = {0: (0, 0, 0, 0, None), 1: (1, 0, 2, 2, [3])}  # slice 1 kept only position 3; slice 2: no commit
    found = parts.place_keys(plan, places, row_group_rows=2)
    assert found == {"key": ["a", "b", "d"], "part": [0, 0, 0], "row_group": [0, 0, 1], "row": [0, 1, 0],
                     "slice": [0, 0, 1]}


def summary(index, ok, records, problems=None, unused_negatives=(0, 0), planned=None):
    return {"slice": index, "slices": 1, "ok": ok, "records": records, "planned_images": planned or ok,
            "problems": {kind: {"count": len(keys), "keys": keys} for kind, keys in (problems or {}).items()},
            "unused_negative_records": unused_negatives[0], "unused_negative_images": unused_negatives[1]}


def tally_of(summaries, split=1):
    """A Tally of ``summaries`` merged from pieces, as a combiner merges them."""
    pieces = [dataset_stats.Tally() for _ in range(split)]
    for n, item in enumerate(summaries):
        pieces[n % split].add(item)
    merged = pieces[0]
    for piece in pieces[1:]:
        merged.merge(piece)
    return merged


def test_dataset_stats_count_problems_rejects_and_conservation():
    manifest = {"input_rows": 6, "images": 5, "slices": 2}
    summaries = [summary(1, 1, 2, {"missing": ["k1"]}, (1, 2)), summary(0, 3, 2, {"unexpected": ["k0"]}, (0, 1))]
    stats = dataset_stats.dataset_stats(manifest, tally_of(summaries), {"invalid_json": 1, "duplicate_id": 1}, 1.5)
    assert (stats["images"], stats["records"], stats["rejects"], stats["committed_slices"]) == (4, 4, 2, 0)
    assert stats["rejects_by_reason"] == {"duplicate_id": 1, "invalid_json": 1}
    assert stats["duplicates"] == {"ids": 1, "prompts": 0}
    assert stats["negative_prompts_unused"] == {"records": 1, "images": 3}
    assert stats["conservation"] == {"input_rows": 6, "records": 4, "rejects": 2, "holds": True}
    assert stats["problems"] == {"missing": {"count": 1, "keys": ["k1 (slice 1)"]},
                                 "unexpected": {"count": 1, "keys": ["k0 (slice 0)"]}}
    assert not stats["verified"] and stats["wall_times"] == {"generate_s": None, "collect_s": 1.5}
    clean = dataset_stats.dataset_stats(manifest, tally_of([summary(0, 5, 4)]), {"bad_row": 1}, 0.0)
    assert clean["conservation"]["holds"] is False and not clean["verified"]
    assert dataset_stats.dataset_stats(manifest, tally_of([summary(0, 5, 4)]), {"bad_row": 2}, 0.0)["verified"]


def test_a_tally_keeps_counts_and_a_bounded_sample_of_problem_keys_however_it_is_merged():
    """O(1) per kind of problem, whatever the run: the count, and the first keys by slice."""
    summaries = [summary(i, 0, 1, {"missing": [f"k{i}a", f"k{i}b"]}) for i in range(200)]
    one, many = tally_of(summaries), tally_of(reversed(summaries), split=7)
    for tally in (one, many):
        assert tally.problems["missing"]["count"] == 400
        assert len(tally.problems["missing"]["keys"]) == dataset_stats.MAX_KEYS_IN_MESSAGE
    assert one.problems == many.problems and one.counts == many.counts
    assert one.problems["missing"]["keys"][:3] == [[0, "k0a"], [0, "k0b"], [1, "k1a"]]


def test_score_figures_are_exact_when_small_and_within_their_bound_when_sketched():
    """Up to ``sketch.EXACT_LIMIT`` values a score's quantiles are numpy's; above, the sketch's
    are within ``RELATIVE_ERROR`` of a value of that rank, and the same however merged."""
    import numpy as np

    rng = np.random.default_rng(3)
    small = rng.normal(0.2, 0.1, 1000)
    exact = dataset_stats.score_figures({"clip_similarity": sketch.Scores().add(small)})["clip_similarity"]
    assert exact["quantiles_exact"] and exact["quantiles"]["p50"] == round(float(np.quantile(small, 0.5)), 6)
    values = np.concatenate([rng.normal(5.0, 1.0, sketch.EXACT_LIMIT), -rng.uniform(0, 1, 1000), np.zeros(10)])
    whole = sketch.Scores().add(values)
    pieces = [sketch.Scores().add(part) for part in np.array_split(values[::-1], 13)]
    merged = pieces[0]
    for piece in pieces[1:]:
        merged.merge(piece)
    assert whole.sketched and whole.quantiles(dataset_stats.QUANTILES) == merged.quantiles(dataset_stats.QUANTILES)
    ordered = np.sort(values)
    for q, got in zip(dataset_stats.QUANTILES, whole.quantiles(dataset_stats.QUANTILES)):
        truth = ordered[int(q * (len(values) - 1))]
        assert abs(got - truth) <= sketch.RELATIVE_ERROR * abs(truth) + 1e-12, (q, got, truth)
    summary_ = whole.summary(dataset_stats.QUANTILES, dataset_stats.QUANTILE_NAMES)
    assert summary_["count"] == len(values) and not summary_["quantiles_exact"]
    assert (summary_["min"], summary_["max"]) == (round(values.min(), 6), round(values.max(), 6))


def test_check_verified_names_the_bad_keys():
    collect.check_verified({"verified": True})
    stats = {"verified": False, "problems": {"missing": {"count": 1, "keys": ["k_0000"]}},
             "conservation": {"holds": False, "input_rows": 5, "records": 3, "rejects": 1}}
    with pytest.raises(collect.CollectError) as error:
        collect.check_verified(stats)
    assert str(error.value) == ("the dataset does not match the plan:\n  missing: 1 key(s), e.g. k_0000\n"
                                "  input rows 5 != planned records 3 + rejects 1")


def test_hugging_face_datasets_loads_the_metadata(dirty_run, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import datasets

    out, _ = dirty_run
    loaded = datasets.load_dataset("parquet", data_files=naming.join(out, "dataset", "metadata", "*.parquet"),
                                   split="train", cache_dir=str(tmp_path / "cache"))
    assert loaded.num_rows == EXPECTED_IMAGES
    assert loaded.column_names == [name for name, _ in writer.METADATA_FIELDS]
    assert loaded.features["prompt_truncated"].dtype == "bool" and loaded.features["seed"].dtype == "int64"
    assert sorted(loaded["key"]) == sorted(r["key"] for r in parts.dataset_rows(out))
    assert loaded["position"] == sorted(loaded["position"])  # in plan order


def test_the_dataset_card_states_settings_fingerprint_and_counts(dirty_run):
    out, _ = dirty_run
    card = storage.read_text(naming.dataset_card(out))
    run = storage.read_json(naming.run_json(out))
    assert run["model_fingerprint"] in card and "dataset/metadata/" in card and "promptmill reproduce" in card
    assert "duplicate_prompt" in card and str(EXPECTED_IMAGES) in card


def test_the_gallery_renders_every_thumbnail_in_chromium(dirty_run, tmp_path, model_cache):
    chromium.ensure()
    out, _ = dirty_run
    shot = tmp_path / "index.png"
    chromium.screenshot(naming.dataset_file(out, "index.html"), shot, 1000, 1600)
    assert chromium.count_thumbnails(shot) == EXPECTED_IMAGES  # one page of 100 holds them all

    # collect again with 4 thumbnails a page: 3 pages, the last one holding 2
    result = run_cli(["collect", "--out", out, "--gallery-page-size", "4"], model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    pages = sorted(storage.glob(naming.join(out, "dataset", "gallery", "*.html")))
    assert [p.rsplit("/", 1)[1] for p in pages] == ["page-00002.html", "page-00003.html"]
    assert [name for name in trees.checksums(out) if not naming.owned(name)] == []  # what --overwrite deletes
    chromium.screenshot(pages[-1], tmp_path / "last.png", 1000, 1000)
    assert chromium.count_thumbnails(tmp_path / "last.png") == EXPECTED_IMAGES - 8
    chromium.screenshot(naming.dataset_file(out, "index.html"), shot, 1000, 1000)
    assert chromium.count_thumbnails(shot) == 4


def test_negative_prompts_of_unguided_images_are_counted_as_unused():
    rows = [{"negative_prompt": "blurry", "guidance_scale": 0.0, "image_index": 0},
            {"negative_prompt": "blurry", "guidance_scale": 0.0, "image_index": 1},
            {"negative_prompt": "blurry", "guidance_scale": 1.0, "image_index": 0},
            {"negative_prompt": "", "guidance_scale": 0.0, "image_index": 0},
            {"negative_prompt": "blurry", "guidance_scale": 1.5, "image_index": 0}]
    assert verify.unused_negatives(rows, "diffusers") == (2, 3)
    assert verify.unused_negatives(rows, "zimage") == (1, 2)  # Z-Image's rule guides above 0
