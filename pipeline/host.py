"""``generate``: the work of one host process.

The host joins the cluster, loads the model once, compiles the sampler once, and runs
its slice slots (``slicing.host_slots``). Every host runs the same number of device
steps: a padding slot, and the padding rows that fill the last slice, run on the
devices but are never written.
"""
from __future__ import annotations

import datetime as dt

from pipeline import cluster, logs, naming, slicing, storage, writer
from pipeline.generator import Batch, CompileCounter, Generator
from pipeline.records import Item


class GenerateError(RuntimeError):
    pass


def _batch(generator: Generator, items: list[Item | None], default_guidance: float) -> Batch:
    """Device inputs for a batch; ``None`` entries are padding rows (empty prompt, seed 0)."""
    real = [(i.prompt, i.negative_prompt, default_guidance if i.guidance_scale is None else i.guidance_scale,
             i.seed, i.image_index) if i is not None else ("", "", 0.0, 0, 0) for i in items]
    prompts, negatives, guidance, seeds, indices = zip(*real)
    return generator.batch(prompts, negatives, guidance, seeds, indices)


def load_run(out: str) -> tuple[dict, dict]:
    """(run.json, plan manifest) of a planned OUT."""
    for path in (naming.run_json(out), naming.manifest(out)):
        if not storage.exists(path):
            raise GenerateError(f"{path} does not exist: run 'promptmill plan' for this --out first")
    return storage.read_json(naming.run_json(out)), storage.read_json(naming.manifest(out))


def run_slice(generator: Generator, out: str, run: dict, index: int, size: int, host: int) -> dict:
    """Generate, write and commit one slice; returns its stats."""
    watch = logs.Stopwatch()
    items = writer.read_slice_items(out, index)
    padded = [*items, *[None] * (size - len(items))]
    default_guidance = run["settings"]["guidance_scale"]
    rows = []
    for start in range(0, size, generator.batch_size):
        chunk = padded[start:start + generator.batch_size]
        images = generator(_batch(generator, chunk, default_guidance))
        for item, image in zip(chunk, images):
            if item is not None:
                rows.append(writer.write_image(out, item, image, run, host))
    seconds = watch.seconds()
    return {"slice": index, "host": host, "images": len(rows), "padding": size - len(items),
            "seconds": round(seconds, 4), "images_per_s": round(len(rows) / seconds, 3) if seconds else None,
            "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "_rows": rows}


def generate(out: str, cluster_args: cluster.ClusterArgs, compile_cache: str | None = None) -> dict:
    """Run this host's share of the plan in ``out``; returns a summary.

    With ``compile_cache`` (a folder), compiled programs are loaded from JAX's persistent
    compilation cache there, or compiled and written to it (``pipeline.compile_cache``).
    """
    from pipeline import compile_cache as cache_lib
    from pipeline import model as model_lib

    if compile_cache:  # first: every program this host compiles should go through the cache
        cache_dir = cache_lib.enable(compile_cache)
    host, num_hosts = cluster.initialize(cluster_args)
    if compile_cache:
        logs.event("compile_cache", host=host, path=cache_dir)
    run, manifest = load_run(out)
    settings = run["settings"]
    logs.event("host_started", host=host, hosts=num_hosts, slices=manifest["slices"])
    model = model_lib.load(settings["model"], settings["dtype"], settings["scheduler"])
    if model.fingerprint != run["model_fingerprint"]:
        raise GenerateError(f"model {settings['model']!r} has fingerprint {model.fingerprint[:12]}, but the run "
                            f"was planned with {run['model_fingerprint'][:12]}")
    generator = Generator(model, settings["width"], settings["height"], settings["steps"],
                          settings["per_device_batch"])
    size = manifest["slice_size"]
    batches = slicing.batches_per_slice(size, len(generator.devices), settings["per_device_batch"])
    generator(_batch(generator, [None] * generator.batch_size, 0.0))  # warm-up: first execution
    compiles_at_warm = CompileCounter.count()
    cache_stats = ({"cache_hits": cache_lib.CacheEvents.hits(), "cache_writes": cache_lib.CacheEvents.writes()}
                   if compile_cache else {})
    logs.event("host_ready", host=host, devices=len(generator.devices), batches_per_slice=batches, **cache_stats)

    total_images = 0
    watch = logs.Stopwatch()
    for slot in slicing.host_slots(host, num_hosts, manifest["slices"]):
        if slot is None:  # padding slot: same device steps as a real slice, nothing written
            for _ in range(batches):
                generator(_batch(generator, [None] * generator.batch_size, 0.0))
            logs.event("padding_slot", host=host)
            continue
        stats = run_slice(generator, out, run, slot, size, host)
        rows = stats.pop("_rows")
        stats["compiles_after_warmup"] = CompileCounter.count() - compiles_at_warm
        writer.commit_slice(out, slot, rows, stats)
        total_images += stats["images"]
        logs.event("slice_committed", **stats)

    recompiles = CompileCounter.count() - compiles_at_warm
    if num_hosts > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("promptmill generate done")
    summary = {"host": host, "images": total_images, "seconds": round(watch.seconds(), 3),
               "compiles_after_warmup": recompiles}
    logs.event("host_done", **summary)
    return summary
