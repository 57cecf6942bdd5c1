import io
import os
import json
import tarfile

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from pipeline.core import choices
from pipeline.output import formats, writer


def image(seed=0, size=(32, 48)):
    return (np.random.default_rng(seed).random(size + (3,)) * 255).astype(np.uint8)


@pytest.mark.parametrize("image_format", list(formats.IMAGE_FORMATS))
def test_encoding_is_deterministic_and_readable(image_format):
    data = formats.encode(image(), image_format, quality=90)
    assert data == formats.encode(image(), image_format, quality=90)
    with Image.open(io.BytesIO(data)) as decoded:
        assert decoded.size == (48, 32) and decoded.format == formats.IMAGE_FORMATS[image_format][0]
        pixels = np.asarray(decoded.convert("RGB"))
    if image_format == "png":
        np.testing.assert_array_equal(pixels, image())  # lossless


def test_quality_changes_lossy_bytes():
    assert formats.encode(image(), "jpeg", 50) != formats.encode(image(), "jpeg", 95)


@pytest.mark.parametrize("text,expected", [("files", ("files",)), ("zarr,files", ("files", "zarr")),
                                           (" webdataset , parquet ", ("webdataset", "parquet"))])
def test_parse_formats(text, expected):
    assert choices.parse_formats(text) == expected


@pytest.mark.parametrize("bad", ["", "tiff", "files,tiff"])
def test_parse_formats_rejects_unknown(bad):
    with pytest.raises(ValueError, match="--format"):
        choices.parse_formats(bad)


ROWS = [{"key": "a_0000", "prompt": "a cat", "path": "images/00000/a_0000.png", "seed": 1},
        {"key": "b_0001", "prompt": "ünïcode", "path": "images/00000/b_0001.png", "seed": 2}]


def test_webdataset_tar_is_deterministic_and_iterates_with_webdataset(tmp_path):
    import webdataset as wds

    encoded = [formats.encode(image(n)) for n in range(2)]
    data = formats.tar_bytes(formats.webdataset_members(ROWS, encoded, "png"))
    assert data == formats.tar_bytes(formats.webdataset_members(ROWS, encoded, "png"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert {m.mtime for m in tar.getmembers()} == {0}
    (tmp_path / "s.tar").write_bytes(data)
    samples = list(wds.WebDataset(str(tmp_path / "s.tar"), shardshuffle=False))
    assert [s["__key__"] for s in samples] == ["a_0000", "b_0001"]
    for sample, row, blob in zip(samples, ROWS, encoded):
        assert set(sample) >= {"png", "json", "txt"}
        assert sample["png"] == blob and json.loads(sample["json"]) == row and sample["txt"].decode() == row["prompt"]


def test_image_parquet_has_a_hugging_face_image_column():
    schema = pa.schema([("key", pa.string()), ("prompt", pa.string()), ("path", pa.string()), ("seed", pa.int64())])
    encoded = [formats.encode(image(n)) for n in range(2)]
    table = writer.parquet_table(formats.image_parquet_bytes(ROWS, encoded, schema))
    assert table.column_names == ["key", "prompt", "path", "seed", "image"]
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features["image"] == {"_type": "Image"} and features["seed"]["dtype"] == "int64"
    first = table.to_pylist()[0]["image"]
    assert first["path"] == "a_0000.png"
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(first["bytes"]))), image(0))


def test_zarr_images_round_trip_one_chunk_per_image_one_shard_per_slice(tmp_path):
    """Each image is its own chunk (a reader reads one image alone), and a slice's images
    are one shard, one object, written whole when the slice commits."""
    import tensorstore as ts

    out = str(tmp_path)
    array = formats.open_zarr_images(out, 5, 32, 48, per_shard=2)
    array[3].write(image(3)).result()
    again = formats.open_zarr_images(out, 5, 32, 48, per_shard=2)  # a second host opens the same array
    txn = ts.Transaction()  # a slice's writes, held until it commits
    for n in (0, 1):
        again.with_transaction(txn)[n].write(image(n)).result()
    assert not os.path.exists(f"{out}/zarr/images/c/0")
    txn.commit_async().result()
    back = formats.read_zarr_images(out)
    assert back.shape == (5, 32, 48, 3)
    for n in (0, 1, 3):
        np.testing.assert_array_equal(back[n].read().result(), image(n))
    assert back.chunk_layout.read_chunk.shape == (1, 32, 48, 3) and back.chunk_layout.write_chunk.shape[0] == 2
    assert sorted(os.listdir(f"{out}/zarr/images/c")) == ["0", "1"]  # two shards: two objects for three images



def test_out_zarr_is_a_group_that_xarray_opens(tmp_path):
    """OUT/zarr: a zarr v3 group whose arrays name their dimensions (images, latents and
    dropped share "image"), consolidated by collect."""
    import warnings

    import xarray

    out = str(tmp_path / "out")
    images = formats.open_zarr_images(out, 3, 8, 16)
    images[1].write(np.full((8, 16, 3), 9, np.uint8)).result()
    formats.open_zarr_latents(out, 3, (4, 1, 2), {"vae_scaling_factor": 0.18215})
    formats.open_zarr_dropped(out, 3, 2)[0:2].write(np.array([True, False])).result()
    formats.consolidate_zarr(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # xarray warns when it finds no consolidated metadata
        dataset = xarray.open_zarr(f"{out}/zarr")
    assert dataset["images"].dims == formats.IMAGE_DIMS and dataset["latents"].dims == formats.LATENT_DIMS
    assert dataset.sizes["image"] == 3 and dataset["dropped"].values.tolist() == [True, False, False]
    assert dataset["images"][1].values.min() == 9 and not dataset["images"][2].values.any()
