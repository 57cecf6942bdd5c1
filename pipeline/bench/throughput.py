"""``promptmill bench generator``: how fast the Generator is, and against what.

For one model, resolution, step count and dtype, and for each per-device batch size of
a sweep, the report gives:

1. images/s of ``pipeline.generate.generator.Generator``: built, warmed up with one batch, then
   ``--batches`` batches made by ``Generator.batch`` (tokenising included) and waited
   for on the host (the images come back as numpy arrays);
2. the compiled program's device memory from XLA's ``memory_analysis()`` (temp,
   arguments, outputs; ``pipeline.bench.memory``), and its temp per image;
   FLOPs per image from XLA's cost analysis, counted by parts because XLA counts the
   denoising loop's body once (``pipeline.bench.flops``), and the FLOP/s this achieves;
3. the devices' measured matmul peak in the run's dtype, and utilisation =
   achieved / peak;
4. the seed notebook's recipe on the same model, devices and batch
   (``pipeline.bench.baseline``, diffusers' FlaxStableDiffusionPipeline: only with the
   ``notebook`` extra installed, and only when ``--parts`` asks for the sweep), warmed up
   and timed the same way, batch by batch in turns with ours, and our/seed throughput;
5. start-up, cold and warm: a fresh process from nothing to a generator that has run
   its first batch, first with an empty compile cache and then with the cache that the
   first one filled (``pipeline.bench.startup``), side by side: the time to ready
   (before the first batch) broken into import, weights loaded (converted on the cold
   start, memory-mapped on the warm one; the sampler compiled, or found in the
   executable cache, beside them), transfer, and the first batch apart;
6. scoring overhead (part ``scoring``): the generator with and without ``--score
   clip,aesthetic,safety`` (``pipeline.generate.scoring``, with the ViT-L/14-sized random
   scorers of ``SCORERS``, ``--scorers``) side by side, timed batch by batch in turns, at ``--steps`` with
   guidance (``cfg``) and for the 1-step guidance-free recipe (``one_step``); the
   overhead is 1 - scored images/s / plain images/s. Beside it, the FLOPs per image of
   the scoring program (XLA's cost analysis: it has no loop) against the sampler's, at the
   run's size and at 512x512 with 20 steps (from shapes, nothing run);
7. recipes, side by side at the first per-device batch, timed batch by batch in turns:
   classifier-free guidance (``cfg``) and guidance-free (``guidance_free``) at
   ``--steps`` with the chosen sampler, the few-step guidance-free recipe
   (``few_step``: 4 steps, the chosen sampler and spacing) and promptmill's default
   (``default``: 20 steps, CFG, the checkpoint's own sampler), with FLOPs by parts and
   the ratios guidance_free/cfg and few_step/default. The recipes share one replicated
   copy of the weights.

``--guidance-scale``, ``--scheduler`` and ``--timestep-spacing`` set the recipe of the
sweep (the sampler program is guided when the guidance is > 1, as in a run); the seed
recipe always runs CFG at its default sampler, as the notebook does.

Both pipelines are in memory together during the sweep (two copies of the weights
each: loaded and replicated), 16 GB for SD 1.5 in fp32 on one device.

This module runs the sweep, start-up, ``fsdp`` and ``models`` parts and composes the
report; the other parts are modules of their own (``recipes``, ``attention`` with
``memory``, ``scoring_overhead``, ``flops``), all reading one ``BenchConfig``
(``throughput_config``), and ``throughput_table`` prints the report.

Everything runs on whatever devices JAX finds (``--devices N``: the first N), CPU or
accelerator alike. The CPU run of docs/benchmarks.md was::

    promptmill bench generator --model random-sd15 --width 128 --height 128 --steps 2 \\
        --per-device-batch 1,2 --batches 3 --report /tmp/benchrun/report2.json
"""
from __future__ import annotations

import dataclasses
import gc
import json

from pipeline.bench.machine import machine
from pipeline.bench.programs import Programs
from pipeline.bench.recipes import run_recipes
from pipeline.bench.scoring_overhead import run_scoring
from pipeline.bench.throughput_config import BenchConfig, command_line
from pipeline.core import logs


