"""The check of one host program (``check``): compiled for the target's chips in a
compiling child (``program``), remembered, and reported as the ``tpu_program`` event's
figures: per chip bytes, whether it fits, compile time, versions, flops, kernels."""
from __future__ import annotations

from pipeline.core import logs
from pipeline.generate import compile_process, parts
from pipeline.generate.tpu_check import chips, child
from pipeline.generate.tpu_check.chips import GIB
from pipeline.generate.tpu_check.context import Context
from pipeline.generate.tpu_check.program import Program, compile_program, compile_scorer_program, with_scorer
from pipeline.generate.tpu_check.remember import remembered

HEARTBEAT_S = 30.0  # while a program compiles, a tpu_program_still_compiling event this often


def check(settings, target: chips.Target, per_device_batch: int | None = None) -> dict:
    """The ``tpu_program`` report of ``settings``' host program on ``target`` at
    ``per_device_batch`` (default: the settings'): ``program_report`` of its context."""
    return program_report(Context.of(settings, target), per_device_batch or settings.per_device_batch)


def program_report(context: Context, per_device_batch: int) -> dict:
    """The ``tpu_program`` report of ``context``'s host program at ``per_device_batch``
    images per chip: per chip argument, temporary and total GiB, the chip's HBM and what
    XLA reports usable, whether it fits, compile time, versions, flops per image and XLA's
    time estimate, the attention kernels. With ``--score``, the scoring program is
    compiled too (``scorer_*_gib``), and the total is what the two need together
    (``with_scorer``)."""
    import jax

    settings, target, b = context.settings, context.target, per_device_batch
    limit, usable = chips.capacity(target)

    def make():
        logs.event("tpu_program_compiling", model=settings.model, tpu_type=target.tpu_type, chips=target.chips,
                   per_device_batch=b, attention=settings.attention)  # minutes to an hour at real sizes
        try:
            with logs.heartbeat("tpu_program_still_compiling", HEARTBEAT_S, program="the host program",
                                model=settings.model, tpu_type=target.tpu_type, per_device_batch=b):
                program = child.compiled(compile_program, context, b)  # the shapes travel: no reload
        except compile_process.Crashed as e:
            child.note_crash(e, context, b, "the host program")
            weights = context.weights()
            program = Program(b, weights, 0, weights, False, e.seconds, crashed=e.signal_name)
        flops = parts.image_flops(context.model, context.width, context.height, settings.steps, 1, context.guided)
        return {**program.to_dict(), "flops_per_image": flops}

    def make_scorer():
        try:
            with logs.heartbeat("tpu_program_still_compiling", HEARTBEAT_S, program="the scoring program",
                                model=settings.model, tpu_type=target.tpu_type, per_device_batch=b):
                return child.compiled(compile_scorer_program, context, b)
        except compile_process.Crashed as e:
            child.note_crash(e, context, b, "the scoring program")
            return {"crashed": e.signal_name}

    found, cached = remembered("program", settings, target, b, make)
    program = {k: v for k, v in found.items() if k != "flops_per_image"}
    scorer = None
    if settings.scores and program["compiled"]:  # a program of its own, remembered on its own
        scorer, scorer_cached = remembered("scorer", settings, target, b, make_scorer)
        cached = cached and scorer_cached
        if scorer.get("crashed"):
            program.update(compiled=False, crashed=scorer["crashed"])
            scorer = None
        elif "refused_temp" in scorer:
            program["compiled"] = False
    report = {"model": settings.model, "width": context.width, "height": context.height, "steps": settings.steps,
              "dtype": settings.dtype, "attention": settings.attention, "guided": context.guided,
              "fsdp": settings.fsdp, "decode_batch": settings.decode_batch,
              "tpu_type": target.tpu_type, "topology": target.topology, "machine_type": target.machine_type,
              "chips_per_host": target.chips, "per_device_batch": b,
              "argument_gib": round(program["argument"] / GIB, 3), "temp_gib": round(program["temp"] / GIB, 3),
              "total_gib": round(with_scorer(program, scorer) / GIB, 3), "hbm_gib": target.hbm_gib,
              "usable_gib": round(usable / GIB, 3), "limit_gib": round(limit / GIB, 3),
              "fits": program["compiled"] and with_scorer(program, scorer) <= limit, "compiled": program["compiled"],
              "scores": list(settings.scores),
              **({f"scorer_{k}_gib": round(scorer[k] / GIB, 3) for k in ("argument", "temp", "total")}
                 | {"sampler_total_gib": round(program["total"] / GIB, 3),
                    "scorer_compile_s": round(scorer["compile_s"], 2)} if scorer else {}),
              "compile_s": round(program["compile_s"], 2), "from_cache": cached,
              "flops_per_image": found["flops_per_image"],
              "xla_flops_per_image": program["xla_flops"] / b if program["xla_flops"] else None,
              "optimal_seconds": program["optimal_seconds"], "kernels": program["kernels"],
              "all_gather_gib": round(program.get("all_gather_bytes", 0) / GIB, 3),
              "pallas_calls": program.get("pallas_calls", 0), "crashed": program.get("crashed"),
              "jax": jax.__version__, "libtpu": chips.libtpu_version()}
    return report
