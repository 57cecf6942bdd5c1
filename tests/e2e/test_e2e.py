"""Real end-to-end runs: Beam plan, several jax.distributed host processes, Beam collect."""
import hashlib
import io
import json
import os
import re
import shutil
import time

import numpy as np
import pytest
from PIL import Image

from jobs import cli
from pipeline.collect import parts, status, transforms as collect
from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.io import storage
from pipeline.output import writer
from tests import trees
from tests.conftest import ROOT, check_host_imports, run_cli

STEPS = "3"
# every score, with the built-in random scorers (their scores mean nothing, but are computed as real ones are)
SCORE_ARGS = ("--score", "clip,aesthetic,safety", "--clip-model", "tiny-clip", "--aesthetic-head", "tiny-aesthetic",
              "--safety-checker", "tiny-safety-checker")
SCORE_COLUMNS = ("clip_similarity", "aesthetic", "nsfw", "nsfw_score")


def write_prompts(folder, count, bad_rows=True):
    """``count`` good records (record 2 has three images), plus one bad row."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"prompt number {n}, a {'red' if n % 2 else 'blue'} object", "theme": n % 3}
            for n in range(count)]
    rows[1]["id"] = "named-record"
    rows[1]["negative_prompt"] = "blurry"
    rows[2]["num_images"] = 3
    rows[3]["seed"] = 2**40 + 7
    rows[4]["guidance_scale"] = 3.0
    lines = [json.dumps(r) for r in rows]
    if bad_rows:
        lines.insert(5, json.dumps({"prompt": "", "id": "empty"}))
    half = len(lines) // 2
    (folder / "part-0.jsonl").write_text("\n".join(lines[:half]) + "\n")
    (folder / "part-1.jsonl").write_text("\n".join(lines[half:]) + "\n")
    return str(folder / "*.jsonl")


def run_args(prompts, out, hosts, devices, *extra):
    return ["run", "--prompts", prompts, "--out", out, "--model", "tiny", "--hosts", str(hosts),
            "--devices-per-host", str(devices), "--steps", STEPS, "--per-device-batch", "1",
            "--batches-per-slice", "2", "--no-progress", *extra]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    # 15 good records, one with 3 images: 17 images, not a multiple of the slice size 4
    return write_prompts(tmp_path_factory.mktemp("prompts"), 15)


@pytest.fixture(scope="module")
def two_by_two(prompts, tmp_path_factory, model_cache):
    """Every format, and parts of 4 images: one slice a part, 5 parts (tar and zarr change no image)."""
    out = str(tmp_path_factory.mktemp("run-2x2") / "out")
    result = run_cli(run_args(prompts, out, 2, 2, "--format", "files,webdataset,zarr", "--part-rows", "4"),
                     model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    check_host_imports(result)  # SD's hosts need neither diffusers nor transformers
    return out


def metadata(out):
    return parts.dataset_rows(out)


def image_hashes(out):
    return {row["key"]: hashlib.sha256(storage.read_bytes(naming.join(out, row["path"]))).hexdigest()
            for row in metadata(out)}


def test_every_planned_image_exists_once_and_opens_at_the_requested_size(two_by_two):
    out = two_by_two
    manifest = storage.read_json(naming.manifest(out))
    assert (manifest["records"], manifest["images"], manifest["rejects"]) == (15, 17, 1)
    assert manifest["slice_size"] == 4 and manifest["slices"] == 5
    planned = [json.loads(line) for i in range(manifest["slices"])
               for line in storage.read_text(naming.plan_slice(out, i)).splitlines()]
    rows = metadata(out)
    assert sorted(r["key"] for r in rows) == sorted(i["key"] for i in planned)
    assert len({r["key"] for r in rows}) == len(rows) == 17
    for row in rows:
        data = storage.read_bytes(naming.join(out, row["path"]))
        assert hashlib.sha256(data).hexdigest() == row["sha256"]
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "PNG" and image.size == (32, 32) and image.mode == "RGB"
    by_key = {r["key"]: r for r in rows}
    assert [by_key[f"part-0--L3_{n:04d}"]["image_index"] for n in range(3)] == [0, 1, 2]
    named = by_key["named-record_0000"]
    assert (named["negative_prompt"], json.loads(named["extra"])) == ("blurry", {"theme": 1})
    assert {r["host"] for r in rows} == {0, 1}
    # --decode-batch auto, resolved when planning: in run.json and in every row
    assert storage.read_json(naming.run_json(out))["settings"]["decode_batch"] == 1
    assert {r["decode_batch"] for r in rows} == {1}
    # padding rows are never written: exactly the planned images are on disk
    assert len(storage.glob(naming.join(out, "images", "*", "*.png"))) == 17


def test_the_bad_row_is_in_rejects_with_its_source_line_and_reason(two_by_two):
    [path] = storage.glob(naming.join(two_by_two, "plan", "rejects", "*.jsonl"))
    [reject] = [json.loads(line) for line in storage.read_text(path).splitlines()]
    assert reject["source"].endswith("part-0.jsonl") and reject["line"] == 6
    assert reject["reason"] == "empty_prompt"


def test_collect_verified_and_nothing_recompiled(two_by_two):
    stats = storage.read_json(naming.dataset_file(two_by_two, "stats.json"))
    assert stats["verified"] and stats["images"] == 17 and stats["input_rows"] == 16
    assert stats["compiles_after_warmup"] == 0
    for index in range(5):
        assert storage.read_json(naming.shard_stats(two_by_two, index))["compiles_after_warmup"] == 0
    assert sorted(stats["hosts"]) == ["0", "1"]
    # --overwrite deletes exactly what a run writes: its list names every object of this one
    assert [name for name in trees.checksums(two_by_two) if not naming.owned(name)] == []


def test_one_object_per_image_and_a_constant_number_per_slice(two_by_two):
    """--format files writes each image's file and, per slice, its metadata shard, commit
    marker, thumbnail pack and metadata.jsonl; webdataset adds a tar a slice and zarr a shard
    and a key chunk a slice. Everything else is the run's, its parts' or its index buckets'."""
    names = set(trees.checksums(two_by_two))
    images = {name for name in names if re.fullmatch(r"images/[0-9a-f]{4}-\d{5}/[^/]+\.png", name)}
    assert len(images) == 17
    for index in range(5):
        spread = naming.output_name(index)
        mine = {name for name in names if spread in name} - images
        assert mine == {f"shards/{spread}.parquet", f"shards/{spread}_stats.json", f"thumbs/{spread}.tar",
                        f"images/{spread}/metadata.jsonl", f"shards/{spread}.tar"}, index
        assert {f"plan/slices/{index:05d}.jsonl", f"zarr/images/c/{index}/0/0/0", f"zarr/key/c/{index}"} <= names
    per_slice = {name for name in names if any(naming.output_name(i) in name for i in range(5))} | {
        name for name in names if re.fullmatch(r"plan/slices/\d{5}\.jsonl|zarr/(images|key)/c/\d+(/0/0/0)?", name)}
    rest = sorted(names - per_slice)
    runs_own = r"run\.json|README\.md|plan/[a-z_]+\.json|plan/rejects/[^/]+|plan/keys/\d{5}\.parquet|" \
               r"dataset/(stats\.json|index\.html|index/\d{5}\.parquet|metadata/part-\d{5}\.parquet)|" \
               r"zarr/(zarr\.json|images/zarr\.json|key/zarr\.json)|logs/[^/]+|progress/[^/]+|ledger/[^/]+|" \
               r"environment\.json"
    assert [name for name in rest if not re.fullmatch(runs_own, name)] == []


