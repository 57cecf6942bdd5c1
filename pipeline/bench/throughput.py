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

Everything runs on whatever devices JAX finds (``--devices N``: the first N), CPU or
accelerator alike. The CPU run of docs/benchmarks.md was::

    promptmill bench generator --model random-sd15 --width 128 --height 128 --steps 2 \\
        --per-device-batch 1,2 --batches 3 --report /tmp/benchrun/report2.json
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform

from pipeline.bench.programs import Programs
from pipeline.core.decode_batch import DECODE_BATCH
from pipeline.core import logs
from pipeline.core.choices import ATTENTIONS, SCHEDULERS, TIMESTEP_SPACINGS
from pipeline.core.settings import Settings, check_size
from pipeline.generate.fit import GIB

GUIDANCE = 7.5  # SD's default guidance; above 1 its value does not change the work done
PARTS = ("sweep", "recipes", "attention", "memory", "startup", "scoring", "flops", "fsdp", "models")
# the flops part's default recipes (MODEL, steps, guidance): FLUX.1 [schnell] 4 steps and [dev] 28
# steps, beside SDXL-Lightning's 4 guidance-free steps and SDXL's default 20 guided ones
FLOPS_RECIPES = (("random-flux", 4, 0.0), ("random-flux-dev", 28, 3.5), ("random-sdxl", 4, 0.0),
                 ("random-sdxl", 20, 7.5))
# the scoring part's scorers (--scorers): random ones of the real sizes (CLIP ViT-L/14, SD 1.x's
# safety checker, LAION's head), or the tiny ones; built once into the cache like the random models
SCORERS = {"random": dict(scores=("clip", "aesthetic", "safety"), clip_model="random-clip-vit-l-14",
                          aesthetic_head="random-aesthetic", safety_checker="random-safety-checker"),
           "tiny": dict(scores=("clip", "aesthetic", "safety"), clip_model="tiny-clip", aesthetic_head="tiny-aesthetic",
                        safety_checker="tiny-safety-checker")}
