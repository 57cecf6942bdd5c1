"""Readers get the whole dataset: what collect writes for Hugging Face ``datasets``
(``OUT/README.md``'s configs, ``images/metadata.jsonl``), xarray (``zarr/key``) and
webdataset, read back with the real libraries. Cheap: a two-slice OUT is written by
hand (run.json, slice metadata, image files, tars, zarr) and ``write_dataset`` collects it."""
import json
import os
import time

import numpy as np
import pytest

from pipeline.collect import transforms as collect
from pipeline.core import naming
from pipeline.core.settings import Run
from pipeline.io import runs, storage
from pipeline.output import formats, writer

SLICES, PER_SLICE = 2, 3
MANIFEST = {"slices": SLICES, "images": SLICES * PER_SLICE, "records": SLICES * PER_SLICE, "input_rows":
            SLICES * PER_SLICE, "rejects": 0}


def run_of(out, chosen):
    return Run.from_dict({
        "settings": {"prompts": "/in/*.jsonl", "out": out, "model": "tiny", "width": 8, "height": 8, "steps": 2,
                     "scheduler": "ddim", "guidance_scale": 7.5, "seed": 1, "per_device_batch": 1,
                     "batches_per_slice": PER_SLICE, "devices_per_host": 1, "dtype": "fp32",
                     "formats": list(chosen), "image_format": "png", "prompt_field": "prompt", "attention": "auto"},
        "model_fingerprint": "f00d", "scheduler": "ddim", "settings_fingerprint": "ab12",
        "versions": {"promptmill": "0.1.0"}, "created_at": "2026-01-01T00:00:00+00:00"})


def make_out(out, chosen):
    """A committed two-slice OUT in ``chosen`` formats, collected by ``write_dataset``;
    returns the metadata rows in position order."""
    runs.write(out, run_of(out, chosen))
    if "zarr" in chosen:
        images_array = formats.open_zarr_images(out, SLICES * PER_SLICE, 8, 8)
    rows = []
    for index in range(SLICES):
        sliced, encoded = [], []
        for n in range(PER_SLICE):
            position = index * PER_SLICE + n
            key = f"rec{position:02d}_0"
            pixels = np.full((8, 8, 3), 10 * position, np.uint8)
            data = formats.encode(pixels, "png")
            path = naming.image_file(out, index, key)[len(out) + 1:] if "files" in chosen else \
                f"shards/{index:05d}.tar#{key}.png"
            row = {name: None for name, _ in writer.METADATA_FIELDS}
            row.update(key=key, id=f"rec{position:02d}", image_index=0, prompt=f"prompt number {position}",
                       prompt_truncated=False, seed=100 + position, width=8, height=8, steps=2, slice=index,
                       position=position, host=0, path=path, sha256="0" * 64)
            if "files" in chosen:
                storage.write_bytes(naming.join(out, path), data)
            if "zarr" in chosen:
                images_array[position].write(pixels).result()
            sliced.append(row)
            encoded.append(data)
        if "webdataset" in chosen:
            storage.write_bytes(naming.shard_tar(out, index),
                                formats.tar_bytes(formats.webdataset_members(sliced, encoded, "png")))
        storage.write_bytes(naming.shard_metadata(out, index), writer.parquet_bytes(sliced))
        rows += sliced
    summaries = [{"slice": i, "ok": PER_SLICE, "all_ok": True, "records": PER_SLICE, "verdicts": {}, "stats": None,
                  "truncated_images": 0, "truncated_records": 0, "unused_negative_records": 0,
                  "unused_negative_images": 0} for i in range(SLICES)]
    collect.write_dataset(MANIFEST, summaries, [], time.time(), out, 50, thumbnails=False)
    return rows


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("readers") / "out")
    return out, make_out(out, ("files", "webdataset", "zarr"))


@pytest.fixture
def offline_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return str(tmp_path / "cache")


