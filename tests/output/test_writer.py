import hashlib
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.core import naming, records
from pipeline.core.settings import Run, Settings
from pipeline.io import storage
from pipeline.output import formats, writer
from tests import trees

RUN = Run.create(Settings(width=16, height=8, steps=2, guidance_scale=7.5, model="tiny", dtype="fp32",
                          scheduler="ddim", per_device_batch=1, formats=("files", "webdataset", "parquet", "zarr")),
                 "f" * 64, created_at="2026-01-02T03:04:05+00:00", versions={})


def items(n=3, slice_index=1):
    record = records.Record(id="rec", prompt="a cat", negative_prompt="", seed=5, num_images=n,
                            guidance_scale=None, source="p.jsonl", line=1)
    return records.expand(record, first_position=slice_index * 4, slice_size=4)[:n]


def image(n):
    return np.full((8, 16, 3), 40 * n, np.uint8)


def thumbnails(out, index):
    """{member: bytes} of slice ``index``'s thumbnail pack, in its order."""
    with tarfile.open(naming.thumb_pack(out, index)) as pack:
        return {m.name: pack.extractfile(m).read() for m in pack.getmembers()}


def write_slice(out, run=RUN):
    zarr = formats.open_zarr_images(out, 12, 8, 16, per_shard=4) if "zarr" in run.settings.formats else None
    with ThreadPoolExecutor(4) as pool:
        slice_writer = writer.SliceWriter(out, run, 1, 0, pool, zarr_images=zarr)
        for n, item in enumerate(items()):
            slice_writer.add(item, image(n))
        return slice_writer.commit({"slice": 1, "images": 3})


def test_every_format_is_written_and_committed_last(tmp_path):
    out = str(tmp_path)
    rows = write_slice(out)
    assert [r["key"] for r in rows] == ["rec_0000", "rec_0001", "rec_0002"]
    for n, row in enumerate(rows):
        assert row["path"] == f"images/{naming.output_name(1)}/{row['key']}.png"
        np.testing.assert_array_equal(np.asarray(Image.open(naming.join(out, row["path"]))), image(n))
    with tarfile.open(naming.shard_tar(out, 1)) as tar:
        assert tar.getnames() == [f"rec_000{n}.{ext}" for n in range(3) for ext in ("png", "json", "txt")]
    table = pq.read_table(naming.image_parquet(out, 1))
    assert table.num_rows == 3 and "image" in table.column_names
    zarr = formats.read_zarr_images(out)
    np.testing.assert_array_equal(zarr[4:7].read().result(), np.stack([image(n) for n in range(3)]))
    marker = storage.read_json(naming.shard_stats(out, 1))
    # the marker records the size of each whole object of the slice, which collect checks from listings
    objects = [naming.shard_metadata(out, 1), naming.thumb_pack(out, 1), naming.shard_tar(out, 1),
               naming.image_parquet(out, 1)]
    index = marker.pop("thumbnail_index")
    assert marker == {"slice": 1, "images": 3, "thumbnails": 3,
                      "objects": {path[len(out) + 1:]: os.path.getsize(path) for path in sorted(objects)}}
    # each image's thumbnail, made from its pixels, packed in the slice's one thumbnail object; the
    # marker says where each is in the pack, so the gallery reads one thumbnail, not the pack
    assert thumbnails(out, 1) == {f"{row['key']}.jpg": formats.thumbnail(image(n)) for n, row in enumerate(rows)}
    for n, row in enumerate(rows):
        assert storage.read_range(naming.thumb_pack(out, 1), *index[row["key"]]) == formats.thumbnail(image(n))
    assert sorted(os.listdir(naming.join(out, "thumbs"))) == [f"{naming.output_name(1)}.tar"]
    # each row records the run's settings fingerprint and its image's size and md5, which collect checks
    for row in rows:
        data = storage.read_bytes(naming.join(out, row["path"]))
        assert (row["settings_fingerprint"], row["image_bytes"], row["image_md5"]) == (
            RUN.settings_fingerprint, len(data), hashlib.md5(data).hexdigest())
    assert [r["key"] for r in writer.read_parquet_rows(naming.shard_metadata(out, 1))] == [r["key"] for r in rows]


def test_location_follows_the_first_chosen_format():
    item = items()[1]
    name = naming.output_name(1)
    for chosen, expected in [(["webdataset", "zarr"], f"shards/{name}.tar#rec_0001.png"),
                             (["parquet"], f"parquet/{name}.parquet#rec_0001"), (["zarr"], "zarr/images#5")]:
        assert writer.image_location(Settings(formats=tuple(chosen), image_format="png"), item) == expected


def test_a_failed_upload_fails_the_slice_and_nothing_is_committed(tmp_path, monkeypatch):
    out = str(tmp_path)
    real = storage.write_bytes

    def flaky(path, data):
        if path.endswith("rec_0001.png"):
            raise OSError("injected upload failure")
        real(path, data)

    monkeypatch.setattr(storage, "write_bytes", flaky)
    with pytest.raises(OSError, match="injected upload failure"):
        write_slice(out)
    assert not storage.exists(naming.shard_stats(out, 1))
    assert not storage.exists(naming.shard_metadata(out, 1))


