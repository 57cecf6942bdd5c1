"""A committed run made without a model: what collect, ``reproduce``'s look-up and
``status`` read, at any size, in seconds per hundred thousand images.

``fabricate`` writes a prompts file, the plan (run.json, the input table, the manifest,
every slice and the plan's key index) and then each slice's outputs through the hosts'
own writer (``writer.SliceWriter``: images, thumbnail packs, metadata shards, tars, image
parquet, zarr shards, commit markers), as ``hosts`` hosts would, slice ``i`` on host
``i % hosts``. Its images are small and deterministic (each a flat colour from its
position), so the same call writes the same bytes. Only the model is missing: such a run
cannot be reproduced, only looked up.
"""
from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipeline import __version__
from pipeline.core import naming, records
from pipeline.core.settings import Run, Settings
from pipeline.generate import environment
from pipeline.io import runs, storage
from pipeline.output import formats, key_index, writer
from pipeline.plan import input_table

HOSTS_PLATFORM = "cpu/cpu"  # the platform the fabricated slices say they were made on

CREATED_AT = "2026-01-01T00:00:00+00:00"


def settings_of(out: str, prompts: str, slice_size: int, chosen=("files",), size: int = 8, **changes) -> Settings:
    """A resolved tiny run's settings: ``slice_size`` images a slice (one device, one image a batch)."""
    return Settings(prompts=prompts, out=out, model="tiny", width=size, height=size, steps=2, scheduler="ddim",
                    guidance_scale=7.5, guided=True, per_device_batch=1, batches_per_slice=slice_size,
                    devices_per_host=1, decode_batch=1, formats=tuple(chosen), **changes).validate()


def pixels(position: int, size: int) -> np.ndarray:
    """The image at ``position``: a flat colour that tells positions apart (pure)."""
    return np.full((size, size, 3), [position % 251, (position // 251) % 251, 7], np.uint8)


def item(position: int, slice_size: int, per_record: int, source: str) -> records.Item:
    """The planned item at ``position`` (record ``position // per_record``, as ``records.expand``
    places it) (pure)."""
    n, index = divmod(position, per_record)
    record_id = f"r{n:07d}"
    return records.Item(key=naming.output_key(record_id, index), id=record_id, image_index=index,
                        prompt=f"prompt number {n}", negative_prompt="", seed=n, guidance_scale=None, source=source,
                        line=n + 1, position=position, slice=position // slice_size)


def fabricate(out: str, images: int, slice_size: int = 8, hosts: int = 2, chosen=("files",), per_record: int = 1,
              *, prompts: str | None = None, image_scores: dict | None = None, **changes) -> dict:
    """Write a committed run of ``images`` images into ``out``; returns its manifest.

    ``per_record``: images per record; ``prompts``: where the prompts file goes (default
    beside ``out``); ``image_scores``: {score column: value} given to every image (with the
    settings' ``scores``, whose filters then keep images out or not); ``changes``: other
    settings (``scores``, ``min_clip_similarity``, ``clip_model``, ...).
    """
    prompts = prompts or out.rstrip("/") + "-prompts.jsonl"
    records_count = -(-images // per_record)
    with storage.local_writer(prompts) if not storage.is_gcs(prompts) else _Buffer(prompts) as f:
        for n in range(records_count):
            f.write((json.dumps({"id": f"r{n:07d}", "prompt": f"prompt number {n}", "seed": n,
                                 "num_images": min(per_record, images - n * per_record)}) + "\n").encode())
    settings = settings_of(out, prompts, slice_size, chosen, **changes)
    scorers = {name: "fabricated" for name in ("clip", "aesthetic", "safety")
               if {"clip": {"clip", "aesthetic"}, "aesthetic": {"aesthetic"}, "safety": {"safety"}}[name]
               & set(settings.scores)}
    run = Run.create(settings, "fabricated", CREATED_AT, {"promptmill": __version__}, scorers=scorers)
    input_table.record(out, prompts)
    runs.write(out, run)
    # made "in" this process's environment, as hosts record theirs, and every row carries it
    run = dataclasses.replace(run, environment=environment.establish(out, environment.current(HOSTS_PLATFORM),
                                                                     "the fabricator"))
    slices = -(-images // slice_size)
    manifest = {"slice_size": slice_size, "slices": slices, "records": records_count, "images": images,
                "rejects": 0, "rejects_by_reason": {}, "input_rows": records_count, "input_files": 1}

    def chunk(index: int) -> list[records.Item]:
        return [item(p, slice_size, per_record, prompts) for p in range(index * slice_size,
                                                                         min(images, (index + 1) * slice_size))]

    _write_plan(out, chunk, slices, images)
    storage.write_json(naming.manifest(out), manifest)
    _write_slices(out, run, chunk, slices, images, hosts, scores=image_scores)
    return manifest


class _Buffer:
    """A gs:// prompts file, written whole when closed."""

    def __init__(self, path: str):
        self.path, self.parts = path, []

    def __enter__(self):
        return self

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def __exit__(self, *error):
        if error[0] is None:
            storage.write_bytes(self.path, b"".join(self.parts))


def _write_plan(out: str, chunk, slices: int, images: int) -> None:
    buckets = key_index.bucket_count(images)
    pieces: dict[int, list] = {}
    for index in range(slices):
        items = chunk(index)
        storage.write_bytes(naming.plan_slice(out, index), b"".join(
            (json.dumps(i.to_json(), ensure_ascii=False, sort_keys=True) + "\n").encode() for i in items))
        columns = {"key": [i.key for i in items], "slice": [index] * len(items),
                   "position": [i.position for i in items]}
        for bucket, piece in key_index.split(columns, buckets):
            pieces.setdefault(bucket, []).append(piece)
    for bucket, found in pieces.items():
        storage.write_bytes(naming.plan_keys(out, bucket), key_index.bucket_bytes(found))


def _write_slices(out: str, run: Run, chunk, slices: int, images: int, hosts: int, *, scores: dict | None) -> None:
    settings = run.settings
    size = settings.slice_size
    zarr = formats.open_zarr_images(out, images, settings.height, settings.width, per_shard=size) \
        if "zarr" in settings.formats else None
    with ThreadPoolExecutor(8, thread_name_prefix="fabricate") as pool:
        for index in range(slices):
            started = time.time()
            items = chunk(index)
            slice_writer = writer.SliceWriter(out, run, index, index % hosts, pool, zarr_images=zarr)
            for one in items:
                slice_writer.add(one, pixels(one.position, settings.width), scores=dict(scores) if scores else None)
            slice_writer.commit({"slice": index, "host": index % hosts, "images": len(items),
                                 "padding": size - len(items), "seconds": 1.0, "images_per_s": len(items),
                                 "input_s": 0.1, "device_wait_s": 0.1, "output_s": 0.1, "device_busy_s": 0.5,
                                 "commit_s": 0.0, "compiles_after_warmup": 0, "truncated_prompts": 0,
                                 "started_ts": round(started, 3), "committed_ts": round(started + 1.0, 3)})