@pytest.fixture(scope="module")
def one_by_four(prompts, tmp_path_factory, model_cache):
    """The 2x2 run's settings on 1 host x 4 devices, with every score (two_by_two has none)."""
    out = str(tmp_path_factory.mktemp("run-1x4") / "out")
    result = run_cli(run_args(prompts, out, 1, 4, *SCORE_ARGS), model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def scores(out):
    return {row["key"]: tuple(row[name] for name in SCORE_COLUMNS) for row in metadata(out)}


def test_topology_independence_1x4_vs_2x2_and_scores_change_no_image(two_by_two, one_by_four):
    """The same images on 1x4 as on 2x2, byte for byte, though the 1x4 run also scored
    them on its devices (--score clip,aesthetic,safety) and the 2x2 run did not."""
    out = one_by_four
    assert storage.read_json(naming.manifest(out))["slice_size"] == 8  # other slices, other positions
    one, two = image_hashes(out), image_hashes(two_by_two)
    assert len(one) == 17 and one == two
    assert all(None not in values for values in scores(out).values())
    assert all(set(values) == {None} for values in scores(two_by_two).values())
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    assert stats["compiles_after_warmup"] == 0 and stats["scores"]["clip_similarity"]["count"] == 17
    assert "dropped" not in stats  # no filter: nothing can be dropped
    ready = _host_events(out, "host_ready")
    assert ready and all(e["scorer_compile_s"] > 0 for e in ready)


def test_the_dataset_in_parts_reads_whole_in_every_reader(two_by_two, tmp_path, monkeypatch):
    """Parts of 4 images (one slice each): the card's config, imagefolder (a metadata.jsonl a
    slice folder), pyarrow and pandas (the parts as one table), xarray (the zarr store, its
    key coordinate), webdataset (the tars) each read every image and row; the key index and
    reproduce's look-up find keys of the first and the last part."""
    import datasets
    import pandas
    import pyarrow.dataset
    import webdataset as wds
    import xarray

    from pipeline.generate import reproduce
    from pipeline.output import key_index

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    out, rows = two_by_two, metadata(two_by_two)
    assert [os.path.basename(p) for p in storage.glob(naming.join(out, "dataset", "metadata", "*"))] == [
        f"part-{n:05d}.parquet" for n in range(5)]
    assert [r["position"] for r in rows] == list(range(17))
    keys, by_key = sorted(r["key"] for r in rows), {r["key"]: r for r in rows}
    folder = naming.join(out, "dataset", "metadata")
    assert sorted(pyarrow.dataset.dataset(folder, format="parquet").to_table().column("key").to_pylist()) == keys
    assert sorted(pandas.read_parquet(folder)["key"]) == keys
    for loaded in (datasets.load_dataset(out, split="train", cache_dir=str(tmp_path / "c1")),
                   datasets.load_dataset("imagefolder", data_dir=naming.join(out, "images"), split="train",
                                         cache_dir=str(tmp_path / "c2"))):
        assert sorted(loaded["key"]) == keys and "label" not in loaded.column_names
        for example in loaded:
            assert example["prompt"] == by_key[example["key"]]["prompt"] and example["image"].size == (32, 32)
    zarr = xarray.open_zarr(naming.join(out, "zarr")).set_index(image="key")
    for row in rows[::5]:
        pixels = np.asarray(Image.open(io.BytesIO(storage.read_bytes(naming.join(out, row["path"])))))
        assert (zarr["images"].sel(image=row["key"]).values == pixels).all()
    samples = list(wds.WebDataset(sorted(storage.glob(naming.join(out, "shards", "*.tar"))), shardshuffle=False))
    assert sorted(s["__key__"] for s in samples) == keys
    assert all(s["png"] == storage.read_bytes(naming.join(out, by_key[s["__key__"]]["path"])) for s in samples)
    first, last = rows[0]["key"], rows[-1]["key"]
    reads = []
    found = reproduce.find_rows(out, [first, last], reads)
    assert {k: found[k]["sha256"] for k in (first, last)} == {k: by_key[k]["sha256"] for k in (first, last)}
    assert len(reads) == 4  # the manifest, one bucket of the plan's index, and the two slices' shards
    buckets = key_index.bucket_count(17)
    entries = key_index.find(naming.dataset_index(out, key_index.bucket_of(first, buckets)), [first, last])
    assert (entries[first]["part"], entries[first]["row"]) == (0, 0)
    assert (entries[last]["part"], entries[last]["row_group"], entries[last]["row"]) == (4, 0, 0)
    page = storage.read_text(naming.dataset_file(out, "index.html"))  # the gallery: every image (17 < 1000)
    assert re.findall(r'alt="([^"]+)"', page) == [r["key"] for r in rows] and page.count("data:image/jpeg") == 17


def test_collect_names_each_bad_key_with_its_slice(two_by_two, tmp_path):
    """One collect of a copy of the 2x2 run, broken six ways: a missing image, a duplicated
    row (an extra row in a slice), a missing row, a row of another run (issue 55, item 2: its
    settings fingerprint is not run.json's), an empty image and a truncated one (item 4:
    sizes checked from listings). Each fails verification, named with its slice."""
    out = str(tmp_path / "broken")
    shutil.copytree(two_by_two, out)
    rows = metadata(out)
    victim, twin, lost, mixed, empty, cut = rows[3], rows[6], rows[9], rows[12], rows[1], rows[15]
    os.remove(naming.join(out, victim["path"]))
    for row, change in ((twin, lambda shard: shard + [dict(twin)]),
                        (lost, lambda shard: [r for r in shard if r["key"] != lost["key"]]),
                        (mixed, lambda shard: [dict(r, settings_fingerprint="0" * 64) if r["key"] == mixed["key"]
                                               else r for r in shard])):
        shard = naming.shard_metadata(out, row["slice"])
        storage.write_bytes(shard, writer.parquet_bytes(change(writer.read_parquet_rows(shard))))
        marker = storage.read_json(naming.shard_stats(out, row["slice"]))  # the shard's new size, as recorded
        marker["objects"][shard[len(out) + 1:]] = os.path.getsize(shard)
        storage.write_json(naming.shard_stats(out, row["slice"]), marker)
    open(naming.join(out, empty["path"]), "wb").close()
    with open(naming.join(out, cut["path"]), "r+b") as f:
        f.truncate(cut["image_bytes"] - 1)
    with pytest.raises(collect.CollectError) as error:
        collect.run_collect(out)
    message = str(error.value)
    assert f"duplicated: 1 key(s), e.g. {twin['key']} (slice {twin['slice']})" in message
    assert f"other_run: 1 key(s), e.g. {mixed['key']} (slice {mixed['slice']})" in message
    assert f"damaged: 2 key(s), e.g. {empty['key']} (slice {empty['slice']}), {cut['key']} (slice {cut['slice']})" \
        in message
    missing = sorted([(victim["slice"], victim["key"]), (lost["slice"], lost["key"])])
    assert "missing: 2 key(s), e.g. " + ", ".join(f"{k} (slice {s})" for s, k in missing) in message


def test_a_thumbnail_pack_missing_from_a_committed_slice_fails_the_slice(two_by_two, tmp_path):
    out = str(tmp_path / "no-thumbs")
    shutil.copytree(two_by_two, out)
    assert storage.read_json(naming.shard_stats(out, 2))["thumbnails"] == 4
    os.remove(naming.thumb_pack(out, 2))
    with pytest.raises(collect.CollectError, match="missing: 4 key\\(s\\), e.g. .* \\(slice 2\\)"):
        collect.run_collect(out)


def test_the_gallery_shows_the_plan_time_sample(two_by_two, tmp_path, capfd):
    """--gallery-max 5: positions i * 17 // 5, whatever collect finds, with their thumbnails
    from the slices' packs; one object of thumbnails a slice, none per image."""
    out = str(tmp_path / "sample")
    shutil.copytree(two_by_two, out)
    assert sorted(os.listdir(naming.join(out, "thumbs"))) == sorted(f"{naming.output_name(i)}.tar" for i in range(5))
    code, err = cli.main(["collect", "--out", out, "--gallery-max", "5"]), capfd.readouterr().err
    assert code == 0, err[-4000:]
    page = storage.read_text(naming.dataset_file(out, "index.html"))
    keys = [r["key"] for r in metadata(out)]
    assert re.findall(r'alt="([^"]+)"', page) == [keys[i * 17 // 5] for i in range(5)]
    assert "17 images, 5 shown" in page and not storage.exists(naming.dataset_file(out, "gallery/page-00002.html"))


def test_cli_collect_exits_non_zero_when_a_slice_is_not_committed(two_by_two, tmp_path, model_cache, capfd):
    out = str(tmp_path / "uncommitted")
    shutil.copytree(two_by_two, out)
    os.remove(naming.shard_stats(out, 2))
    assert cli.main(["collect", "--out", out]) == 1
    assert "missing: 4 key(s)" in capfd.readouterr().err


def test_the_documented_latents_recipe_regenerates_images_from_their_metadata(two_by_two, model_cache):
    """docs/reproducing.md's recipe for the initial latents (seed and image index only),
    denoised from outside the hosts' program (both picks in one batch), gives the stored
    images to within one pixel level; with the parity tests (the same latents give
    diffusers' PyTorch images) this is what the documented diffusers snippet relies on."""
    import jax
    import jax.numpy as jnp

    from pipeline.core.settings import Settings
    from pipeline.generate import sampler
    from pipeline.model import load as model_lib

    settings = Settings.from_dict(storage.read_json(naming.run_json(two_by_two))["settings"])
    model = model_lib.load("tiny", dtype=settings.dtype)
    rows = {r["key"]: r for r in metadata(two_by_two)}
    # a negative prompt, and a seed above 2**32 with image index 0
    picks = [rows["named-record_0000"], next(r for r in rows.values() if r["seed"] > 2**32)]
    latents = []
    for row in picks:
        seed = row["seed"]
        key = jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))
        key = jax.random.fold_in(key, row["image_index"])
        channels, height, width = model.latent_shape(row["width"], row["height"])
        latents.append(jax.random.normal(key, (channels, height, width), jnp.float32))
    denoise = jax.jit(sampler.make_denoise_fn(model, picks[0]["steps"], model.family.tokenize(model, [""])[0],
                                              guidance_rule=settings.guidance_rule))
    images = denoise(model.params, jnp.asarray(model.family.tokenize(model, [r["prompt"] for r in picks])),
                     jnp.asarray(model.family.tokenize(model, [r["negative_prompt"] for r in picks])),
                     jnp.asarray([r["guidance_scale"] for r in picks], jnp.float32), jnp.stack(latents))
    for row, image in zip(picks, np.asarray(sampler.to_uint8(images))):
        ours = np.asarray(Image.open(io.BytesIO(storage.read_bytes(naming.join(two_by_two, row["path"])))))
        diff = np.abs(ours.astype(int) - image.astype(int))
        # another program (batch 2): a float may round to the next level
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, row["key"]


def _events(text: str, name: str) -> list[dict]:
    from pipeline.core import logs

    return [e for e in map(logs.parse, text.splitlines()) if e and e["event"] == name]


def _host_events(out: str, name: str) -> list[dict]:
    return [e for path in storage.glob(naming.join(out, "logs", "host-*.log"))
            for e in _events(storage.read_text(path), name)]


def _committed(out: str) -> dict[int, int]:
    """{slice: host} of the committed slices."""
    return {s["slice"]: s["host"] for s in map(storage.read_json,
                                               storage.glob(naming.join(out, "shards", "*_stats.json")))}


def test_killed_mid_slice_and_between_slices_then_resumed(two_by_two, prompts, tmp_path, model_cache):
    """One OUT, two runs that each lose host 0 to SIGKILL at another point, then the same
    command again: the dataset equals the uninterrupted 2x2 run's, image for image.

    The --compile-cache folder starts as a copy of the one the 2x2 run filled, so both
    hosts load their programs from it from the first run on, and host 1 may have written
    part of its own slices when host 0 dies; those are redone like host 0's. Slices of 4
    run in 2 batches; host 0 owns slices 0, 2 and 4. (A host killed before its first
    commit leaves less behind than either point: nothing committed, at most a half slice,
    as here.)
    """
    from pipeline.core import crashpoints
    from pipeline.generate import compile_cache as cache_lib

    out, compile_cache = str(tmp_path / "crashed"), str(tmp_path / "compile-cache")
    shutil.copytree(cache_lib.local_default(), compile_cache)  # the folder the 2x2 run filled

    def run(crash=None):
        env = {k: v for k, v in os.environ.items() if k != crashpoints.ENV}
        if crash:
            env[crashpoints.ENV] = crash
        result = run_cli(run_args(prompts, out, 2, 2, "--compile-cache", compile_cache), model_cache, env=env)
        if crash:
            assert result.returncode == 1 and "host 0 of 2 failed (killed by SIGKILL)" in result.stderr
            [point] = _host_events(out, "crash_point")
            assert point["point"] == crash.split(":")[1]
            assert time.time() - point["ts"] < 60, "the run took too long to notice the dead host"
        return result

    run("0:mid_slice:1")  # 1. in its second slice, after the first batch's images are stored
    planned = {path: (os.stat(path).st_mtime_ns, storage.read_bytes(path))
               for path in storage.glob(naming.join(out, "plan", "slices"))}
    # --compile-cache reached the hosts: each loaded its program from that folder
    assert sorted((e["host"], e["path"]) for e in _host_events(out, "compile_cache")) == [
        (0, compile_cache), (1, compile_cache)]
    assert [(e["cache_hits"] > 0, e["sampler_from_cache"]) for e in _host_events(out, "host_ready")] == [(True, True)] * 2
    assert compile_cache not in storage.read_text(naming.run_json(out))  # an execution option, not a setting
    committed = _committed(out)
    assert committed.get(0) == 0 and 2 not in committed
    assert len(storage.glob(naming.join(naming.images_dir(out, 2), "*.png"))) == 2  # half a slice
    assert not storage.exists(naming.shard_metadata(out, 2))

    run("0:committed:0")  # 2. right after its first commit, between two slices:
    assert [(e["cache_hits"] > 0, e["cache_writes"]) for e in _host_events(out, "host_ready") if e["host"] == 0] \
        == [(True, 0)]
    # the half slice's 2 images were left over (its thumbnails are packed at its commit; host 0 owns the even
    # slices; host 1, as warm as host 0 now, may have left half slices of its own, redone too)
    assert [(e["slice"], e["leftover_objects"]) for e in _host_events(out, "slice_redone")
            if e["slice"] % 2 == 0] == [(2, 2)]
    committed = _committed(out)  # ... which was the redone half slice
    assert {0, 2} <= set(committed) and 4 not in committed

    # (host 1, stopped when host 0 died, may have left a slice half-written too)
    half_written = [i for i in range(5) if i not in committed and writer.leftovers(out, Settings(formats=("files",)), i)]
    result = run()  # 4. the same command again completes
    assert result.returncode == 0, result.stderr[-3000:]
    [kept] = _events(result.stderr, "plan_kept")  # each run after the first kept its plan: no slice written again
    assert kept["slices"] == 5 and planned == {path: (os.stat(path).st_mtime_ns, storage.read_bytes(path))
                                               for path in storage.glob(naming.join(out, "plan", "slices"))}
    # each host found its committed slices in its ledger, not in a listing of every marker
    assert sorted(e["host"] for e in _host_events(out, "ledger_read")) == [0, 1]
    assert _host_events(out, "ledger_fallback") == []
    [summary] = _events(result.stderr, "generated")  # the log says what was skipped and redone
    assert (summary["slices_skipped"], summary["slices_generated"]) == (len(committed), 5 - len(committed))
    assert summary["slices_redone"] == len(half_written) and summary["images"] == 17 - 4 * len(committed)
    assert sum(d["slices_skipped"] for d in _host_events(out, "host_done")) == len(committed)

    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    assert stats["verified"] and stats["images"] == 17
    assert status.status(out)["committed"] | {"last_at": 0} == {"slices": 5, "images": 17, "last_at": 0,
                                                               "counted_from": "ledgers", "why_listed": None,
                                                               "objects_read": 7}
    rows = metadata(out)
    assert len(rows) == len({r["key"] for r in rows}) == 17  # every planned image exactly once
    assert image_hashes(out) == image_hashes(two_by_two)  # the bytes of an uninterrupted run
    assert {r["key"]: r["sha256"] for r in rows} == {r["key"]: r["sha256"] for r in metadata(two_by_two)}
    assert len(storage.glob(naming.join(out, "images", "*", "*.png"))) == 17  # no stray objects
    assert trees.checksums(naming.join(out, "thumbs")) == trees.checksums(naming.join(two_by_two, "thumbs"))


def test_a_guidance_free_few_step_run_is_the_same_on_1x4_and_2x2(tmp_path, model_cache):
    """The Turbo recipe: guidance 0, Euler ancestral (its noise drawn per image and step),
    trailing timesteps, 2 steps. The plan makes the run guidance-free."""
    folder = tmp_path / "free"
    folder.mkdir()
    rows = [{"prompt": f"prompt number {n}"} for n in range(6)]
    rows[1]["negative_prompt"] = "blurry"  # plays no part: counted in the stats
    rows[2]["num_images"] = 3
    rows[4]["guidance_scale"] = 1.0  # <= 1: still unguided
    (folder / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = str(folder / "*.jsonl")
    hashes, scored = [], []
    for hosts, devices in ((2, 2), (1, 4)):
        out = str(tmp_path / f"free-{hosts}x{devices}")
        args = run_args(prompts, out, hosts, devices, "--guidance-scale", "0", "--scheduler", "euler_a",
                        "--timestep-spacing", "trailing", *SCORE_ARGS)
        args[args.index("--steps") + 1] = "2"
        result = run_cli(args, model_cache)
        assert result.returncode == 0, result.stderr[-4000:]
        run = storage.read_json(naming.run_json(out))["settings"]
        assert (run["guided"], run["scheduler"], run["timestep_spacing"]) == (False, "euler_a", "trailing")
        hashes.append(image_hashes(out))
        scored.append(scores(out))
        stats = storage.read_json(naming.dataset_file(out, "stats.json"))
        assert stats["verified"] and stats["negative_prompts_unused"]["records"] == 1  # record 1, at guidance 0
    assert len(hashes[0]) == 8 and hashes[0] == hashes[1]
    # every image's scores, computed on the devices that made it, are the same on 1x4 as on 2x2
    assert len(scored[0]) == 8 and scored[0] == scored[1] and all(None not in v for v in scored[0].values())


@pytest.mark.slow
def test_a_256_tiny_run_fits_in_4_gib_per_process_with_auto_attention(tmp_path, model_cache):
    """At 256x256 the tiny UNet's first attention has 16384 tokens: its whole score matrix
    is 8 GiB with guidance, which the auto choice chunks on CPU. About 7 minutes on 2
    cores, so not in the default run: ``pytest -m slow`` runs it."""
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "p.jsonl").write_text(json.dumps({"prompt": "a lighthouse at dusk"}) + "\n")
    out = str(tmp_path / "big-out")
    args = run_args(str(folder / "*.jsonl"), out, 1, 1, "--width", "256", "--height", "256")
    args[args.index("--steps") + 1] = "1"
    args[args.index("--batches-per-slice") + 1] = "1"
    # the run in a process that then reports the peak RSS of itself and of every process it started
    report = ("import resource, sys; from jobs import cli; code = cli.main(sys.argv[1:]); "
              "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
              "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", report, *args], cwd=ROOT,
                            env=dict(os.environ, PROMPTMILL_CACHE=model_cache), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    own, children = (int(kib) for kib in result.stdout.split("RSS", 1)[1].split())
    assert max(own, children) < 4 * 2 ** 20, (own, children)  # KiB
    assert storage.read_json(naming.run_json(out))["settings"]["attention"] == "auto"
    [row] = metadata(out)
    with Image.open(io.BytesIO(storage.read_bytes(naming.join(out, row["path"])))) as image:
        assert image.size == (256, 256)


def test_sdxl_bf16_dpmpp_run_end_to_end(tmp_path, model_cache):
    prompts = write_prompts(tmp_path / "xl", 5, bad_rows=False)
    out = str(tmp_path / "xl-out")
    args = run_args(prompts, out, 1, 2, "--dtype", "bf16", "--scheduler", "dpmpp", "--width", "48")
    args[args.index("--model") + 1] = "tiny-sdxl"
    result = run_cli(args, model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    check_host_imports(result)
    run = storage.read_json(naming.run_json(out))
    assert (run["settings"]["dtype"], run["scheduler"], run["settings"]["width"], run["settings"]["height"]) == \
        ("bf16", "dpmpp", 48, 32)
    rows = metadata(out)
    assert len(rows) == 7 and {(r["dtype"], r["scheduler"]) for r in rows} == {("bf16", "dpmpp")}
    for row in rows:
        with Image.open(io.BytesIO(storage.read_bytes(naming.join(out, row["path"])))) as image:
            assert image.size == (48, 32)


@pytest.mark.parametrize("flag,value,message", [("--width", "30", "--width 30: tiny's images are multiples of 8 "
                                                                   "pixels each way (SD 1.x/2.x's size unit: 8)"),
                                                ("--steps", "0", "--steps must be a whole number from 1 to 1000")])
def test_bad_settings_are_refused_before_any_work(tmp_path, model_cache, prompts, flag, value, message, capfd):
    assert cli.main(["plan", "--prompts", prompts, "--out", str(tmp_path / "o"), flag, value]) == 1
    assert message in capfd.readouterr().err
    assert not os.path.exists(tmp_path / "o")


def test_other_settings_are_refused_then_overwrite_starts_over(two_by_two, one_by_four, prompts, tmp_path,
                                                              model_cache):
    out = str(tmp_path / "reused")
    shutil.copytree(one_by_four, out)  # a finished run with other settings: 3 slices of 8
    before = trees.checksums(out)

    refused = run_cli(run_args(prompts, out, 2, 2), model_cache)
    assert refused.returncode == 1
    # the scores too: a run without them does not resume a run with them (nor the other way)
    assert ("already holds a run with other settings (changed: aesthetic_head, clip_model, devices_per_host, "
            "safety_checker, scores)") in refused.stderr
    assert "--overwrite" in refused.stderr
    assert trees.checksums(out) == before

    result = run_cli(run_args(prompts, out, 2, 2, "--overwrite"), model_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert image_hashes(out) == image_hashes(two_by_two)  # what a run into an empty OUT makes
    assert storage.read_json(naming.manifest(out))["slice_size"] == 4
    # nothing of the old run is left: its slices reuse the new run's names with other
    # contents (slice 1 held 8 images, not 4) and put the same keys in other folders
    assert len(storage.glob(naming.join(out, "shards", "*_stats.json"))) == 5
    assert len(writer.read_parquet_rows(naming.shard_metadata(out, 1))) == 4
    assert len(storage.glob(naming.join(out, "images", "*", "*.png"))) == 17


def test_cli_reproduce_regenerates_images_bit_exactly_from_their_metadata(two_by_two, model_cache, tmp_path):
    """``promptmill reproduce``: the same program on one device gives the same bytes; an
    unknown key is refused before the model is loaded."""
    rows = {r["key"]: r for r in metadata(two_by_two)}
    picks = ["named-record_0000",  # a negative prompt
             next(k for k, r in rows.items() if r["seed"] > 2**32),
             next(k for k, r in rows.items() if r["image_index"] > 0)]
    saved = tmp_path / "saved"
    result = run_cli(["reproduce", *picks, "--out", two_by_two, "--save", str(saved)], model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["key"] for line in lines] == picks
    for line in lines:
        assert line["match"] is True and line["sha256"] == line["expected"] == rows[line["key"]]["sha256"]
        assert hashlib.sha256((saved / f"{line['key']}.png").read_bytes()).hexdigest() == line["sha256"]

    result = run_cli(["reproduce", picks[0], "no-such-key_0000", "--out", two_by_two], model_cache)
    assert result.returncode == 1
    assert "unknown key(s)" in result.stderr and "no-such-key_0000" in result.stderr
    assert result.stdout.strip() == ""  # refused before anything was generated
