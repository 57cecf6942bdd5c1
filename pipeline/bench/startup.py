"""Time from nothing to a ready generator, measured in a fresh process.

A host's start-up (import, load the model while the sampler compiles, transfer, first
batch) is paid by every host of every run and every restart; the persistent compilation
cache and the per-host executable cache exist to cut it. Only
a fresh process measures it honestly, because JAX keeps compiled programs in memory.
So ``probe`` starts ``python -m pipeline.bench.startup`` and reads back the one JSON object
it writes on stdout::

    python -m pipeline.bench.startup --model tiny --width 32 --height 32 --steps 2 \\
        --per-device-batch 1 --compile-cache /tmp/cc
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_T0 = time.perf_counter()  # as early as this module can see: before jax is imported


def ready(model: str, width: int, height: int, steps: int, per_device_batch: int, *, dtype: str = "fp32",
          devices: int | None = None, compile_cache: str | None = None) -> dict:
    """Get a Generator ready as a host does (``runtime.ready_generator``, for a run of these
    settings) and run its first batch; returns the seconds of each part.

    Parts, in order: ``import`` (jax, flax, promptmill), then ``load`` (the
    weights read, or memory-mapped once converted on this machine, and the files checked
    against the checkpoint's file table as a host checks them against its plan's) and
    ``transfer`` (the weights onto the devices) while, on a thread, ``compile`` (the
    sampler found through the executable cache's index, else lowered from the configs'
    shapes and compiled or loaded); ``wait`` (for the compile once the weights were on the
    devices). ``ready``: the time to ready, from the start of this module to a generator
    that can run its first batch; ``first_batch`` after it. The file table itself is the
    plan's work and is left out (``table_s``)."""
    import tempfile

    import jax

    from pipeline.generate import compile_cache as cache_lib

    if compile_cache:
        cache_lib.enable(compile_cache)
    from pipeline.core import naming
    from pipeline.core.settings import Run, Settings
    from pipeline.core.decode_batch import DECODE_BATCH
    from pipeline.generate import jax_events, runtime
    from pipeline.io import storage
    from pipeline.model.loading import identity
    from pipeline.model import load as model_load

    cache = jax_events.CACHE.install()
    imported = time.perf_counter()
    local = jax.local_devices()[:devices] if devices else jax.local_devices()
    settings = Settings(model=model, width=width, height=height, steps=steps, per_device_batch=per_device_batch,
                        dtype=dtype, guided=True, decode_batch=DECODE_BATCH)  # as planning resolves auto
    run = Run.create(settings, "", "", {})
    with tempfile.TemporaryDirectory() as out:  # the plan's file table, as a host finds it
        table_started = time.perf_counter()
        storage.write_json(naming.model_files(out), {"files": identity.file_table(model_load.resolve(model))})
        table_s = time.perf_counter() - table_started
        hits_before = cache.count(jax_events.CACHE_HIT) + cache_lib.EXECUTABLE_COUNTS["hits"]
        _, generator, parts = runtime.ready_generator(run, out, local)
    built = time.perf_counter()
    build_hits = cache.count(jax_events.CACHE_HIT) + cache_lib.EXECUTABLE_COUNTS["hits"] - hits_before
    generator.warm_up()  # the first execution: the generator is ready after it
    done = time.perf_counter()
    return {"import_s": round(imported - _T0, 3), **{f"{k}_s": round(v, 3) for k, v in parts.items()},
            "ready_s": round(built - _T0 - table_s, 3), "first_batch_s": round(done - built, 3),
            "in_process_s": round(done - _T0, 3), "table_s": round(table_s, 3), "devices": len(generator.devices),
            "sampler_from_cache": generator.from_cache, "sampler_lowered": generator.sampler_lowered,
            "sampler_compiles": generator.sampler_compiles, "program_reused": generator.program_given,
            "cache_hits": cache.count(jax_events.CACHE_HIT) + cache_lib.EXECUTABLE_COUNTS["hits"],
            "cache_writes": cache.count(jax_events.CACHE_WRITE) + cache_lib.EXECUTABLE_COUNTS["writes"],
            "build_cache_hits": build_hits}


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this source tree


