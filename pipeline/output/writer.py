"""The outputs of one slice: images, their gallery thumbnails, the metadata shard, and
the commit marker.

Every name and every byte is deterministic: PNGs carry no timestamps, a row's
``created_at`` is the run's (from run.json), and a slice's ``_stats.json`` is written
last, so a slice without it is simply redone with the same bytes.

The thumbnail of each image is made from its pixels while they are in memory, and the
slice's thumbnails are packed into one tar (``naming.thumb_pack``), so collect builds the
gallery without reading any image back and a slice costs one thumbnail object, not one
per image. The commit marker says how many thumbnails the slice holds (``thumbnails``),
where each is in the pack (``thumbnail_index``: key -> [offset, size], so the gallery
reads a thumbnail, not the pack) and the size of every whole object the slice wrote
(``objects``), which collect checks against a listing. With zarr, the slice's images (and
latents) are one shard of each array (``formats.open_zarr_images``), written whole when
the slice commits.
"""
from __future__ import annotations

import hashlib
import json
import threading

import numpy as np

from pipeline import __version__
from pipeline.core import decode_batch, filters, naming
from pipeline.core.records import Item
from pipeline.core.settings import Run, Settings
from pipeline.io import storage
from pipeline.output import formats

METADATA_FIELDS = (
    ("key", "string"), ("id", "string"), ("image_index", "int32"), ("prompt", "string"),
    ("prompt_truncated", "bool_"), ("negative_prompt", "string"), ("seed", "int64"), ("width", "int32"),
    ("height", "int32"), ("steps", "int32"), ("guidance_scale", "float64"), ("scheduler", "string"), ("model", "string"),
    ("model_fingerprint", "string"), ("loras", "string"), ("dtype", "string"), ("per_device_batch", "int32"),
    ("slice", "int32"),
    ("position", "int64"), ("host", "int32"), ("sha256", "string"), ("path", "string"), ("source", "string"),
    ("line", "int64"), ("extra", "string"), ("promptmill_version", "string"), ("created_at", "string"),
    # --score (pipeline.generate.scoring): null when the run does not compute the score
    ("clip_similarity", "float64"), ("aesthetic", "float64"), ("nsfw", "bool_"), ("nsfw_score", "float64"),
    # the filters' reason for keeping the image out of every image output (pipeline.core.filters); null: kept
    ("dropped", "string"),
    # how many images the VAE decoded at once (--decode-batch); null: the whole per-device batch
    ("decode_batch", "int32"),
    # the fingerprint of the environment it was made in (OUT/environment.json), which collect checks
    ("environment", "string"),
    # the run's settings fingerprint (run.json's), which collect checks on every row: a row of another run fails
    ("settings_fingerprint", "string"),
    # the encoded image's size and md5 (hex), which collect checks against the image file's listing
    ("image_bytes", "int64"), ("image_md5", "string"),
)
SCORE_FIELDS = ("clip_similarity", "aesthetic", "nsfw", "nsfw_score")


def metadata_schema():
    import pyarrow as pa

    return pa.schema([(name, getattr(pa, kind)()) for name, kind in METADATA_FIELDS])


