"""Output formats of a slice: files, WebDataset tar, Hugging Face-style parquet, zarr.

Every format is a pure function of the slice's images and metadata rows, so the bytes
of every object are deterministic: tar members carry no times or owners, images are
encoded with fixed settings, rows come in position order. Each object is written whole
under its final name through ``pipeline.io.storage``; zarr arrays go through tensorstore's
own kvstore (``file`` or ``gcs``), with zarr's sharding codec: one chunk per image, one
shard (one object) per slice, which the slice's commit writes whole.
"""
from __future__ import annotations

import io
import json
import tarfile

import numpy as np

from pipeline.core import naming
from pipeline.core.choices import IMAGE_FORMATS
from pipeline.io import gcs, storage

PNG_COMPRESS_LEVEL = 6
THUMB_SIZE = 128  # the gallery's thumbnails fit in THUMB_SIZE x THUMB_SIZE


def extension(image_format: str) -> str:
    return IMAGE_FORMATS[image_format][1]


def encode(image: np.ndarray, image_format: str = "png", quality: int = 95) -> bytes:
    """Encoded bytes of a uint8 [H, W, 3] image, deterministic for fixed settings."""
    from PIL import Image

    pil_format, _ = IMAGE_FORMATS[image_format]
    options = {"compress_level": PNG_COMPRESS_LEVEL} if image_format == "png" else {"quality": quality}
    if image_format == "webp":
        options["method"] = 4
    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format=pil_format, **options)
    return buffer.getvalue()


BLUR_RADIUS = THUMB_SIZE // 8  # a flagged image's thumbnail: shapes and colours, no detail


def thumbnail(image: np.ndarray | bytes, size: int = THUMB_SIZE, blur: bool = False) -> bytes:
    """A JPEG of ``image`` fitted inside ``size`` x ``size``: uint8 [H, W, 3] pixels, or
    encoded bytes in any format PIL reads.

    The aspect ratio is kept and nothing is enlarged. The bytes depend only on the
    pixels: no metadata or timestamps are written, so a PNG's thumbnail is the same
    as its pixels' thumbnail. ``blur``: the thumbnail is blurred beyond recognition (an
    image the safety checker flagged: the gallery shows that it is there, not what it is).
    """
    from PIL import Image

    if isinstance(image, np.ndarray):
        rgb = Image.fromarray(image, mode="RGB")
    else:
        with Image.open(io.BytesIO(image)) as decoded:
            decoded.load()
            if decoded.mode in ("RGBA", "LA", "PA") or (decoded.mode == "P" and "transparency" in decoded.info):
                rgba = decoded.convert("RGBA")  # transparent pixels on white, like a page shows them
                rgb = Image.new("RGB", rgba.size, (255, 255, 255))
                rgb.paste(rgba, mask=rgba.getchannel("A"))
            else:
                rgb = decoded.convert("RGB")
    rgb.thumbnail((size, size), Image.Resampling.LANCZOS)
    if blur:
        from PIL import ImageFilter

        rgb = rgb.filter(ImageFilter.GaussianBlur(BLUR_RADIUS * max(rgb.size) / size))
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=85, optimize=True)
    return out.getvalue()


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """A tar archive of (name, data) in the given order, with no times, owners or modes that vary."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tar_offsets(members: list[tuple[str, bytes]]) -> list[tuple[int, int]]:
    """(offset, size) of each member's data in ``tar_bytes(members)`` (pure): a 512-byte
    header before each member, its data padded to 512 bytes; names under 100 characters
    (keys are at most 80), so no member needs a long-name header."""
    found, at = [], 0
    for name, data in members:
        if len(name.encode()) >= 100:
            raise ValueError(f"a member name of 100 bytes or more needs its own header: {name!r}")
        found.append((at + 512, len(data)))
        at += 512 + -(-len(data) // 512) * 512
    return found


def webdataset_members(rows: list[dict], encoded: list[bytes], ext: str) -> list[tuple[str, bytes]]:
    """WebDataset samples: KEY.<ext>, KEY.json (the metadata row), KEY.txt (the prompt)."""
    members = []
    for row, data in zip(rows, encoded):
        members += [(f"{row['key']}.{ext}", data),
                    (f"{row['key']}.json", json.dumps(row, sort_keys=True, ensure_ascii=False).encode()),
                    (f"{row['key']}.txt", row["prompt"].encode())]
    return members


def _hf_feature(arrow_type) -> dict:
    import pyarrow as pa

    names = {pa.string(): "string", pa.int32(): "int32", pa.int64(): "int64", pa.float64(): "float64",
             pa.bool_(): "bool"}
    return {"dtype": names[arrow_type], "_type": "Value"}


def image_parquet_bytes(rows: list[dict], encoded: list[bytes], schema) -> bytes:
    """Metadata rows plus an ``image`` column {bytes, path} that Hugging Face datasets decodes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    full = schema.append(pa.field("image", image_type))
    features = {field.name: _hf_feature(field.type) for field in schema}
    features["image"] = {"_type": "Image"}
    full = full.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    images = [{"bytes": data, "path": row["path"].rsplit("/", 1)[-1]} for row, data in zip(rows, encoded)]
    table = pa.Table.from_pylist([dict(row, image=image) for row, image in zip(rows, images)], schema=full)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def zarr_kvstore(path: str) -> dict:
    """A tensorstore kvstore spec for a local folder or a gs:// prefix."""
    if storage.is_gcs(path):
        bucket, _, prefix = path[len(gcs.PREFIX):].partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": prefix.rstrip("/") + "/"}
    return {"driver": "file", "path": path}


