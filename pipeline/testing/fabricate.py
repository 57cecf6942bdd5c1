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

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipeline import __version__
from pipeline.core import naming, records
from pipeline.core.settings import Run, Settings
from pipeline.io import runs, storage
from pipeline.output import formats, key_index, writer
from pipeline.plan import input_table

CREATED_AT = "2026-01-01T00:00:00+00:00"


def settings_of(out: str, prompts: str, slice_size: int, chosen=("files",), size: int = 8, **changes) -> Settings:
    """A resolved tiny run's settings: ``slice_size`` images a slice (one device, one image a batch)."""
    return Settings(prompts=prompts, out=out, model="tiny", width=size, height=size, steps=2, scheduler="ddim",
                    guidance_scale=7.5, guided=True, per_device_batch=1, batches_per_slice=slice_size,
                    devices_per_host=1, decode_batch=1, formats=tuple(chosen), **changes).validate()


def pixels(position: int, size: int) -> np.ndarray:
    """The image at ``position``: a flat colour that tells positions apart (pure)."""
    return np.full((size, size, 3), [position % 251, (position // 251) % 251, 7], np.uint8)


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
    lines = [json.dumps({"id": f"r{n:07d}", "prompt": f"prompt number {n}", "seed": n,
                         "num_images": min(per_record, images - n * per_record)}) for n in range(records_count)]
    storage.write_text(prompts, "\n".join(lines) + "\n")
    settings = settings_of(out, prompts, slice_size, chosen, **changes)
    scorers = {name: "fabricated" for name in ("clip", "aesthetic", "safety")
               if {"clip": {"clip", "aesthetic"}, "aesthetic": {"aesthetic"}, "safety": {"safety"}}[name]
               & set(settings.scores)}
    run = Run.create(settings, "fabricated", CREATED_AT, {"promptmill": __version__}, scorers=scorers)
    input_table.record(out, prompts)
    runs.write(out, run)
    slices = -(-images // slice_size)
    manifest = {"slice_size": slice_size, "slices": slices, "records": records_count, "images": images,
                "rejects": 0, "rejects_by_reason": {}, "input_rows": records_count, "input_files": 1}
    items = [item for n in range(records_count)
             for item in records.expand(records.Record(id=f"r{n:07d}", prompt=f"prompt number {n}",
                                                       negative_prompt="", seed=n, num_images=min(
                                                           per_record, images - n * per_record),
                                                       guidance_scale=None, source=prompts, line=n + 1),
                                        n * per_record, slice_size)]
    _write_plan(out, items, slices, slice_size, images)
    storage.write_json(naming.manifest(out), manifest)
    _write_slices(out, run, items, slices, slice_size, hosts, image_scores)
    return manifest


def _write_plan(out: str, items: list, slices: int, slice_size: int, images: int) -> None:
    buckets = key_index.bucket_count(images)
    pieces: dict[int, list] = {}
    for index in range(slices):
        chunk = items[index * slice_size:(index + 1) * slice_size]
        storage.write_bytes(naming.plan_slice(out, index), b"".join(
            (json.dumps(i.to_json(), ensure_ascii=False, sort_keys=True) + "\n").encode() for i in chunk))
        columns = {"key": [i.key for i in chunk], "slice": [index] * len(chunk), "position": [i.position for i in chunk]}
        for bucket, piece in key_index.split(columns, buckets):
            pieces.setdefault(bucket, []).append(piece)
    for bucket, found in pieces.items():
        storage.write_bytes(naming.plan_keys(out, bucket), key_index.bucket_bytes(found))


def _write_slices(out: str, run: Run, items: list, slices: int, slice_size: int, hosts: int,
                  scores: dict | None) -> None:
    settings = run.settings
    zarr = formats.open_zarr_images(out, len(items), settings.height, settings.width, per_shard=slice_size) \
        if "zarr" in settings.formats else None
    with ThreadPoolExecutor(8, thread_name_prefix="fabricate") as pool:
        for index in range(slices):
            started = time.time()
            chunk = items[index * slice_size:(index + 1) * slice_size]
            slice_writer = writer.SliceWriter(out, run, index, index % hosts, pool, zarr)
            for item in chunk:
                slice_writer.add(item, pixels(item.position, settings.width), scores=dict(scores) if scores else None)
            slice_writer.commit({"slice": index, "host": index % hosts, "images": len(chunk),
                                 "padding": slice_size - len(chunk), "seconds": 1.0, "images_per_s": len(chunk),
                                 "input_s": 0.1, "device_wait_s": 0.1, "output_s": 0.1, "device_busy_s": 0.5,
                                 "commit_s": 0.0, "compiles_after_warmup": 0, "truncated_prompts": 0,
                                 "started_ts": round(started, 3), "committed_ts": round(started + 1.0, 3)})
