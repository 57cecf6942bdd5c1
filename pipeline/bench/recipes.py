"""The recipes part of ``bench generator``: classifier-free guidance, guidance-free, the few-step
recipe and promptmill's default, side by side on one copy of the weights, with their FLOPs.
"""
from __future__ import annotations

from pipeline.bench.programs import Programs
from pipeline.bench.throughput_config import FEW_STEPS, GUIDANCE, SD_DEFAULT_STEPS, BenchConfig
from pipeline.core import logs


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
        counted = flops.sampler_flops(variant, width, height, steps, shape[0], compiled=generator.compiled, guided=shape[1],
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