def test_rewriting_a_slice_gives_byte_identical_objects(tmp_path):
    """A slice redone after a crash overwrites its partial objects with the same bytes."""
    out = str(tmp_path)
    write_slice(out)
    first = trees.checksums(out)
    for path in storage.glob(out):
        # tensorstore writes each zarr object (metadata, a slice's shard) under a temporary name and renames it
        if not path.endswith(("_stats.json", "zarr.json")) and "/zarr/images/" not in path:
            with open(path, "r+b") as f:  # a partial object left by a crash
                f.truncate(max(1, os.path.getsize(path) // 2))
    write_slice(out)
    assert trees.checksums(out) == first
    assert any(name.startswith("zarr/") for name in first) and any(name.endswith(".tar") for name in first)


def test_reading_parquet_metadata_starts_no_thread(tmp_path):
    """A process that reads metadata rows and exits at once (``reproduce`` refusing a key)
    must leave no library thread starting: none is made."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("import io, os, pyarrow as pa, pyarrow.parquet as pq\n"
            "from pipeline.output import writer\n"
            "buffer = io.BytesIO(); pq.write_table(pa.table({'key': ['a', 'b']}), buffer)\n"
            "before = len(os.listdir('/proc/self/task'))\n"
            "rows = writer.parquet_table(buffer.getvalue()).to_pylist()\n"
            "print(rows == [{'key': 'a'}, {'key': 'b'}], len(os.listdir('/proc/self/task')) - before)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "0"]


def test_a_filtered_image_keeps_its_row_and_is_in_no_image_output(tmp_path):
    """The slice writer's part of the filters: the dropped image's row (its reason, its
    sha256, no path), no file, tar entry, image parquet row or thumbnail, zeros in zarr and
    True in zarr's dropped array; a flagged image that is kept gets a blurred thumbnail;
    an image without scores in a scored run is refused rather than guessed."""
    out = str(tmp_path)
    settings = RUN.settings.replace(scores=("aesthetic", "safety"), clip_model="c", aesthetic_head="h",
                                    safety_checker="s", min_aesthetic=5.0, batches_per_slice=4)  # slices of 4
    run = Run.create(settings, "f" * 64, created_at=RUN.created_at, versions={},
                     scorers={"clip": "a", "aesthetic": "b", "safety": "c"})
    scores = [{"aesthetic": 6.0, "nsfw": False, "nsfw_score": -0.1},
              {"aesthetic": 4.5, "nsfw": False, "nsfw_score": -0.2},
              {"aesthetic": 5.0, "nsfw": True, "nsfw_score": 0.03}]
    zarr = formats.open_zarr_images(out, 12, 8, 16, per_shard=4)
    with ThreadPoolExecutor(4) as pool:
        slice_writer = writer.SliceWriter(out, run, 1, 0, pool, zarr_images=zarr)
        with pytest.raises(ValueError, match="came without scores"):
            slice_writer.add(items()[0], image(0))
        for n, item in enumerate(items()):
            slice_writer.add(item, image(n + 1), scores=scores[n])
        rows = slice_writer.commit({"slice": 1, "images": 3})
    assert [(r["dropped"], r["path"] != "") for r in rows] == [
        (None, True), ("min_aesthetic: aesthetic 4.5 < 5", False), (None, True)]
    assert rows[1]["sha256"] and rows[2]["nsfw"] is True and rows[1]["aesthetic"] == 4.5
    assert not os.path.exists(naming.join(out, naming.image_name(1, "rec_0001")))
    packed = thumbnails(out, 1)  # no thumbnail of the dropped image; a flagged one's blurred
    assert list(packed) == ["rec_0000.jpg", "rec_0002.jpg"]
    assert packed["rec_0002.jpg"] == formats.thumbnail(image(3), blur=True)
    with tarfile.open(naming.shard_tar(out, 1)) as tar:
        assert {name.split(".")[0] for name in tar.getnames()} == {"rec_0000", "rec_0002"}
    assert pq.read_table(naming.image_parquet(out, 1)).column("key").to_pylist() == ["rec_0000", "rec_0002"]
    assert not zarr[5].read().result().any() and zarr[6].read().result().all()
    dropped = formats.open_zarr_dropped(out, 12, 4)[4:8].read().result()
    assert dropped.tolist() == [False, True, False, False]
    marker = storage.read_json(naming.shard_stats(out, 1))
    assert {k: v for k, v in marker.items() if k not in ("objects", "thumbnail_index")} == {
        "slice": 1, "images": 3, "thumbnails": 2, "dropped": 1}
    assert sorted(marker["thumbnail_index"]) == ["rec_0000", "rec_0002"]
