"""Readers get the whole dataset: what collect writes for Hugging Face ``datasets``
(``OUT/README.md``'s configs, each slice folder's ``metadata.jsonl``), pyarrow, pandas and
DuckDB (the metadata's parts), xarray (``zarr/key``) and webdataset, read back with the
real libraries. Cheap: the runs are fabricated (``pipeline.testing.fabricate``: the hosts'
writers without a model) and collected by ``run_collect``."""
import importlib.util
import json
import os

import pytest

from jobs import cli
from pipeline.collect import parts, transforms as collect
from pipeline.core import logs, naming
from pipeline.io import storage
from pipeline.testing import fabricate

IMAGES, SLICE, PART_ROWS = 14, 4, 8  # 4 slices (the last of 2 images), 2 slices a part: 2 parts


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("readers") / "out")
    fabricate.fabricate(out, IMAGES, slice_size=SLICE, chosen=("files", "webdataset", "zarr"), per_record=2)
    collect.run_collect(out, part_rows=PART_ROWS)
    return out, parts.dataset_rows(out)


@pytest.fixture
def offline_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return str(tmp_path / "cache")


def test_the_metadata_is_in_parts_that_table_readers_read_as_one(collected):
    import pandas
    import pyarrow.dataset

    out, rows = collected
    assert sorted(os.listdir(naming.join(out, "dataset", "metadata"))) == ["part-00000.parquet", "part-00001.parquet"]
    assert [r["position"] for r in rows] == list(range(IMAGES))  # every row, in plan order
    folder = naming.join(out, "dataset", "metadata")
    assert sorted(pyarrow.dataset.dataset(folder, format="parquet").to_table().column("key").to_pylist()) == \
        sorted(r["key"] for r in rows)
    assert sorted(pandas.read_parquet(folder)["key"]) == sorted(r["key"] for r in rows)
    if importlib.util.find_spec("duckdb"):  # DuckDB is no dependency: read where installed
        import duckdb

        assert duckdb.sql(f"select count(*) from '{folder}/*.parquet'").fetchone()[0] == IMAGES


def test_load_dataset_on_out_gives_images_with_their_prompts(collected, offline_hf):
    import datasets

    out, rows = collected
    loaded = datasets.load_dataset(out, split="train", cache_dir=offline_hf)
    assert isinstance(loaded.features["image"], datasets.Image) and "label" not in loaded.column_names
    assert sorted(loaded["key"]) == sorted(r["key"] for r in rows)
    by_key = {r["key"]: r for r in rows}
    for example in loaded:
        row = by_key[example["key"]]
        assert example["prompt"] == row["prompt"] and example["seed"] == row["seed"]
        assert example["image"].size == (8, 8)
        assert example["image"].getpixel((0, 0)) == tuple(fabricate.pixels(row["position"], 8)[0, 0])


def test_imagefolder_on_images_reads_each_slices_metadata_and_no_label(collected, offline_hf):
    import datasets

    out, rows = collected
    for index in range(4):
        lines = [json.loads(line) for line in storage.read_text(naming.images_metadata(out, index)).splitlines()]
        assert [line["file_name"] for line in lines] == [r["path"].rsplit("/", 1)[1] for r in rows
                                                         if r["slice"] == index]
        assert not {"clip_similarity", "aesthetic", "nsfw", "nsfw_score", "dropped"} & set(lines[0])  # no --score
    loaded = datasets.load_dataset("imagefolder", data_dir=naming.join(out, "images"), split="train",
                                   cache_dir=offline_hf)
    assert "label" not in loaded.column_names and loaded.num_rows == len(rows)
    assert {(e["key"], e["prompt"]) for e in loaded} == {(r["key"], r["prompt"]) for r in rows}


def test_xarray_opens_the_zarr_store_with_a_key_coordinate_chunked_by_slice(collected):
    import xarray

    out, rows = collected
    ds = xarray.open_zarr(naming.join(out, "zarr"))
    assert "key" in ds.coords and ds["key"].dims == ("image",)
    assert [str(k) for k in ds["key"].values] == [r["key"] for r in rows]
    assert sorted(os.listdir(naming.join(out, "zarr", "key", "c"))) == ["0", "1", "2", "3"]  # one chunk a slice
    picked = ds.set_index(image="key").sel(image=rows[6]["key"])
    assert picked["images"].values[0, 0].tolist() == fabricate.pixels(6, 8)[0, 0].tolist()


def test_webdataset_still_reads_the_tars(collected):
    import webdataset as wds

    out, rows = collected
    samples = list(wds.WebDataset([naming.shard_tar(out, i) for i in range(4)], shardshuffle=False))
    assert [s["__key__"] for s in samples] == [r["key"] for r in rows]
    assert [s["txt"].decode() for s in samples] == [r["prompt"] for r in rows]
    assert [json.loads(s["json"])["seed"] for s in samples] == [r["seed"] for r in rows]


def test_a_webdataset_only_card_points_at_the_tars(tmp_path, offline_hf):
    import datasets

    out = str(tmp_path / "out")
    fabricate.fabricate(out, 6, slice_size=3, chosen=("webdataset",))
    collect.run_collect(out, gallery_thumbnails=False)
    assert not storage.glob(naming.join(out, "images"))
    loaded = datasets.load_dataset(out, split="train", cache_dir=offline_hf)
    assert isinstance(loaded.features["png"], datasets.Image)
    assert sorted(loaded["txt"]) == sorted(r["prompt"] for r in parts.dataset_rows(out))