def run_sweep(model, recipe, config: BenchConfig, devices, *, width: int, height: int, peak: float,
              programs: Programs | None = None) -> list[dict]:
    """One row per per-device batch size: ours and the seed recipe, and the FLOPs.

    The two are timed batch by batch in turns, not one after the other: on a shared
    machine the speed drifts by 10-20% over minutes, and turns spread that drift
    evenly over both. ``programs``: the bench run's compiled samplers (``Programs``).
    """
    from pipeline.bench import flops, memory
    from pipeline.bench.timing import in_turns, ours_call, seed_call

    programs = programs or Programs(config.decode_batch)
    rows = []
    for per_device_batch in config.per_device_batches:
        watch = logs.Stopwatch()
        generator = programs.generator(model, width, height, config.steps, per_device_batch, devices,
                                       guided=config.guided)
        build = watch.seconds()
        counted = flops.sampler_flops(model, width, height, config.steps, per_device_batch,
                                      compiled=generator.compiled, guided=config.guided)
        ours = ours_call(generator, config.guidance_scale)
        seed = seed_call(recipe, generator.batch_size, config.steps, width, height)  # compiles in its warm-up
        timings = in_turns({"ours": ours, "seed": seed}, {"ours": generator.batch_size,
                                                          "seed": generator.batch_size}, config.batches)
        ours_t, seed_t = timings["ours"], timings["seed"]
        achieved = counted["per_image"] * ours_t["images_per_s"]
        seed_achieved = counted["per_image"] * seed_t["images_per_s"]  # the same network work per image
        program = memory.program_memory(generator.compiled)  # one device's program
        rows.append({"per_device_batch": per_device_batch, "batch_size": generator.batch_size,
                     "memory": program, "temp_per_image": program.get("temp", 0) / per_device_batch,
                     "build_s": round(build, 3), "ours": ours_t, "seed": seed_t, "flops": counted,
                     "achieved_flops_per_s": achieved, "utilisation": achieved / peak,
                     "seed_achieved_flops_per_s": seed_achieved, "seed_utilisation": seed_achieved / peak,
                     "ours_over_seed": ours_t["images_per_s"] / seed_t["images_per_s"]})
        logs.event("bench_batch_size", per_device_batch=per_device_batch,
                   ours_images_per_s=round(ours_t["images_per_s"], 4),
                   seed_images_per_s=round(seed_t["images_per_s"], 4),
                   ours_over_seed=round(rows[-1]["ours_over_seed"], 3), utilisation=round(achieved / peak, 4))
        del generator, ours
        gc.collect()
    return rows


def run_startup(config: BenchConfig, width: int, height: int, per_device_batch: int) -> dict:
    """Cold and warm start of a fresh process (``startup.cold_and_warm``: cold as on a
    machine that never ran the model, warm with what the cold one left); with
    ``--startup-against DIR``, that source tree's too, in turns with this one's."""
    from pipeline.bench import startup

    roots = (None, config.startup_against) if config.startup_against else (None,)
    runs = startup.cold_and_warm(config.model, width, height, config.steps, per_device_batch, dtype=config.dtype,
                                 devices=config.devices, roots=roots)
    cold, warm = runs[0]["cold"], runs[0]["warm"]
    result = {"per_device_batch": per_device_batch, "cache_entries": runs[0]["cache_entries"], "cold": cold,
              "warm": warm, "cold_over_warm": cold["total_s"] / warm["total_s"],
              # the time to ready (before the first batch), warm over cold: what a cache buys a host
              "ready_warm_over_cold": warm["ready_s"] / cold["ready_s"]}
    if config.startup_against:
        other = runs[1]
        result["against"] = {"root": config.startup_against, **other,
                             # this tree's time over the other's, for each start: below 1 is faster
                             "over_against": {f"{side}_{key}": round(runs[0][side][key] / other[side][key], 3)
                                              for side in ("cold", "warm") for key in ("ready_s", "total_s")}}
    logs.event("bench_startup", cold_s=cold["total_s"], warm_s=warm["total_s"], ready_cold_s=cold["ready_s"],
               ready_warm_s=warm["ready_s"], ratio=round(result["cold_over_warm"], 3))
    return result