# the sweep compares with the seed notebook's recipe, which needs the notebook extra (diffusers)
DEFAULT_PARTS = ("recipes", "startup")
FEW_STEPS = 4  # the few-step recipe's steps (SD-Turbo, SDXL-Turbo, SDXL-Lightning 4-step)
SD_DEFAULT_STEPS = 20  # the default recipe: SD's default steps (the bench compares SD 1.x/2.x checkpoints)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: str = "tiny"
    width: int | None = None  # None: the model's native size
    height: int | None = None
    steps: int = 4
    per_device_batches: tuple[int, ...] = (1,)
    batches: int = 2
    dtype: str = "fp32"
    devices: int | None = None  # None: every local device
    matmul_size: int | None = None  # None: 4096 on CPU, 8192 on accelerators
    report: str | None = None
    guidance_scale: float = GUIDANCE
    parts: tuple[str, ...] = DEFAULT_PARTS  # which parts of the report to run
    scheduler: str | None = None  # None: the checkpoint's own
    timestep_spacing: str | None = None  # None: the checkpoint's own
    # the attention and memory parts: the implementations compared (the first is the
    # reference: "xla", the whole attention matrix) and the memory part's square sizes
    attentions: tuple[str, ...] = ("xla", "auto")
    memory_sizes: tuple[int, ...] = (512, 1024)
    # the flops part: (model, steps, guidance) of each recipe, costed from shapes at width x height
    flops_recipes: tuple[tuple[str, int, float], ...] = FLOPS_RECIPES
    fsdps: tuple[int, ...] = (1, 2)  # the fsdp part: FSDP degrees timed side by side
    # the models part: other models timed side by side with --model, at its size and steps, each
    # at its own default guidance (a guidance-distilled model takes none)
    compare_models: tuple[str, ...] = ()
    # the VAE decode micro-batch of every sampler timed (--decode-batch): a new run's, by default
    decode_batch: int | None = DECODE_BATCH
    scorers: str = "random"  # the scoring part's scorers (SCORERS)
    startup_against: str | None = None  # the startup part: another source tree timed in turns with this one

    def validate(self) -> "BenchConfig":
        if not self.per_device_batches or min(self.per_device_batches) < 1:
            raise ValueError(f"--per-device-batch needs sizes >= 1, got {self.per_device_batches}")
        if self.batches < 1 or self.steps < 1:
            raise ValueError("--batches and --steps must be >= 1")
        if self.decode_batch is not None and self.decode_batch < 1:
            raise ValueError(f"--decode-batch must be >= 1 or whole, got {self.decode_batch}")
        for name in ("width", "height"):
            value = getattr(self, name)
            if value is not None:
                check_size(name, value, 8)  # every family makes multiples of 8 at real sizes
        if not self.parts or set(self.parts) - set(PARTS):
            raise ValueError(f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {self.parts}")
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise ValueError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if not self.attentions or set(self.attentions) - set(ATTENTIONS):
            raise ValueError(f"--attentions takes a comma-separated subset of {', '.join(ATTENTIONS)}, "
                             f"got {self.attentions}")
        if "models" in self.parts and not self.compare_models:
            raise ValueError("--parts models compares --model with --compare-models MODEL[,MODEL...]: give them")
        if self.scorers not in SCORERS:
            raise ValueError(f"--scorers must be one of {', '.join(SCORERS)}, got {self.scorers!r}")
        if not self.memory_sizes:
            raise ValueError("--memory-sizes needs at least one size")
        for size in self.memory_sizes:
            check_size("memory-sizes", size, 8)
        if self.timestep_spacing is not None and self.timestep_spacing not in TIMESTEP_SPACINGS:
            raise ValueError(f"--timestep-spacing must be one of {', '.join(TIMESTEP_SPACINGS)}, "
                             f"got {self.timestep_spacing!r}")
        return self

    @property
    def guided(self) -> bool:
        return self.guidance_scale > 1


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def machine(devices) -> dict:
    """What the numbers were measured on."""
    import jax

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return {"platform": devices[0].platform, "device_kind": devices[0].device_kind, "devices": len(devices),
            "local_devices": jax.local_device_count(), "cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
            "memory_gib": round(memory / 2**30, 1) if memory else None, "machine": platform.machine(),
            "python": platform.python_version(), "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}


def run_sweep(model, recipe, config: BenchConfig, devices, width: int, height: int, peak: float,
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
        counted = flops.sampler_flops(model, width, height, config.steps, per_device_batch, generator.compiled,
                                      config.guided)
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


def recipes(config: BenchConfig) -> dict:
    """The compared recipes: name -> (scheduler, timestep spacing, steps, guidance,
    per-device batch factor); None: the checkpoint's own sampler and spacing.
    ``guidance_free_2x`` runs twice the images per device: the UNet rows, and so about
    the memory, of the guided program at the sweep's first batch."""
    return {"cfg": (config.scheduler, config.timestep_spacing, config.steps, GUIDANCE, 1),
            "guidance_free": (config.scheduler, config.timestep_spacing, config.steps, 0.0, 1),
            "guidance_free_2x": (config.scheduler, config.timestep_spacing, config.steps, 0.0, 2),
            "few_step": (config.scheduler, config.timestep_spacing, FEW_STEPS, 0.0, 1),
            "default": (None, None, SD_DEFAULT_STEPS, GUIDANCE, 1)}


def run_recipes(model, config: BenchConfig, devices, width: int, height: int,
                programs: Programs | None = None) -> dict:
    """Images/s and FLOPs per image of each recipe (``recipes``), side by side: one
    replicated copy of the weights, one generator each, timed batch by batch in turns."""
    from pipeline.bench import flops
    from pipeline.bench.timing import in_turns, ours_call
    from pipeline.generate.generator import replicate
    from pipeline.model import load as model_lib

    programs = programs or Programs(config.decode_batch)

    per_device_batch = config.per_device_batches[0]
    networks = replicate({k: v for k, v in model.params.items() if k != "scheduler"}, devices)
    calls, rows, counted_parts = {}, {}, {}  # (batch, guided) -> part_flops: recipes share them
    first_of = {}  # a recipe's program -> the first recipe that runs it (at --steps 4, few_step is guidance_free)
    same_as = {}
    for name, (scheduler, spacing, steps, guidance, factor) in recipes(config).items():
        program = (scheduler, spacing, steps, guidance > 1, factor)
        if program in first_of:
            same_as[name] = first_of[program]
            rows[name] = {**rows[same_as[name]], "guidance_scale": guidance}
            continue
        first_of[program] = name
        variant = model_lib.with_sampler(model, scheduler, spacing)
        state = replicate({"scheduler": variant.params["scheduler"]}, devices) if "scheduler" in variant.params else {}
        generator = programs.generator(variant, width, height, steps, factor * per_device_batch, devices,
                                       guided=guidance > 1, params={**networks, **state})
        calls[name] = ours_call(generator, guidance)
        shape = (factor * per_device_batch, guidance > 1)
        if shape not in counted_parts:
            counted_parts[shape] = flops.part_flops(variant, width, height, *shape)
        counted = flops.sampler_flops(variant, width, height, steps, shape[0], generator.compiled, guided=shape[1],
                                      parts=counted_parts[shape])
        rows[name] = {"scheduler": variant.sampler.choice, "engine": variant.sampler.engine,
                      "timestep_spacing": variant.sampler.config.get("timestep_spacing"), "steps": steps,
                      "guidance_scale": guidance, "guided": guidance > 1, "flops": counted,
                      "batch_size": generator.batch_size}
    timings = in_turns(calls, {name: rows[name]["batch_size"] for name in calls}, config.batches)
    for name, row in rows.items():
        row.update(timings[same_as.get(name, name)])  # one program, timed once
        if name in same_as:
            row["same_program_as"] = same_as[name]
    speed = {name: row["images_per_s"] for name, row in rows.items()}
    work = {name: row["flops"]["per_image"] for name, row in rows.items()}
    result = {"per_device_batch": per_device_batch, "recipes": rows,
              "guidance_free_over_cfg": speed["guidance_free"] / speed["cfg"],
              "guidance_free_2x_over_cfg": speed["guidance_free_2x"] / speed["cfg"],
              "few_step_over_default": speed["few_step"] / speed["default"],
              "flops_cfg_over_guidance_free": work["cfg"] / work["guidance_free"],
              "flops_default_over_few_step": work["default"] / work["few_step"]}
    logs.event("bench_recipes", **{name: round(value, 4) for name, value in speed.items()},
               guidance_free_over_cfg=round(result["guidance_free_over_cfg"], 3),
               few_step_over_default=round(result["few_step_over_default"], 3))
    return result


SCORING_RECIPES = {"cfg": None, "one_step": (1, 0.0)}  # None: --steps, with guidance


def run_scoring(model, config: BenchConfig, devices, width: int, height: int,
                reference: tuple[int, int] | None = (512, 20), recipes_run=tuple(SCORING_RECIPES),
                programs: Programs | None = None) -> dict:
    """Images/s with and without every score (``SCORERS[config.scorers]``), side by side, timed in turns:
    at ``--steps`` with guidance (``cfg``) and the 1-step guidance-free recipe
    (``one_step``) (``recipes_run``: some of them); and the FLOPs per image of the scoring
    program and of the samplers, also at ``reference`` (size, steps: the issue's 512x512 with
    20 steps; None: not), from shapes alone."""
    import jax

    from pipeline.bench import flops
    from pipeline.bench.timing import in_turns, ours_call, scored_call
    from pipeline.generate import scoring
    from pipeline.generate.generator import replicate
    from pipeline.model.scorers import models

    programs = programs or Programs(config.decode_batch)

    per_device_batch = config.per_device_batches[0]
    chosen = SCORERS[config.scorers]
    settings = Settings(**chosen, width=width, height=height, per_device_batch=per_device_batch).validate()
    watch = logs.Stopwatch()
    scorers = models.load(settings)
    models.check_images(scorers, width, height)
    load_s = watch.seconds()
    watch = logs.Stopwatch()
    scorer = scoring.Scorer(scorers, width, height, per_device_batch, devices)
    compile_s = watch.seconds()
    scorer_flops = flops.whole_program_flops(scorer.program.compiled) / per_device_batch
    networks = replicate({k: v for k, v in model.params.items() if k != "scheduler"}, devices)
    state = replicate({"scheduler": model.params["scheduler"]}, devices) if "scheduler" in model.params else {}
    recipes_run = {name: SCORING_RECIPES[name] or (config.steps, GUIDANCE) for name in recipes_run}
    calls, sizes, work = {}, {}, {}
    for name, (steps, guidance) in recipes_run.items():
        generator = programs.generator(model, width, height, steps, per_device_batch, devices, guided=guidance > 1,
                                       params={**networks, **state})
        calls[name], calls[f"{name}_scored"] = ours_call(generator, guidance), scored_call(generator, scorer, guidance)
        sizes[name] = sizes[f"{name}_scored"] = generator.batch_size
        counted = flops.sampler_flops(model, width, height, steps, per_device_batch, guided=guidance > 1)
        work[name] = counted["per_image"]
    timings = in_turns(calls, sizes, config.batches)
    rows = {}
    for name, (steps, guidance) in recipes_run.items():
        plain, scored = timings[name], timings[f"{name}_scored"]
        rows[name] = {"steps": steps, "guidance_scale": guidance, "plain": plain, "scored": scored,
                      "overhead": 1 - scored["images_per_s"] / plain["images_per_s"],
                      "sampler_flops_per_image": work[name],
                      "scorer_flops_over_sampler": scorer_flops / work[name]}
    result = {"per_device_batch": per_device_batch, "scorers": dict(chosen, scores=list(chosen["scores"])),
              "scorer_load_s": round(load_s, 3), "scorer_compile_s": round(compile_s, 3),
              "scorer_flops_per_image": scorer_flops, "recipes": rows, "flops_at_512": None}
    if reference is not None:  # the case, from shapes alone: SD at 512x512 with 20 steps, and 1-step
        size, steps_at = reference
        abstract = _abstract(config)
        at_512 = {name: flops.sampler_flops(abstract, size, size, steps, 1, guided=guidance > 1)["per_image"]
                  for name, (steps, guidance) in {"cfg_20_steps": (steps_at, GUIDANCE), "one_step": (1, 0.0)}.items()}
        scorer_512 = flops.lowered_flops(scoring.lower_scorer(
            models.load(settings.replace(width=size, height=size), abstract=True), size, size, 1, devices[:1]))
        result["flops_at_512"] = {"size": size, "steps": steps_at, "scorer_per_image": scorer_512,
                                  **{f"{name}_sampler_per_image": v for name, v in at_512.items()},
                                  **{f"{name}_scorer_over_sampler": scorer_512 / v for name, v in at_512.items()}}
    logs.event("bench_scoring", **{f"{name}_overhead": round(row["overhead"], 4) for name, row in rows.items()},
               **{f"{name}_flops_ratio": round(row["scorer_flops_over_sampler"], 4) for name, row in rows.items()})
    del scorer, networks
    gc.collect()
    jax.clear_caches()
    return result


def _abstract(config: BenchConfig):
    from pipeline.model import load as model_lib

    return model_lib.load(config.model, dtype=config.dtype, scheduler=config.scheduler,
                          timestep_spacing=config.timestep_spacing, abstract=True)


def run_startup(config: BenchConfig, width: int, height: int, per_device_batch: int) -> dict:
    """Cold and warm start of a fresh process (``startup.cold_and_warm``: cold as on a
    machine that never ran the model, warm with what the cold one left); with
    ``--startup-against DIR``, that source tree's too, in turns with this one's."""
    from pipeline.bench import startup

    roots = (None, config.startup_against) if config.startup_against else (None,)
    runs = startup.cold_and_warm(config.model, width, height, config.steps, per_device_batch, config.dtype,
                                 config.devices, roots=roots)
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


# the rows of the start-up table: (label, key of the probe's result)
STARTUP_ROWS = (("import", "import_s"), ("load weights, check files", "load_s"),
                ("transfer to devices", "transfer_s"),
                ("compile or deserialize (beside load and transfer)", "compile_s"),
                ("wait for the compile", "wait_s"), ("time to ready", "ready_s"),
                ("first batch", "first_batch_s"), ("fresh process in all", "total_s"))


def command_line(config: BenchConfig) -> str:
    """The ``promptmill bench generator`` command that runs ``config``."""
    flags = {"--model": config.model, "--width": config.width, "--height": config.height, "--steps": config.steps,
             "--per-device-batch": ",".join(map(str, config.per_device_batches)), "--batches": config.batches,
             "--dtype": config.dtype, "--devices": config.devices, "--matmul-size": config.matmul_size,
             "--guidance-scale": config.guidance_scale, "--scheduler": config.scheduler,
             "--timestep-spacing": config.timestep_spacing,
             "--parts": ",".join(config.parts) if tuple(config.parts) != DEFAULT_PARTS else None,
             "--attentions": ",".join(config.attentions) if {"attention", "memory"} & set(config.parts) else None,
             "--memory-sizes": ",".join(map(str, config.memory_sizes)) if "memory" in config.parts else None,
             "--fsdp": ",".join(map(str, config.fsdps)) if "fsdp" in config.parts else None,
             "--compare-models": ",".join(config.compare_models) if "models" in config.parts else None,
             "--flops-recipes": ",".join(f"{m}:{s}:{g:g}" for m, s, g in config.flops_recipes)
             if "flops" in config.parts and config.flops_recipes != FLOPS_RECIPES else None,
             "--scorers": config.scorers if "scoring" in config.parts and config.scorers != "random" else None,
             "--startup-against": config.startup_against if "startup" in config.parts else None,
             "--decode-batch": None if config.decode_batch == DECODE_BATCH
             else "whole" if config.decode_batch is None else config.decode_batch,
             "--report": config.report}
    return " ".join(["promptmill bench generator"] + [f"{k} {v}" for k, v in flags.items() if v is not None])


def run_flops(config: BenchConfig) -> dict:
    """FLOPs per image by part of each of ``config.flops_recipes``, from shapes alone (no
    weights: the real-size built-in models need none), at the config's size (default
    1024x1024) and dtype: the text encoders, one denoiser call (a UNet's, on 2B rows when
    guided, or a transformer's), the VAE decode, and the whole image (text + steps x
    denoiser + decode)."""
    from pipeline.generate import parts
    from pipeline.model import load as model_lib

    width, height = config.width or 1024, config.height or 1024
    rows = []
    for name, steps, guidance in config.flops_recipes:
        model = model_lib.load(name, dtype=config.dtype, abstract=True)
        guided = model.family.classifier_free(model) and guidance > 1
        counted = parts.part_flops(model, width, height, 1, guided)
        per_image = parts.image_flops(model, width, height, steps, 1, guided)
        rows.append({"model": name, "family": model.family.name, "steps": steps, "guidance_scale": guidance,
                     "guided": guided, **counted, "per_image": per_image})
        logs.event("bench_flops", **rows[-1])
    return {"width": width, "height": height, "dtype": config.dtype, "rows": rows}


def run_fsdp(model, config: BenchConfig, devices, width: int, height: int) -> dict:
    """Images/s of the generator at each of ``config.fsdps`` (the weights sharded over groups
    of N devices, ``--fsdp N``), at the first per-device batch, timed batch by batch in
    turns; with each program's argument bytes per device (its share of the weights)."""
    from pipeline.bench.timing import in_turns, ours_call
    from pipeline.generate.fit import program_memory
    from pipeline.generate.generator import Generator

    per_device_batch = config.per_device_batches[0]
    generators = {fsdp: Generator(model, width, height, config.steps, per_device_batch, devices=devices,
                                  guided=model.family.classifier_free(model) and config.guided,
                                  guidance_rule=model.family.guidance_rule(model), fsdp=fsdp,
                                  decode_batch=config.decode_batch)
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
    from pipeline.model import load as model_lib

    per_device_batch = config.per_device_batches[0]
    rows, calls, sizes = {}, {}, {}
    for name in (config.model, *config.compare_models):
        loaded = model if name == config.model else model_lib.load(name, dtype=config.dtype)
        guidance = model_lib.describe(name)["default_guidance"]
        guided = loaded.family.classifier_free(loaded) and guidance > 1
        rule = loaded.family.guidance_rule(loaded)
        if programs is not None and rule == "diffusers":  # a program an earlier part compiled, if it did
            generator = programs.generator(loaded, width, height, config.steps, per_device_batch, devices, guided)
        else:
            generator = Generator(loaded, width, height, config.steps, per_device_batch, devices=devices,
                                  guided=guided, guidance_rule=rule, decode_batch=config.decode_batch)
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
        report = {"command": command_line(config), "config": dataclasses.asdict(config), "flops": run_flops(config)}
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
        rows = run_sweep(model, recipe, config, devices, width, height, peak["flops_per_s"], programs)
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
              "startup": start, "scoring": scored, "flops": run_flops(config) if "flops" in config.parts else None,
              "fsdp": sharded, "models": models,
              # samplers compiled, and generators built on a sampler an earlier part compiled
              "programs": {"compiled": programs.compiled, "shared": programs.shared}}
    if config.report:
        storage.write_text(config.report, json.dumps(report, indent=2) + "\n")
    return report


def format_flops(flops_report: dict) -> list[str]:
    f = flops_report
    lines = [f"FLOPs per image by part at {f['width']}x{f['height']} ({f['dtype']}, from shapes; TFLOP):",
             f"{'model':>16} {'steps':>5} {'guidance':>8} {'guided':>6} {'text':>7} {'denoiser call':>13} "
             f"{'VAE decode':>10} {'per image':>9}"]
    for row in f["rows"]:
        lines.append(f"{row['model']:>16} {row['steps']:>5} {row['guidance_scale']:>8} {str(row['guided']):>6} "
                     f"{row['text_encoder'] / 1e12:>7.2f} {row['denoiser_call'] / 1e12:>13.2f} "
                     f"{row['vae_decode'] / 1e12:>10.2f} {row['per_image'] / 1e12:>9.1f}")
    return lines


def format_table(report: dict) -> str:
    """The report as a readable table."""
    if "machine" not in report:  # the flops part alone
        return "\n".join(format_flops(report["flops"]))
    c, m, peak = report["config"], report["machine"], report["peak"]["flops_per_s"]
    lines = [f"model {c['model']} {c['width']}x{c['height']} steps {c['steps']} {c['dtype']} on "
             f"{m['devices']} x {m['device_kind']} ({m['platform']}); matmul peak {peak / 1e9:.1f} GFLOP/s"]
    if report["sweep"]:
        lines.append(f"{'per-dev batch':>13} {'ours img/s':>11} {'seed img/s':>11} {'ours/seed':>9} {'GFLOP/img':>10} "
                     f"{'GFLOP/s':>8} {'util':>6} {'seed util':>9}")
    for row in report["sweep"] or []:
        lines.append(f"{row['per_device_batch']:>13} {row['ours']['images_per_s']:>11.4f} "
                     f"{row['seed']['images_per_s']:>11.4f} {row['ours_over_seed']:>9.3f} "
                     f"{row['flops']['per_image'] / 1e9:>10.2f} {row['achieved_flops_per_s'] / 1e9:>8.2f} "
                     f"{row['utilisation']:>6.1%} {row['seed_utilisation']:>9.1%}")
    if report.get("models"):
        m_ = report["models"]
        lines.append(f"models side by side (per-device batch {m_['per_device_batch']}, {m_['steps']} steps, timed in "
                     f"turns):")
        lines.append(f"{'model':>18} {'guidance':>8} {'guided':>6} {'img/s':>9} {'GFLOP/img':>10} {'over first':>10}")
        for name, row in m_["rows"].items():
            lines.append(f"{name:>18} {row['guidance_scale']:>8} {str(row['guided']):>6} {row['images_per_s']:>9.4f} "
                         f"{row['flops_per_image'] / 1e9:>10.3f} {row['over_first']:>10.3f}")
    r = report["recipes"]
    if r:
        lines.append(f"recipes (per-device batch {r['per_device_batch']}, timed in turns):")
        lines.append(f"{'recipe':>16} {'sampler':>8} {'spacing':>9} {'steps':>5} {'guidance':>8} {'batch':>5} "
                     f"{'img/s':>9} {'GFLOP/img':>10}")
        for name, row in r["recipes"].items():
            lines.append(f"{name:>16} {row['scheduler']:>8} {str(row['timestep_spacing']):>9} {row['steps']:>5} "
                         f"{row['guidance_scale']:>8} {row['batch_size']:>5} {row['images_per_s']:>9.4f} "
                         f"{row['flops']['per_image'] / 1e9:>10.2f}")
        lines.append(f"guidance-free / CFG at {report['config']['steps']} steps: {r['guidance_free_over_cfg']:.2f}x "
                     f"images/s ({r['flops_cfg_over_guidance_free']:.2f}x fewer FLOPs), "
                     f"{r['guidance_free_2x_over_cfg']:.2f}x at twice the images per device; few-step guidance-free / "
                     f"20-step CFG default: {r['few_step_over_default']:.2f}x "
                     f"({r['flops_default_over_few_step']:.2f}x)")
    a = report.get("attention")
    if a:
        lines.append(f"attention at {a['width']}x{a['height']}, per-device batch {a['per_device_batch']} "
                     f"(timed in turns; relative to {a['relative_to']}):")
        lines.append(f"{'attention':>10} {'img/s':>9} {'relative':>8} {'temp GiB':>9} {'total GiB':>9}  kernels")
        for name, row in a["implementations"].items():
            memory = row["memory"]
            lines.append(f"{name:>10} {row['images_per_s']:>9.4f} {row['over_first']:>8.3f} "
                         f"{memory.get('temp', 0) / GIB:>9.3f} {memory.get('total', 0) / GIB:>9.3f}  "
                         f"{row['kernels']}")
    mem = report.get("memory")
    if mem:
        lines.append(f"sampler program memory per image (compiled from shapes, per-device batch "
                     f"{mem['per_device_batch']}):")
        lines.append(f"{'attention':>10} {'size':>6} {'temp GiB':>9} {'total GiB':>9}")
        for row in mem["rows"]:
            lines.append(f"{row['attention']:>10} {row['size']:>6} {row['temp_per_image'] / GIB:>9.3f} "
                         f"{row['total_per_image'] / GIB:>9.3f}")
        for name, growth in mem["temp_growth"].items():
            lines.append(f"temp {mem['sizes'][-1]}^2 / {mem['sizes'][0]}^2 with {name}: {growth:.2f}x "
                         f"(pixels {mem['pixel_growth']:.1f}x)")
    sc = report.get("scoring")
    if sc:
        lines.append(f"scoring overhead (--score {','.join(sc['scorers']['scores'])}: {sc['scorers']['clip_model']}, "
                     f"{sc['scorers']['aesthetic_head']}, {sc['scorers']['safety_checker']}; per-device batch "
                     f"{sc['per_device_batch']}; timed in turns):")
        lines.append(f"{'recipe':>10} {'steps':>5} {'plain img/s':>11} {'scored img/s':>12} {'overhead':>8} "
                     f"{'scorer/sampler FLOPs':>20}")
        for name, row in sc["recipes"].items():
            lines.append(f"{name:>10} {row['steps']:>5} {row['plain']['images_per_s']:>11.4f} "
                         f"{row['scored']['images_per_s']:>12.4f} {row['overhead']:>8.1%} "
                         f"{row['scorer_flops_over_sampler']:>20.2%}")
        f = sc["flops_at_512"]
        if f:
            lines.append(f"at {f['size']}x{f['size']}: scorer {f['scorer_per_image'] / 1e9:.1f} GFLOP/image, "
                         f"{f['cfg_20_steps_scorer_over_sampler']:.2%} of a {f['steps']}-step CFG image, "
                         f"{f['one_step_scorer_over_sampler']:.2%} of a 1-step guidance-free one")
    s = report["startup"]
    if s:
        cold, warm = s["cold"], s["warm"]
        lines.append(f"start-up of a fresh process (per-device batch {s['per_device_batch']}), seconds:")
        lines.append(f"{'':>42} {'cold':>8} {'warm':>8} {'warm/cold':>9}")
        for label, key in STARTUP_ROWS:
            ratio = f"{warm[key] / cold[key]:>9.2f}" if cold[key] else f"{'':>9}"
            lines.append(f"{label:>42} {cold[key]:>8.2f} {warm[key]:>8.2f} {ratio}")
        lines.append(f"sampler from the executable cache: cold {cold['sampler_from_cache']}, warm "
                     f"{warm['sampler_from_cache']} ({warm['cache_hits']} cache hits); time to ready warm/cold "
                     f"{s['ready_warm_over_cold']:.2f}, fresh process cold/warm {s['cold_over_warm']:.2f}")
        other = s.get("against")
        if other:
            lines.append(f"side by side with {other['root']} (timed in turns), seconds:")
            lines.append(f"{'':>42} {'cold':>8} {'against':>8} {'warm':>8} {'against':>8}")
            for label, key in STARTUP_ROWS:
                lines.append(f"{label:>42} {cold[key]:>8.2f} {other['cold'][key]:>8.2f} {warm[key]:>8.2f} "
                             f"{other['warm'][key]:>8.2f}")
    if report.get("flops"):
        lines += format_flops(report["flops"])
    f = report.get("fsdp")
    if f:
        lines.append(f"--fsdp side by side (per-device batch {f['per_device_batch']}, {f['devices']} devices, "
                     f"timed in turns):")
        lines.append(f"{'fsdp':>5} {'img/s':>9} {'relative':>8} {'argument MiB/device':>19}")
        for n, row in f["rows"].items():
            lines.append(f"{n:>5} {row['images_per_s']:>9.4f} {row['over_first']:>8.3f} "
                         f"{row['argument_bytes'] / 2 ** 20:>19.2f}")
    return "\n".join(lines)
