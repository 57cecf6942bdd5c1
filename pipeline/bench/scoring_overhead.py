"""The scoring part of ``bench generator``: what ``--score clip,aesthetic,safety`` costs the
generator, timed with and without the scores in turns, and the scoring program's FLOPs
against the sampler's.
"""
from __future__ import annotations

import gc

from pipeline.bench.programs import Programs
from pipeline.bench.throughput_config import GUIDANCE, SCORERS, BenchConfig
from pipeline.core import logs
from pipeline.core.settings import Settings


SCORING_RECIPES = {"cfg": None, "one_step": (1, 0.0)}  # None: --steps, with guidance


def run_scoring(model, config: BenchConfig, devices, width: int, height: int, *,
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