def run_fsdp(model, config: BenchConfig, devices, width: int, height: int) -> dict:
    """Images/s of the generator at each of ``config.fsdps`` (the weights sharded over groups
    of N devices, ``--fsdp N``), at the first per-device batch, timed batch by batch in
    turns; with each program's argument bytes per device (its share of the weights)."""
    from pipeline.bench.timing import in_turns, ours_call
    from pipeline.generate.fit import program_memory
    from pipeline.generate.generator import Generator
    from pipeline.generate.spec import ProgramSpec

    per_device_batch = config.per_device_batches[0]
    spec = ProgramSpec(width, height, config.steps, per_device_batch, model.family.guidance_rule(model),
                       model.family.classifier_free(model) and config.guided, decode_batch=config.decode_batch)
    generators = {fsdp: Generator(model, spec.at(fsdp=fsdp), devices)
                  for fsdp in config.fsdps}
    timings = in_turns({str(n): ours_call(g, config.guidance_scale) for n, g in generators.items()},
                       {str(n): g.batch_size for n, g in generators.items()}, config.batches)
    rows = {n: {**timings[str(n)], "argument_bytes": program_memory(g.compiled)["argument"]}
            for n, g in generators.items()}
    first = rows[config.fsdps[0]]["images_per_s"]
    for row in rows.values():
        row["over_first"] = row["images_per_s"] / first
    return {"per_device_batch": per_device_batch, "devices": len(devices), "rows": {str(n): r for n, r in rows.items()}}


def run_models(model, config: BenchConfig, devices, width: int, height: int, programs=None) -> dict:
    """Images/s of ``model``'s generator and of each of ``config.compare_models``' at the same
    size, steps, per-device batch and dtype, timed batch by batch in turns; each model at its
    family's guidance (``guidance_before_planning`` of its default: the guided program where
    the default guides), with its FLOPs per image by parts (from shapes) and its images/s
    over the first model's."""
    from pipeline.bench.timing import in_turns, ours_call
    from pipeline.generate import parts
    from pipeline.generate.generator import Generator
    from pipeline.generate.spec import ProgramSpec
    from pipeline.model import load as model_lib

    per_device_batch = config.per_device_batches[0]
    rows, calls, sizes = {}, {}, {}
    for name in (config.model, *config.compare_models):
        loaded = model if name == config.model else model_lib.load(name, dtype=config.dtype)
        guidance = model_lib.describe(name).default_guidance
        guided = loaded.family.classifier_free(loaded) and guidance > 1
        rule = loaded.family.guidance_rule(loaded)
        if programs is not None and rule == "diffusers":  # a program an earlier part compiled, if it did
            generator = programs.generator(loaded, width, height, config.steps, per_device_batch, devices,
                                           guided=guided)
        else:
            generator = Generator(loaded, ProgramSpec(width, height, config.steps, per_device_batch, rule, guided,
                                                      decode_batch=config.decode_batch), devices)
        calls[name], sizes[name] = ours_call(generator, guidance), generator.batch_size
        rows[name] = {"family": loaded.family.name, "guidance_scale": guidance, "guided": guided,
                      "flops_per_image": parts.image_flops(loaded, width, height, config.steps, per_device_batch,
                                                           guided)}
    timings = in_turns(calls, sizes, config.batches)
    first = timings[config.model]["images_per_s"]
    for name, row in rows.items():
        row.update(timings[name], over_first=timings[name]["images_per_s"] / first)
    return {"per_device_batch": per_device_batch, "devices": len(devices), "steps": config.steps, "rows": rows}


