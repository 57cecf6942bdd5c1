"""FLOPs of one sampler step from XLA's cost analysis, and the device's matmul peak.

XLA's cost analysis (``HloCostAnalysis``) counts the body of a while loop once, however
many times it runs: for the tiny model at 32x32 the compiled sampler reports the same
flops for 2, 4 and 8 steps (checked with jax 0.10.2 on CPU, and by
tests/bench/test_bench.py). The denoising loop is a ``lax.fori_loop``, which lowers to a
while loop, so ``Generator.compiled.cost_analysis()`` undercounts a step of S
denoising steps by about (S - 1) UNet calls.

``sampler_flops`` therefore costs the parts of a step separately, each as its own XLA
program at the step's per-device shapes: the text encoder(s) on the [negative; positive]
prompt ids, one UNet call on the classifier-free-guidance batch (2B), and the VAE
decode; a guidance-free program encodes the prompts alone and calls the UNet on B
(``pipeline.generate.parts`` lowers each). A step is ``text + S * unet + vae``. The
scheduler update and the guidance mix are elementwise and left out (well under 0.1% of
a step). The whole program's own count is reported next to it, with how many UNet calls
it implies, so a change in XLA's behaviour shows up in the report rather than silently
skewing it.

The parts are costed outside the attention seam (every call the whole matrix, ``xla``),
whatever ``--attention`` a run uses: every implementation computes the same exact
attention, so the work per image is the same, but the chunked kernel's ``lax.map`` over query blocks is a loop that XLA would
count once. Utilisation is thus always achieved model FLOPs over the peak (MFU).

``run_flops`` is ``bench generator``'s flops part: the FLOPs per image by part of whole
recipes (model, steps, guidance), from shapes alone.
"""
from __future__ import annotations

import time

import numpy as np

from pipeline.bench.throughput_config import BenchConfig
from pipeline.core import logs
from pipeline.generate.parts import flops as lowered_flops, part_flops  # noqa: F401 (the bench's names)


def whole_program_flops(compiled) -> float:
    """What XLA's cost analysis says of a compiled sampler over the host's mesh: one device's
    (partitioned) program."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost["flops"])


def sampler_flops(model, width: int, height: int, steps: int, per_device_batch: int, *, compiled=None,
                  guided: bool = True, parts: dict | None = None) -> dict:
    """Flops of one device step (``per_device_step``) and of one image, counted by parts.

    With ``compiled`` (the Generator's executable), also XLA's own count of the whole
    program and the number of UNet calls that count implies (1.0 while XLA counts a
    loop body once). ``parts``: ``part_flops`` of the same model, size, batch and
    guidance, counted before (the parts do not depend on the sampler or the steps).
    """
    parts = parts or part_flops(model, width, height, per_device_batch, guided)
    step = parts["text_encoder"] + steps * parts["denoiser_call"] + parts["vae_decode"]
    result = {**parts, "guided": guided, "steps": steps, "per_device_step": step, "per_image": step / per_device_batch}
    if compiled is not None:
        whole = whole_program_flops(compiled)
        result["xla_whole_program"] = whole
        result["xla_denoiser_calls_counted"] = round(
            (whole - parts["text_encoder"] - parts["vae_decode"]) / parts["denoiser_call"], 3)
    return result


def matmul_peak(devices, dtype: str, size: int, min_seconds: float = 1.0) -> dict:
    """Measured matmul FLOP/s of ``devices`` together, in the run's dtype.

    One [size, size] @ [size, size] product per device at once (``shard_map`` over the
    host's mesh, each device its own product of its whole copy), so devices
    that share hardware (several CPU "devices" on the same cores) are not counted
    twice. Timed after a warm-up call, over enough calls to last ``min_seconds``.
    """
    import jax
    import jax.numpy as jnp

    from pipeline.core.choices import DTYPES
    from jax.sharding import PartitionSpec

    from pipeline.generate.generator import replicate
    from pipeline.model import sharding

    jdtype = getattr(jnp, DTYPES[dtype])
    a = replicate(np.random.default_rng(0).standard_normal((size, size), np.float32), devices, jdtype)
    the_mesh = sharding.mesh(devices, 1)
    matmul = jax.jit(jax.shard_map(lambda x: jnp.dot(x, x), mesh=the_mesh, in_specs=PartitionSpec(),
                                   out_specs=sharding.batch_sharding(the_mesh, 2).spec, check_vma=False))
    matmul(a).block_until_ready()  # compile and first run
    calls, seconds = 2, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(calls):  # each product's output is dropped as the next is queued: on an
            out = matmul(a)     # accelerator a list of them all fills its memory before 1 s has passed
        out.block_until_ready()  # each device runs its calls in order: the last done, all are
        seconds = time.perf_counter() - start
        if seconds >= min_seconds:
            break
        calls *= 2
    flops = 2 * size ** 3 * len(devices) * calls
    return {"flops_per_s": flops / seconds, "size": size, "dtype": dtype, "calls": calls,
            "seconds": round(seconds, 4), "devices": len(devices)}


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
