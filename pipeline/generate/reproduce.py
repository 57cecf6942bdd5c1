"""``reproduce``: regenerate images from their metadata rows and check their sha256.

The same program as the hosts: the run's settings from run.json, the model loaded and
checked as hosts load and check it (``runtime.ready_generator``: against the plan's file
table, or the fingerprint without one), and a Generator with the run's per-device batch on one
local device (an image's bytes depend on the per-device batch, not on the number of
devices). The keys fill device batches in the order given, and the last batch is filled
with padding rows as the host loop fills a slice's last batch: an image's bytes do not depend
on its position in the batch or on its neighbours.

A key's metadata row is found through the plan's key index (``pipeline.output.key_index``):
the bucket of a hash of the key gives its slice, and the slice's metadata shard (one slice
of rows) its row. So a look-up reads a few small objects whatever the size of the run, and
works before collect as after it.
"""
from __future__ import annotations

import hashlib
import json

from pipeline.core import naming
from pipeline.core.settings import Run
from pipeline.io import runs, storage
from pipeline.output import formats, key_index, writer


class ReproduceError(RuntimeError):
    pass


def find_rows(out: str, keys, reads: list | None = None) -> dict[str, dict]:
    """{key: its metadata row} for those of ``keys`` planned in ``out`` and committed;
    ReproduceError naming a key whose slice is not committed yet. ``reads``: a list that
    gets (path, bytes) of each object read."""
    def read(path: str) -> bytes:
        data = storage.read_bytes(path)
        if reads is not None:
            reads.append((path, len(data)))
        return data

    manifest_path = naming.manifest(out)
    if not storage.exists(manifest_path):
        raise ReproduceError(f"{manifest_path} does not exist: nothing was planned in {out}")
    buckets = key_index.bucket_count(json.loads(read(manifest_path))["images"])
    wanted: dict[int, set] = {}
    for key in keys:
        wanted.setdefault(key_index.bucket_of(key, buckets), set()).add(key)
    slices: dict[int, set] = {}
    for bucket, among in sorted(wanted.items()):
        for key, entry in key_index.find(naming.plan_keys(out, bucket), among, read).items():
            slices.setdefault(entry["slice"], set()).add(key)
    rows = {}
    for index, among in sorted(slices.items()):
        if not storage.exists(naming.shard_stats(out, index)):
            raise ReproduceError(f"{', '.join(sorted(among))}: slice {index} is not committed yet (generate it "
                                 f"first, or resume the run)")
        table = writer.parquet_table(read(naming.shard_metadata(out, index)))
        rows.update((row["key"], row) for row in table.to_pylist() if row["key"] in among)
    return rows


def lookup(out: str, keys: list[str]) -> tuple[Run, list[dict]]:
    """(the run, the metadata row of each key); raises naming every unknown key."""
    if not runs.exists(out):
        raise ReproduceError(f"{naming.run_json(out)} does not exist: is --out a promptmill output?")
    run = runs.read(out)
    rows = find_rows(out, keys)
    unknown = [k for k in keys if k not in rows]
    if unknown:
        raise ReproduceError(f"unknown key(s) in {out}: {', '.join(unknown)}")
    return run, [rows[k] for k in keys]


def reproduce(out: str, keys: list[str], save: str | None = None, emit=None) -> list[dict]:
    """Regenerate the images of ``keys``; returns one result per key:
    {"key", "sha256", "expected", "match"}. ``emit`` is called with each result as soon as
    it is known; ``save`` (a folder or gs:// prefix) receives each regenerated KEY.EXT."""
    run, rows = lookup(out, keys)  # before the model (and JAX): a bad key fails fast

    import jax

    from pipeline.generate import bucket_programs, runtime

    settings = run.settings
    # one device, or the FSDP group the run's weights were sharded over (an image's bytes
    # depend on that program, not on how many such groups a host has)
    if jax.local_device_count() < settings.fsdp:
        raise ReproduceError(f"the run shards its weights over {settings.fsdp} devices (--fsdp); this process has "
                             f"{jax.local_device_count()}")
    devices = jax.local_devices()[:settings.fsdp]
    found, model, generator = {}, None, None
    for bucket, chunk_rows in _by_size(settings, rows):  # each image at its own size, by that size's program
        sized = bucket_programs.bucket_run(run, bucket)
        if model is None:
            model, generator, _ = runtime.ready_generator(sized, out, devices)
        else:
            generator = runtime.make_generator(model, sized.settings, devices, params=generator.params)
        for start in range(0, len(chunk_rows), generator.batch_size):
            chunk = chunk_rows[start:start + generator.batch_size]
            images = generator(generator.batch_of([(r["prompt"], r["negative_prompt"], r["guidance_scale"],
                                                    r["seed"], r["image_index"]) for r in chunk]))
            for row, image in zip(chunk, images):
                found[row["key"]] = _check(row, image, settings.image_format, settings.quality, save, emit)
    return [found[row["key"]] for row in rows]


def _by_size(settings, rows: list[dict]) -> list[tuple[int, list[dict]]]:
    """(size index, the rows of that size) in the run's size order: an image is made again at
    the size its metadata row says (one size, index 0, in a single-size run)."""
    if not settings.sizes:
        return [(0, rows)]
    groups: dict[int, list[dict]] = {}
    for row in rows:
        name = f"{row['width']}x{row['height']}"
        if name not in settings.sizes:
            raise ReproduceError(f"{row['key']} is {name}, which is not one of the run's sizes "
                                 f"({', '.join(settings.sizes)})")
        groups.setdefault(settings.sizes.index(name), []).append(row)
    return sorted(groups.items())


def _check(row: dict, image, image_format: str, quality: int, save: str | None, emit) -> dict:
    data = formats.encode(image, image_format, quality)
    digest = hashlib.sha256(data).hexdigest()
    if save:
        storage.write_bytes(naming.join(save, f"{row['key']}.{formats.extension(image_format)}"), data)
    result = {"key": row["key"], "sha256": digest, "expected": row["sha256"], "match": digest == row["sha256"]}
    if emit is not None:
        emit(result)
    return result