def probe(model: str, width: int, height: int, steps: int, per_device_batch: int, *, dtype: str = "fp32",
          devices: int | None = None, compile_cache: str | None = None, env: dict | None = None,
          timeout: float = 1800, root: str | None = None) -> dict:
    """Run ``ready`` in a fresh Python process; adds ``total_s``, the wall time seen from here.
    ``root``: the promptmill source tree the process imports (default: this one), e.g. a
    checkout of an earlier commit whose start-up is compared with this one's."""
    command = [sys.executable, "-m", "pipeline.bench.startup", "--model", model, "--width", str(width), "--height",
               str(height), "--steps", str(steps), "--per-device-batch", str(per_device_batch), "--dtype", dtype]
    if devices:
        command += ["--devices", str(devices)]
    if compile_cache:
        command += ["--compile-cache", compile_cache]
    root = root or ROOT  # ``-m`` puts the working folder first on the import path
    start = time.perf_counter()
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    total = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"start-up probe failed ({result.returncode}): {result.stderr[-2000:]}")
    return {"total_s": round(total, 3), **json.loads(result.stdout.strip().splitlines()[-1])}


def cold_and_warm(model: str, width: int, height: int, steps: int, per_device_batch: int, *, dtype: str = "fp32",
                  devices: int | None = None, roots: tuple[str | None, ...] = (None,)) -> list[dict]:
    """Cold then warm start of a fresh process importing each source tree of ``roots``
    (None: this one), in turns: the cold start of each, then the warm start of each.

    Each tree gets a promptmill cache folder of its own (``PROMPTMILL_CACHE``: converted
    weights, file digests) and a compile cache of its own, empty for the cold start, as on
    a machine that never ran the model; the warm start finds what the cold one left. The
    checkpoints are this machine's (the cache's ``models``, linked), each tree's built-in
    models made before anything is timed. Returns per root {"cold", "warm",
    "cache_entries"}; the folders are removed."""
    import shutil
    import tempfile

    from pipeline.generate import compile_cache
    from pipeline.model.loading.cache import cache_dir

    models = os.path.join(cache_dir(), "models")
    os.makedirs(models, exist_ok=True)
    folders = [tempfile.mkdtemp(prefix="promptmill-bench-startup-") for _ in roots]
    try:
        envs = []
        for folder, root in zip(folders, roots):
            os.symlink(models, os.path.join(folder, "models"))
            env = {**os.environ, "PROMPTMILL_CACHE": folder}
            subprocess.run([sys.executable, "-c", f"from pipeline.model import load; load.resolve({model!r})"],
                           cwd=root or ROOT, env=env, check=True, capture_output=True, timeout=1800)
            envs.append(env)
        args = (model, width, height, steps, per_device_batch)
        runs = [{"cold": probe(*args, dtype=dtype, devices=devices, compile_cache=os.path.join(folder, "compile"),
                               env=env, root=root)}
                for folder, root, env in zip(folders, roots, envs)]
        for run, folder, root, env in zip(runs, folders, roots, envs):
            run["cache_entries"] = compile_cache.entries(os.path.join(folder, "compile"))
            run["warm"] = probe(*args, dtype=dtype, devices=devices, compile_cache=os.path.join(folder, "compile"),
                                env=env, root=root)
        return runs
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--height", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--per-device-batch", type=int, required=True)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--devices", type=int, help="use the first N local devices (default: all)")
    parser.add_argument("--compile-cache", help="persistent compilation cache folder")
    args = parser.parse_args(argv)
    timings = ready(args.model, args.width, args.height, args.steps, args.per_device_batch, dtype=args.dtype,
                    devices=args.devices, compile_cache=args.compile_cache)
    sys.stdout.write(json.dumps(timings) + "\n")  # the probe's result, read by ``probe``
    return 0


if __name__ == "__main__":
    sys.exit(main())