def test_load_dataset_on_out_gives_images_with_their_prompts(collected, offline_hf):
    import datasets

    out, rows = collected
    assert not os.path.exists(naming.dataset_file(out, "README.md"))  # the card is OUT/README.md now
    loaded = datasets.load_dataset(out, split="train", cache_dir=offline_hf)
    assert isinstance(loaded.features["image"], datasets.Image) and "label" not in loaded.column_names
    assert sorted(loaded["key"]) == [r["key"] for r in rows]
    by_key = {r["key"]: r for r in rows}
    for example in loaded:
        row = by_key[example["key"]]
        assert example["prompt"] == row["prompt"] and example["seed"] == row["seed"]
        assert example["image"].size == (8, 8) and example["image"].getpixel((0, 0))[0] == 10 * row["position"]


def test_imagefolder_on_images_reads_the_metadata_and_no_label(collected, offline_hf):
    import datasets

    out, rows = collected
    lines = [json.loads(line) for line in storage.read_text(naming.images_metadata(out)).splitlines()]
    assert [line["file_name"] for line in lines] == [r["path"][len("images/"):] for r in rows]
    assert not {"clip_similarity", "aesthetic", "nsfw", "nsfw_score", "dropped"} & set(lines[0])  # no --score
    loaded = datasets.load_dataset("imagefolder", data_dir=naming.join(out, "images"), split="train",
                                   cache_dir=offline_hf)
    assert "label" not in loaded.column_names and loaded.num_rows == len(rows)
    assert {(e["key"], e["prompt"]) for e in loaded} == {(r["key"], r["prompt"]) for r in rows}


def test_xarray_opens_the_zarr_store_with_a_key_coordinate(collected):
    import xarray

    out, rows = collected
    ds = xarray.open_zarr(naming.join(out, "zarr"))
    assert "key" in ds.coords and ds["key"].dims == ("image",)
    assert [str(k) for k in ds["key"].values] == [r["key"] for r in rows]
    picked = ds.set_index(image="key").sel(image=rows[4]["key"])
    assert int(picked["images"].values[0, 0, 0]) == 10 * rows[4]["position"]


def test_webdataset_still_reads_the_tars(collected):
    import webdataset as wds

    out, rows = collected
    samples = list(wds.WebDataset([naming.shard_tar(out, i) for i in range(SLICES)], shardshuffle=False))
    assert [s["__key__"] for s in samples] == [r["key"] for r in rows]
    assert [s["txt"].decode() for s in samples] == [r["prompt"] for r in rows]
    assert [json.loads(s["json"])["seed"] for s in samples] == [r["seed"] for r in rows]


def test_a_webdataset_only_card_points_at_the_tars(tmp_path, offline_hf):
    import datasets

    out = str(tmp_path / "out")
    rows = make_out(out, ("webdataset",))
    assert not os.path.exists(naming.images_metadata(out))
    loaded = datasets.load_dataset(out, split="train", cache_dir=offline_hf)
    assert isinstance(loaded.features["png"], datasets.Image)
    assert sorted(loaded["txt"]) == sorted(r["prompt"] for r in rows)


def test_a_foreign_readme_is_refused_before_collect_writes_and_kept(tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)
    mine = "# My notes\n\nthis folder is mine\n"
    storage.write_text(naming.dataset_card(out), mine)
    with pytest.raises(collect.CollectError, match="not a dataset card that promptmill wrote"):
        make_out(out, ("files",))
    assert storage.read_text(naming.dataset_card(out)) == mine
    assert not os.path.exists(naming.dataset_file(out, "metadata.parquet"))
    assert not os.path.exists(naming.images_metadata(out))


def test_collect_rewrites_its_own_card_and_overwrite_keeps_a_users(collected, tmp_path):
    from pipeline.plan import prepare

    out, _ = collected
    assert naming.is_our_card(storage.read_text(naming.dataset_card(out)))
    collect.check_card(out)  # its own card: no refusal
    assert naming.owned("README.md") and naming.owned("images/metadata.jsonl") and naming.owned("zarr/key/c/0")
    theirs = str(tmp_path / "theirs")
    storage.write_text(naming.join(theirs, "run.json"), storage.read_text(naming.run_json(out)))
    storage.write_text(naming.dataset_card(theirs), "# mine\n")
    storage.write_text(naming.images_metadata(theirs), "{}\n")
    prepare.clear_run(theirs)
    assert storage.read_text(naming.dataset_card(theirs)) == "# mine\n"
    assert not os.path.exists(naming.images_metadata(theirs))
