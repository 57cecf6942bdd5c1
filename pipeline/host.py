"""``generate``: the work of one host process.

The host joins the cluster, loads the model once, compiles the sampler once, and runs
its slice slots (``slicing.host_slots``). Every host runs the same number of device
steps: a padding slot, and the padding rows that fill the last slice, run on the
devices but are never written.
"""
from __future__ import annotations

import datetime as dt
from concurrent.futures import ThreadPoolExecutor

from pipeline import cluster, crashpoints, logs, naming, slicing, storage, writer
from pipeline.generator import Batch, CompileCounter, Generator
from pipeline.records import Item


WRITER_THREADS = 8  # encoders and uploaders; JAX releases the GIL while devices work


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


def run_slice(generator: Generator, out: str, run: dict, index: int, size: int, host: int, pool,
              zarr_images=None, compiles_at_warm: int = 0, zarr_latents=None) -> dict:
    """Generate one slice, write it in every chosen format and commit it; returns its stats.

    Encoding and uploads go to ``pool`` while the devices work on the next batch; the
    slice's time includes waiting for them.
    """
    watch = logs.Stopwatch()
    items = writer.read_slice_items(out, index)
    padded = [*items, *[None] * (size - len(items))]
    default_guidance = run["settings"]["guidance_scale"]
    slice_writer = writer.SliceWriter(out, run, index, host, pool, zarr_images, zarr_latents)
    timing = {"input_s": 0.0, "device_wait_s": 0.0, "output_s": 0.0}
    truncated_prompts = 0  # images whose prompt was cut to the text encoder's length

    def hand_over(chunk, cut, out):  # the previous batch's results, to the writer's pool
        nonlocal truncated_prompts
        clock = logs.Stopwatch()
        images, latents = generator.fetch(out)
        timing["device_wait_s"] += clock.seconds()
        clock = logs.Stopwatch()
        for n, (item, image) in enumerate(zip(chunk, images)):
            if item is not None:
                truncated_prompts += cut[n]
                slice_writer.add(item, image, None if latents is None else latents[n], cut[n])
        timing["output_s"] += clock.seconds()

    # The next batch is tokenised and dispatched before the current one is fetched, so
    # the devices always have a step queued while the host copies, encodes and uploads.
    previous = None
    for start in range(0, size, generator.batch_size):
        chunk = padded[start:start + generator.batch_size]
        clock = logs.Stopwatch()
        batch = _batch(generator, chunk, default_guidance)
        cut = generator.truncated([item.prompt if item is not None else "" for item in chunk])
        timing["input_s"] += clock.seconds()
        dispatched = (chunk, cut, generator.dispatch(batch))
        if previous is not None:
            hand_over(*previous)
            if start == generator.batch_size:
                crashpoints.reached("mid_slice", host, before=slice_writer.wait_images)
        previous = dispatched
    hand_over(*previous)
    if size == generator.batch_size:
        crashpoints.reached("mid_slice", host, before=slice_writer.wait_images)
    compiles = CompileCounter.count() - compiles_at_warm
    clock = logs.Stopwatch()
    slice_writer.finish()
    timing["output_s"] += clock.seconds()
    seconds = watch.seconds()
    stats = {"slice": index, "host": host, "images": len(items), "padding": size - len(items),
             "seconds": round(seconds, 4), "images_per_s": round(len(items) / seconds, 3) if seconds else None,
             **{name: round(value, 4) for name, value in timing.items()},
             "compiles_after_warmup": compiles, "truncated_prompts": truncated_prompts,
             "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    slice_writer.mark(stats)
    return stats


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
                          settings["per_device_batch"], latents=settings.get("save_latents", False))
    size = manifest["slice_size"]
    batches = slicing.batches_per_slice(size, len(generator.devices), settings["per_device_batch"])
    generator(_batch(generator, [None] * generator.batch_size, 0.0))  # warm-up: first execution
    compiles_at_warm = CompileCounter.count()
    cache_stats = ({"cache_hits": cache_lib.CacheEvents.hits(), "cache_writes": cache_lib.CacheEvents.writes()}
                   if compile_cache else {})
    logs.event("host_ready", host=host, devices=len(generator.devices), batches_per_slice=batches, **cache_stats)
    if compile_cache:
        uploaded = cache_lib.push()
        if uploaded:
            logs.event("compile_cache_pushed", host=host, entries=uploaded)
    crashpoints.reached("ready", host)

    zarr_images = zarr_latents = None
    if "zarr" in settings.get("formats", ()):
        from pipeline import formats

        zarr_images = formats.open_zarr_images(out, manifest["images"], settings["height"], settings["width"])
        if settings.get("save_latents", False):
            zarr_latents = formats.open_zarr_latents(out, manifest["images"],
                                                     model.latent_shape(settings["width"], settings["height"]),
                                                     model.vae.config.scaling_factor)
    total_images, skipped, generated, redone = 0, 0, 0, 0
    watch = logs.Stopwatch()
    with ThreadPoolExecutor(max_workers=WRITER_THREADS, thread_name_prefix="writer") as pool:
        for slot in slicing.host_slots(host, num_hosts, manifest["slices"]):
            if slot is None:  # padding slot: same device steps as a real slice, nothing written
                for _ in range(batches):
                    generator(_batch(generator, [None] * generator.batch_size, 0.0))
                logs.event("padding_slot", host=host)
                continue
            if writer.is_committed(out, slot):  # resume: a committed slice is never redone
                skipped += 1
                logs.event("slice_skipped", host=host, slice=slot)
                continue
            leftovers = writer.leftovers(out, settings, slot)
            if leftovers:  # an earlier attempt died mid-slice: its objects are rewritten with the same bytes
                redone += 1
                logs.event("slice_redone", host=host, slice=slot, leftover_objects=len(leftovers))
            stats = run_slice(generator, out, run, slot, size, host, pool, zarr_images, compiles_at_warm,
                              zarr_latents)
            total_images += stats["images"]
            generated += 1
            logs.event("slice_committed", **stats)
            crashpoints.reached("committed", host)

    recompiles = CompileCounter.count() - compiles_at_warm
    # host 0 runs the coordination service: every host waits here until all are done
    cluster.wait_for_all("promptmill-generate-done")
    summary = {"host": host, "images": total_images, "seconds": round(watch.seconds(), 3),
               "slices_generated": generated, "slices_redone": redone, "slices_skipped": skipped,
               "compiles_after_warmup": recompiles}
    logs.event("host_done", **summary)
    return summary