def metadata_row(item: Item, run: Run, host: int, data: bytes, path: str, *, truncated: bool = False,
                 scores: dict | None = None, dropped: str | None = None) -> dict:
    """The metadata of one image (``METADATA_FIELDS``); ``truncated``: the prompt was
    longer than the text encoder takes, and only its start was used; ``scores``: its
    scores by column (``SCORE_FIELDS``); ``dropped``: why a filter kept it out of every
    image output (its ``path`` is then empty: no output holds it; its ``sha256`` is still
    that of its encoded bytes, so ``reproduce`` can check it)."""
    scores = scores or {}
    settings = run.settings
    guidance = item.guidance_scale if item.guidance_scale is not None else settings.guidance_scale
    return {
        "key": item.key, "id": item.id, "image_index": item.image_index, "prompt": item.prompt,
        "prompt_truncated": bool(truncated),
        "negative_prompt": item.negative_prompt, "seed": item.seed, "width": settings.width,
        "height": settings.height, "steps": settings.steps, "guidance_scale": float(guidance),
        "scheduler": run.scheduler, "model": settings.model, "model_fingerprint": run.model_fingerprint,
        # the LoRA adapters merged into the model: JSON [{path, scale, sha256}], in order
        "loras": json.dumps([lora.to_dict() for lora in run.loras]),
        "dtype": settings.dtype, "per_device_batch": settings.per_device_batch, "slice": item.slice,
        "position": item.position, "host": host, "sha256": hashlib.sha256(data).hexdigest(), "path": path,
        "source": item.source, "line": item.line, "extra": json.dumps(item.extra, sort_keys=True, ensure_ascii=False),
        "promptmill_version": __version__,
        "created_at": run.created_at,  # when the run was first planned: a redone slice gets the same bytes
        **{name: None if scores.get(name) is None else (bool(scores[name]) if name == "nsfw" else float(scores[name]))
           for name in SCORE_FIELDS},
        "dropped": dropped,
        "decode_batch": decode_batch.planned(settings.decode_batch),
        "environment": run.environment,
        "settings_fingerprint": run.settings_fingerprint,
        "image_bytes": len(data), "image_md5": hashlib.md5(data).hexdigest(),
    }