def run_bench(config: BenchConfig) -> dict:
    """Run the whole bench; returns the report (and writes it to ``config.report``)."""
    import jax

    from pipeline.bench import attention as attention_bench, flops
    from pipeline.bench.baseline import SeedPipeline, notebook_pipeline
    from pipeline.io import storage
    from pipeline.model import load as model_lib

    config.validate()
    if set(config.parts) == {"flops"}:  # shapes alone: no weights loaded, nothing run
        report = {"command": command_line(config), "config": dataclasses.asdict(config), "flops": flops.run_flops(config)}
        if config.report:
            storage.write_text(config.report, json.dumps(report, indent=2) + "\n")
        return report
    if {"sweep", "recipes"} & set(config.parts) and \
            not model_lib.family_of(model_lib.resolve(config.model))[0].notebook_baseline:
        # the seed recipe is FlaxStableDiffusionPipeline's; SDXL's would be another baseline
        raise ValueError(f"bench generator's sweep and recipes compare with the SD 1.x/2.x notebook recipe; "
                         f"{config.model!r} is not SD 1.x/2.x: run the other parts (--parts fsdp,flops,...)")
    if "sweep" in config.parts:
        notebook_pipeline()  # the notebook extra installed, or a clear error before anything loads
    devices = jax.local_devices()[:config.devices] if config.devices else jax.local_devices()
    if config.devices and len(devices) < config.devices:
        raise ValueError(f"--devices {config.devices}: only {len(devices)} local devices")
    watch = logs.Stopwatch()
    model = model_lib.load(config.model, dtype=config.dtype, scheduler=config.scheduler,
                           timestep_spacing=config.timestep_spacing)
    load = watch.seconds()
    width, height = model.size(config.width, config.height)
    size = config.matmul_size or (4096 if devices[0].platform == "cpu" else 8192)
    peak = flops.matmul_peak(devices, config.dtype, size)
    logs.event("bench_peak", flops_per_s=round(peak["flops_per_s"]), size=size, dtype=config.dtype)

    rows = compared = start = seed_load = attention = program_memory = scored = None
    programs = Programs(config.decode_batch)  # a sampler that several parts time is compiled once
    if "sweep" in config.parts:
        watch = logs.Stopwatch()
        recipe = SeedPipeline(model_lib.resolve(config.model), config.dtype, devices)
        seed_load = watch.seconds()
        rows = run_sweep(model, recipe, config, devices, width=width, height=height, peak=peak["flops_per_s"],
                         programs=programs)
        del recipe
        gc.collect()
    if "recipes" in config.parts:
        compared = run_recipes(model, config, devices, width, height, programs)
    if "attention" in config.parts:
        attention = attention_bench.run_speed(model, config, devices, width, height, programs)
    if "memory" in config.parts:
        program_memory = attention_bench.run_memory(config, devices[0].platform, attention)
    sharded = run_fsdp(model, config, devices, width, height) if "fsdp" in config.parts else None
    models = run_models(model, config, devices, width, height, programs) if "models" in config.parts else None
    if "scoring" in config.parts:
        scored = run_scoring(model, config, devices, width, height, programs=programs)
    # free the model before the start-up probes load theirs (SD 1.5 in fp32 is 4 GB,
    # and the generators also hold a replicated copy)
    del model
    gc.collect()
    if "startup" in config.parts:
        start = run_startup(config, width, height, config.per_device_batches[0])

    config_dict = {**dataclasses.asdict(config), "width": width, "height": height}
    report = {"command": command_line(config), "config": config_dict,
              "machine": machine(devices),
              "load_s": {"ours": round(load, 3), "seed": seed_load and round(seed_load, 3)},
              "peak": peak, "sweep": rows, "recipes": compared, "attention": attention, "memory": program_memory,
              "startup": start, "scoring": scored, "flops": flops.run_flops(config) if "flops" in config.parts else None,
              "fsdp": sharded, "models": models,
              # samplers compiled, and generators built on a sampler an earlier part compiled
              "programs": {"compiled": programs.compiled, "shared": programs.shared}}
    if config.report:
        storage.write_text(config.report, json.dumps(report, indent=2) + "\n")
    return report