# OUT/zarr is a zarr v3 group (its zarr.json) whose arrays name their dimensions, so that
# xarray.open_zarr(OUT/zarr) opens it as a Dataset; arrays of one dimension name share its size
ZARR_GROUP = {"zarr_format": 3, "node_type": "group",
              "attributes": {"promptmill": "images, latents and dropped are indexed by image position (the "
                                           "metadata's position column)"}}
IMAGE_DIMS = ("image", "height", "width", "channel")
LATENT_DIMS = ("image", "latent_channel", "latent_height", "latent_width")


def write_zarr_group(out: str, group: str = "") -> None:
    """``OUT/zarr/zarr.json``: the group's metadata, the same bytes from any host; with
    ``group`` (a size of a run of several), that size's group inside it too."""
    storage.write_bytes(naming.join(out, "zarr", "zarr.json"), json.dumps(ZARR_GROUP, sort_keys=True).encode())
    if group:
        storage.write_bytes(naming.join(naming.zarr_group(out, group), "zarr.json"),
                            json.dumps(ZARR_GROUP, sort_keys=True).encode())


def _open_array(spec: dict):
    """``ts.open(spec, create=True, open=True)``: made by whichever host comes first, with
    the same metadata from every host. (An array of an earlier layout is never opened: such
    a run is refused, ``pipeline.io.runs.check_versions``.)"""
    import tensorstore as ts

    return ts.open(spec, create=True, open=True).result()


def _sharded(image_shape: list[int], per_shard: int, inner: list[dict]) -> dict:
    """The metadata of an array sharded by slice: a shard (one object) holds ``per_shard``
    images, each its own chunk of ``image_shape`` encoded with ``inner`` (zarr v3's
    ``sharding_indexed`` codec, so a reader still reads one image without its shard's others)."""
    return {"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [per_shard, *image_shape]}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [1, *image_shape], "codecs": inner,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                # the index first: a reader finds it with a range from the object's start, which every
                # server answers (a suffix range, for an index at the end, is not: the GCS emulator's)
                "index_location": "start"}}]}


def open_zarr_images(out: str, count: int, height: int, width: int, group: str = "", per_shard: int = 1):
    """The dataset's zarr3 image array [count, H, W, 3] uint8 in the ``OUT/zarr`` group
    (``write_zarr_group``), its dimensions named ``IMAGE_DIMS``: one chunk per image and one
    shard per slice (``per_shard``: the slice size; a slice's first position is a multiple of it).

    Every host opens it with ``create`` and ``open``: the metadata is the same from any
    host, so whichever writes it first writes the same bytes. A position never written
    (a dropped image's) reads as zeros, the array's fill value.
    """
    write_zarr_group(out, group)
    spec = {"driver": "zarr3", "kvstore": zarr_kvstore(naming.zarr_images(out, group)),
            "metadata": {"shape": [max(count, 1), height, width, 3], "data_type": "uint8",
                         **_sharded([height, width, 3], per_shard,
                                    [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 3}}]),
                         "dimension_names": list(IMAGE_DIMS)}}
    return _open_array(spec)


def open_zarr_dropped(out: str, count: int, slice_size: int, group: str = ""):
    """``OUT/zarr/dropped``: bool [count], True where a filter kept the image out (its
    images row stays zeros); one chunk per slice, so each slice's commit writes its own."""
    spec = {"driver": "zarr3", "kvstore": zarr_kvstore(naming.join(naming.zarr_group(out, group), "dropped")),
            "metadata": {"shape": [max(count, 1)], "data_type": "bool",
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [slice_size]}},
                         "codecs": [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 3}}],
                         "dimension_names": ["image"]}}
    return _open_array(spec)


def read_zarr_images(out: str, group: str = ""):
    import tensorstore as ts

    return ts.open({"driver": "zarr3", "kvstore": zarr_kvstore(naming.zarr_images(out, group))}).result()