def test_a_filter_that_drops_every_image_is_said_and_the_dataset_still_loads(tmp_path, offline_hf, capfd):
    """Issue 56, item 5: every image dropped is said in the end summary and as a warning
    event, and ``datasets.load_dataset(OUT)`` still loads the dataset (its rows, each with
    its reason), while the card says why the image builders cannot."""
    import datasets

    out = str(tmp_path / "out")
    fabricate.fabricate(out, 5, slice_size=3, image_scores={"clip_similarity": -0.25}, scores=("clip",),
                        clip_model="tiny-clip", min_clip_similarity=0.0)
    assert cli.main(["collect", "--out", out]) == 0
    err = capfd.readouterr().err
    [warning] = [e for e in map(logs.parse, err.splitlines()) if e and e["event"] == "all_images_dropped"]
    assert warning["level"] == "warning" and warning["dropped"] == 5
    assert "warning: the score filters dropped every image (5 of 5" in err  # the summary's own line
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    assert stats["verified"] and stats["images"] == 0 and stats["dropped"]["images"] == 5
    loaded = datasets.load_dataset(out, split="train", cache_dir=offline_hf)
    assert loaded.num_rows == 5 and set(loaded["dropped"]) == {"min_clip_similarity: clip_similarity -0.25 < 0"}
    assert "No image was kept" in storage.read_text(naming.dataset_card(out))
    page = storage.read_text(naming.dataset_file(out, "index.html"))  # each row, without a picture, and why
    assert page.count('class="nopic"') == 5 and "<img" not in page


def test_a_foreign_readme_is_refused_before_collect_writes_and_kept(tmp_path):
    out = str(tmp_path / "out")
    fabricate.fabricate(out, 4, slice_size=2)
    mine = "# My notes\n\nthis folder is mine\n"
    storage.write_text(naming.dataset_card(out), mine)
    with pytest.raises(collect.CollectError, match="not a dataset card that promptmill wrote"):
        collect.run_collect(out)
    assert storage.read_text(naming.dataset_card(out)) == mine
    assert not storage.glob(naming.join(out, "dataset"))
    assert not os.path.exists(naming.images_metadata(out, 0))


def test_collect_rewrites_its_own_card_and_overwrite_keeps_a_users(collected, tmp_path):
    from pipeline.plan import prepare

    out, _ = collected
    assert naming.is_our_card(storage.read_text(naming.dataset_card(out)))
    collect.check_card(out)  # its own card: no refusal
    assert naming.owned("README.md") and naming.owned(naming.images_metadata("", 3)[1:])
    assert naming.owned("zarr/key/c/0")
    theirs = str(tmp_path / "theirs")
    storage.write_text(naming.join(theirs, "run.json"), storage.read_text(naming.run_json(out)))
    storage.write_text(naming.dataset_card(theirs), "# mine\n")
    storage.write_text(naming.images_metadata(theirs, 3), "{}\n")
    prepare.clear_run(theirs)
    assert storage.read_text(naming.dataset_card(theirs)) == "# mine\n"
    assert not os.path.exists(naming.images_metadata(theirs, 3))


def test_the_collect_bench_counts_objects_by_kind_and_carries_them_to_a_billion(collected, tmp_path):
    """``bench collect``'s arithmetic on a collected run: objects per image and per slice,
    write operations at 10^9 images, and the look-up's report (bytes read, objects read)."""
    from pipeline.bench import collect_scale

    out, rows = collected
    counted = collect_scale.count_objects(out, 4)
    # per image: its file; per slice: plan slice, metadata shard, marker, thumbnail pack, tar, metadata.jsonl,
    # zarr shard and key chunk
    assert (counted["per_image"], counted["per_slice_each"]) == (IMAGES, 8.0)
    hosts = {"per_image": 10, "images": 10, "per_slice_each": 5.0}
    found = collect_scale.per_billion(hosts, {"per_slice_each": 1.0}, slice_size=1000, part_rows=1_000_000)
    assert found["per_image"] == 10 ** 9 and found["per_slice"] == 6 * 10 ** 6 and found["per_part"] == 1000
    assert found["usd"] == round(found["total"] / 1000 * collect_scale.CLASS_A_USD_PER_1000, 2)
    report = tmp_path / "lookup.json"
    assert collect_scale.lookup(out, str(report), [rows[0]["key"], rows[-1]["key"]]) == 0
    looked = json.loads(report.read_text())
    assert looked["keys"] == 2 and looked["objects_read"] == 6  # a key: the manifest, a bucket and a shard


def test_reproduce_finds_a_key_from_the_plan_before_collect(tmp_path):
    """Before collect, a key's slice comes from the plan's key index and its row from the
    slice's shard: two small reads after the manifest, whatever the run's size; a key of a
    slice not committed yet is refused, naming the slice."""
    from pipeline.generate import reproduce

    out = str(tmp_path / "out")
    fabricate.fabricate(out, 9, slice_size=4)
    assert not storage.glob(naming.join(out, "dataset"))
    reads = []
    found = reproduce.find_rows(out, ["r0000000_0000", "r0000008_0000", "nobody_0000"], reads)
    assert sorted(found) == ["r0000000_0000", "r0000008_0000"] and found["r0000008_0000"]["slice"] == 2
    assert [os.path.basename(path) for path, _ in reads] == [
        "manifest.json", "00000.parquet", f"{naming.output_name(0)}.parquet", f"{naming.output_name(2)}.parquet"]
    os.remove(naming.shard_stats(out, 2))
    with pytest.raises(reproduce.ReproduceError, match="r0000008_0000: slice 2 is not committed yet"):
        reproduce.find_rows(out, ["r0000008_0000"])