def parquet_bytes(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=metadata_schema())
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def parquet_table(data: bytes):
    """A Parquet file's bytes as a pyarrow Table.

    Decoded on the calling thread, through ``ParquetFile`` rather than ``read_table``:
    the latter goes through pyarrow's datasets, which start a thread of their own even
    with ``use_threads=False``; a process that exits right after (``reproduce`` refusing
    an unknown key) can then abort at exit ("terminate called without an active
    exception") after doing its work.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.ParquetFile(pa.BufferReader(data), pre_buffer=False).read(use_threads=False)


def read_parquet_rows(path: str) -> list[dict]:
    return parquet_table(storage.read_bytes(path)).to_pylist()


def read_slice_items(out: str, index: int) -> list[Item]:
    text = storage.read_text(naming.plan_slice(out, index))
    return [Item.from_json(json.loads(line)) for line in text.splitlines() if line.strip()]


def is_committed(out: str, index: int) -> bool:
    return storage.exists(naming.shard_stats(out, index))


def whole_objects(out: str, settings: Settings, index: int) -> list[str]:
    """The objects a slice writes whole at its commit, before its marker: its metadata shard,
    its thumbnail pack, and its tar or image parquet for the formats the run writes."""
    found = [naming.shard_metadata(out, index), naming.thumb_pack(out, index)]
    if "webdataset" in settings.formats:
        found.append(naming.shard_tar(out, index))
    if "parquet" in settings.formats:
        found.append(naming.image_parquet(out, index))
    return found


def leftovers(out: str, settings: Settings, index: int) -> list[str]:
    """Objects an uncommitted slice already has, from an attempt that died (zarr shards aside)."""
    found = sorted(storage.files(naming.images_dir(out, index), "*")) if "files" in settings.formats else []
    return found + [path for path in whole_objects(out, settings, index) if storage.exists(path)]


def image_location(settings: Settings, item: Item, zarr_group: str = "", zarr_offset: int = 0) -> str:
    """Where a reader finds the image, relative to OUT: its file, tar member, parquet row or
    zarr index (in a run of several sizes, the index in its size's group ``zarr_group``,
    whose first image is at position ``zarr_offset``)."""
    name, ext = naming.output_name(item.slice), formats.extension(settings.image_format)
    chosen = settings.formats
    if "files" in chosen:
        return naming.image_name(item.slice, item.key, ext)
    if "webdataset" in chosen:
        return f"shards/{name}.tar#{item.key}.{ext}"
    if "parquet" in chosen:
        return f"parquet/{name}.parquet#{item.key}"
    if zarr_group:
        return f"zarr/{zarr_group}/images#{item.position - zarr_offset}"
    return f"zarr/images#{item.position}"


MAX_PENDING = 64  # images handed to a host's writers and not yet stored


class SliceWriter:
    """Writes one slice's outputs in every chosen format, then commits it.

    Encoding and uploads run on a shared thread pool, off the device loop (JAX releases
    the GIL while the devices work). ``commit`` waits for them, re-raising the first
    failure, so a slice is never committed with an object missing; the commit marker
    is written last. At most ``max_pending`` images wait in the pool: ``add`` blocks
    beyond that (backpressure), so the host's memory stays bounded however slow the
    uploads are. Slices that overlap (one committing, the next being written) share one
    bound through ``slots``.
    """

    def __init__(self, out: str, run: Run, index: int, host: int, pool, *, zarr_images=None, zarr_latents=None,
                 max_pending: int = MAX_PENDING, slots: threading.Semaphore | None = None,
                 zarr_group: str = "", zarr_offset: int = 0):
        self.out, self.run, self.index, self.host, self.pool = out, run, index, host, pool
        self._slots = slots or threading.BoundedSemaphore(max_pending)  # ``slots``: shared by a host's slices
        self.formats = run.settings.formats
        self.image_format, self.quality = run.settings.image_format, run.settings.quality
        self.zarr_images, self.zarr_latents = zarr_images, zarr_latents
        # a run of several sizes: each size's zarr arrays are in its group, from position zarr_offset
        self.zarr_group, self.zarr_offset = zarr_group, zarr_offset
        self.filtered = bool(filters.active_rules(run.settings))  # a filter may keep an image out
        # with zarr, the slice's images (and latents) are one shard of each array: their writes
        # are held in one transaction, and the shard is written whole when the slice commits
        self._zarr = None
        if zarr_images is not None:
            import tensorstore as ts

            self._zarr = ts.Transaction()
            self.zarr_images = zarr_images.with_transaction(self._zarr)
            if zarr_latents is not None:
                self.zarr_latents = zarr_latents.with_transaction(self._zarr)
        self._pending = []
        self._rows: list[dict] | None = None  # set by ``finish``
        self._objects: dict[str, int] = {}  # the whole objects written by ``finish``: {name under OUT: bytes}

    def add(self, item: Item, image: np.ndarray, latents: np.ndarray | None = None, truncated: bool = False,
            scores: dict | None = None) -> None:
        """Queue one image (and, with ``zarr_latents``, its final latents) for writing;
        ``truncated``: its prompt was cut to the text encoder's length; ``scores``: its
        scores by column, which the run's filters read (``filters.dropped_reason``)."""
        if self.zarr_latents is not None and latents is None:
            raise ValueError(f"slice {self.index}: --save-latents, but no latents for {item.key}")
        if self.run.settings.scores and scores is None:  # a filter would read them: never guess
            raise ValueError(f"slice {self.index}: the run scores its images (--score "
                             f"{','.join(self.run.settings.scores)}), but {item.key} came without scores")
        latents = None if self.zarr_latents is None else np.array(latents, np.float32, copy=True)
        self._slots.acquire()
        try:
            future = self.pool.submit(self._write_one, item, np.array(image, copy=True), latents, truncated, scores)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        self._pending.append(future)

    def _write_one(self, item: Item, image: np.ndarray, latents: np.ndarray | None = None,
                   truncated: bool = False, scores: dict | None = None) -> tuple[dict, bytes]:
        data = formats.encode(image, self.image_format, self.quality)
        dropped = filters.dropped_reason(self.run.settings, scores or {}) if self.filtered else None
        if dropped is not None:  # in no image output: its row alone says it was made, and why it is not there
            if "zarr" in self.formats:  # zeros, the fill value: the slice's shard is then written whole, unread
                self.zarr_images[item.position - self.zarr_offset].write(np.zeros_like(image)).result()
                if latents is not None:
                    self.zarr_latents[item.position - self.zarr_offset].write(np.zeros_like(latents)).result()
            return metadata_row(item, self.run, self.host, data, "", truncated=truncated, scores=scores,
                                dropped=dropped), None, None
        location = image_location(self.run.settings, item, self.zarr_group, self.zarr_offset)
        if "files" in self.formats:
            storage.write_bytes(naming.join(self.out, location), data)
        flagged = bool(scores and scores.get("nsfw"))
        thumb = formats.thumbnail(image, blur=flagged)  # packed with the slice's others by ``finish``
        if "zarr" in self.formats:
            self.zarr_images[item.position - self.zarr_offset].write(image).result()
        if latents is not None:
            self.zarr_latents[item.position - self.zarr_offset].write(latents).result()
        # the encoded bytes are kept for the slice's tar or image parquet only: with files
        # and zarr alone, a queued slice holds its rows, not its images
        keep = "webdataset" in self.formats or "parquet" in self.formats
        row = metadata_row(item, self.run, self.host, data, location, truncated=truncated, scores=scores)
        return row, data if keep else None, thumb

    def wait_images(self) -> None:
        """Block until every image added so far is stored (or one failed)."""
        for future in self._pending:
            future.result()

    def finish(self) -> list[dict]:
        """Wait for every image, then write the slice's whole objects; returns its rows.

        Re-raises the first failure of any worker, so a slice with a missing object
        never reaches ``mark``.
        """
        results = [future.result() for future in self._pending]
        rows = [r for r, _, _ in results]
        # a dropped image has no tar entry, image parquet row or thumbnail, only its metadata row
        kept = [(r, d, t) for r, d, t in results if r["dropped"] is None]
        kept_rows, encoded = [r for r, _, _ in kept], [d for _, d, _ in kept]
        thumbs = [(f"{r['key']}.jpg", t) for r, _, t in sorted(kept, key=lambda k: k[0]["position"])]
        # where each thumbnail is in the pack, for the commit marker: the gallery reads one, not the pack
        self._thumb_index = {name[:-len(".jpg")]: list(at)
                             for (name, _), at in zip(thumbs, formats.tar_offsets(thumbs))}
        objects = [(naming.shard_metadata(self.out, self.index), lambda: parquet_bytes(rows)),
                   (naming.thumb_pack(self.out, self.index), lambda: formats.tar_bytes(thumbs))]
        if "webdataset" in self.formats:
            ext = formats.extension(self.image_format)
            objects.append((naming.shard_tar(self.out, self.index),
                            lambda: formats.tar_bytes(formats.webdataset_members(kept_rows, encoded, ext))))
        if "parquet" in self.formats:
            objects.append((naming.image_parquet(self.out, self.index),
                            lambda: formats.image_parquet_bytes(kept_rows, encoded, metadata_schema())))
        if "zarr" in self.formats and self.filtered and rows:
            objects.append((None, lambda: self._write_dropped(rows)))
        if self._zarr is not None:  # the slice's shard of each zarr array, whole
            objects.append((None, lambda: self._zarr.commit_async().result()))
        for future in [self.pool.submit(lambda p=p, make=make: make() if p is None else self._store(p, make()))
                       for p, make in objects]:
            future.result()
        self._rows = rows
        return rows

    def _store(self, path: str, data: bytes) -> None:
        storage.write_bytes(path, data)
        self._objects[path[len(self.out.rstrip("/")) + 1:]] = len(data)

    def _write_dropped(self, rows: list[dict]) -> None:
        """The slice's part of ``OUT/zarr/dropped`` (its own chunk): which of its positions a
        filter kept out of ``OUT/zarr/images``."""
        size = self.run.settings.slice_size
        array = formats.open_zarr_dropped(self.out, self.zarr_images.shape[0], size, self.zarr_group)
        first = min(row["position"] for row in rows) - self.zarr_offset  # a slice's first position is its chunk's
        flags = np.zeros(min(size, array.shape[0] - first), bool)
        for row in rows:
            flags[row["position"] - self.zarr_offset - first] = row["dropped"] is not None
        array[first:first + len(flags)].write(flags).result()

    def mark(self, stats: dict) -> None:
        """Write the commit marker: the slice counts as done from here on. Once ``finish``
        has run, the marker also says how many thumbnails the slice holds (a dropped image
        has none)."""
        marker = stats if self._rows is None else {
            **stats, "thumbnails": sum(1 for row in self._rows if row["dropped"] is None),
            "thumbnail_index": self._thumb_index, "objects": dict(sorted(self._objects.items())),
            **({"dropped": sum(1 for row in self._rows if row["dropped"] is not None)} if self.filtered else {})}
        storage.write_json(naming.shard_stats(self.out, self.index), marker)

    def commit(self, stats: dict) -> list[dict]:
        rows = self.finish()
        self.mark(stats)
        return rows