def open_zarr_latents(out: str, count: int, latent_shape: tuple[int, int, int], note: dict, group: str = "",
                      per_shard: int = 1):
    """``--save-latents``: the zarr3 array [count, C, H/f, W/f] float32, one chunk per image
    and one shard per slice (``per_shard``), as ``open_zarr_images``.

    Opened by every host like ``open_zarr_images``; its attributes (``note``: the model
    family's ``latents_note``) say which latents these are and how to decode them (the
    VAE's scaling factor, FLUX.1's shift).
    """
    shape = [int(n) for n in latent_shape]
    spec = {"driver": "zarr3", "kvstore": zarr_kvstore(naming.zarr_latents(out, group)),
            "metadata": {"shape": [max(count, 1), *shape], "data_type": "float32",
                         **_sharded(shape, per_shard, [{"name": "bytes", "configuration": {"endian": "little"}},
                                                       {"name": "zstd", "configuration": {"level": 3}}]),
                         "attributes": dict(note), "dimension_names": list(LATENT_DIMS)}}
    return _open_array(spec)


def read_zarr_latents(out: str, group: str = ""):
    import tensorstore as ts

    return ts.open({"driver": "zarr3", "kvstore": zarr_kvstore(naming.zarr_latents(out, group))}).result()


def write_zarr_key_chunk(out: str, keys: list[str], count: int, per_chunk: int, chunk: int, group: str = "") -> None:
    """One slice's chunk of ``OUT/zarr/key``: the key of each of its positions ("" where no
    row holds one), chunk ``chunk`` of a string array of ``count`` on the ``image`` dimension
    with one chunk per slice (``per_chunk``), so that ``xarray.open_zarr(OUT/zarr)`` has a
    ``key`` coordinate to join the metadata on. The step that verifies the slice writes it;
    the array's metadata comes with chunk 0 (the same bytes from any writer).

    Written by zarr-python, not tensorstore: tensorstore's zarr3 driver has no string
    data type, and zarr v3's variable-length ``string`` is what xarray reads as strings.
    zarr-python writes into memory and each object is then written through
    ``pipeline.io.storage``, so a gs:// OUT needs no fsspec filesystem."""
    import zarr
    from zarr.storage import MemoryStore

    contents = {}
    array = zarr.create_array(store=MemoryStore(contents), shape=(max(count, 1),), dtype=str, chunks=(per_chunk,),
                              fill_value="", dimension_names=["image"], zarr_format=3,
                              attributes={"promptmill": "the metadata's key of each image position"})
    if keys:
        array[chunk * per_chunk:chunk * per_chunk + len(keys)] = np.asarray(keys, dtype=str)
    for name, buffer in sorted(contents.items()):
        if name != "zarr.json" or chunk == 0:
            storage.write_bytes(naming.join(naming.zarr_group(out, group), "key", name), buffer.to_bytes())


def consolidate_zarr(out: str, group: str = "") -> None:
    """Rewrite ``OUT/zarr/zarr.json`` with the metadata of the group's arrays inlined, as
    zarr-python's ``consolidate_metadata`` does for zarr v3, so that ``xarray.open_zarr``
    reads one object instead of one per array (and does not warn). Collect calls it once
    every array is made; the arrays' own metadata stays where it is."""
    arrays = {}
    for name in ("images", "latents", "dropped", "key"):
        path = naming.join(naming.zarr_group(out, group), name, "zarr.json")
        if storage.exists(path):
            arrays[name] = storage.read_json(path)
    consolidated = {**ZARR_GROUP, "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                                            "metadata": arrays}}
    if "key" in arrays:  # xarray's CF decoding makes the arrays the group's attribute names coordinates
        consolidated["attributes"] = {**consolidated["attributes"], "coordinates": "key"}
    storage.write_bytes(naming.join(naming.zarr_group(out, group), "zarr.json"),
                        json.dumps(consolidated, sort_keys=True).encode())


def consolidate_zarr_sizes(out: str, groups: list[str]) -> None:
    """``OUT/zarr/zarr.json`` of a run of several sizes: the root group with each size's
    group and its arrays inlined (paths ``WxH`` and ``WxH/images``), so that
    ``xarray.open_zarr(OUT/zarr, group="WxH")`` reads one object. Called after
    ``consolidate_zarr`` of each size's group."""
    inlined = {}
    for group in groups:
        found = storage.read_json(naming.join(naming.zarr_group(out, group), "zarr.json"))
        inner = found.get("consolidated_metadata", {}).get("metadata", {})
        inlined[group] = {k: v for k, v in found.items() if k != "consolidated_metadata"}
        inlined.update({f"{group}/{name}": meta for name, meta in inner.items()})
    root = {**ZARR_GROUP, "attributes": {"promptmill": "one group per image size (WIDTHxHEIGHT), each as a "
                                                      "single-size run's: images, latents and dropped indexed by "
                                                      "the image's position within its size"},
            "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": inlined}}
    storage.write_bytes(naming.join(out, "zarr", "zarr.json"), json.dumps(root, sort_keys=True).encode())
