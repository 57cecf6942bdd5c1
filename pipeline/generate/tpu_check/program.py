"""The run's programs for one host's chips: the host program (``lowered_sampler``, as
``generator.lower_sampler`` lowers it on the host itself), compiled with its figures
(``compile_program``: a ``Program``), and the scoring program of ``--score``
(``compile_scorer_program``); what a chip needs for both (``with_scorer``)."""
from __future__ import annotations

import dataclasses

from pipeline.generate import fit
from pipeline.generate.tpu_check import chips, compiling
from pipeline.generate.tpu_check.xla_text import all_gather_bytes


def nbytes(tree) -> int:
    """The bytes of the arrays (or shapes) of ``tree``."""
    import jax
    import numpy as np

    return int(sum(np.prod(leaf.shape, dtype=np.int64) * np.dtype(leaf.dtype).itemsize
                   for leaf in jax.tree_util.tree_leaves(tree)))


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled (or refused) host program on a target chip, in bytes per chip."""
    per_device_batch: int
    argument: int
    temp: int
    total: int
    compiled: bool  # False: XLA refused it for memory; argument and temp are then from its message and shapes
    compile_s: float
    xla_flops: float | None = None  # XLA's count of the whole program (a loop's body counted once)
    optimal_seconds: float | None = None  # XLA's own time estimate, where it gives one
    kernels: tuple = ()  # attention.summary of the program's attention calls
    all_gather_bytes: int = 0  # what its all-gathers write (FSDP's gathered weights), each counted once
    pallas_calls: int = 0  # the compiled program's Pallas (Mosaic) kernels, as custom calls in its HLO
    crashed: str | None = None  # the signal libtpu's compiler died of on it (then compiled is False, temp 0)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"kernels": list(self.kernels)}


def lowered_sampler(context, per_device_batch: int) -> tuple:
    """(the host program of ``context``'s run at ``per_device_batch`` images per chip,
    lowered for its target's chips; ``attention.summary`` of its attention calls)."""
    from pipeline.generate import generator
    from pipeline.model.layers import attention

    devices = chips.host_devices(context.target)
    with attention.record() as calls:
        lowered = generator.lower_sampler(context.model, context.spec(per_device_batch), devices)
    return lowered, tuple(attention.summary(calls))


def compile_program(context, per_device_batch: int) -> Program:
    """The host program of ``context``'s run at ``per_device_batch`` images per chip,
    compiled for its target's chips; a program XLA refuses for memory comes back with
    ``compiled=False`` and the figures of its message (a compiling child's call)."""
    lowered, kernels = lowered_sampler(context, per_device_batch)
    params = context.weights()  # each chip's share
    found = compiling.compiled_figures(lowered, context.target, _whole_figures)
    if "refused_temp" in found:
        return Program(per_device_batch, params, found["refused_temp"], params + found["refused_temp"], False,
                       found["compile_s"], kernels=kernels)
    return Program(per_device_batch, found["argument"], found["temp"], found["total"], True, found["compile_s"],
                   found["xla_flops"], found["optimal_seconds"], kernels, found["all_gather_bytes"],
                   found["pallas_calls"])


def compile_scorer_program(context, per_device_batch: int) -> dict:
    """The bytes per chip (``argument``, ``temp``, ``total``) of the run's scoring program
    (``--score``: ``scoring.lower_scorer``, from the scorer models' configs alone) at
    ``per_device_batch`` images per chip of ``context``'s size, compiled for its target's
    chips; a program XLA refuses for memory comes back with ``refused_temp`` (a compiling
    child's call)."""
    from pipeline.generate import scoring
    from pipeline.model.scorers import models

    devices = chips.host_devices(context.target)
    scorers = models.load(context.settings, abstract=True)
    lowered = scoring.lower_scorer(scorers, context.width, context.height, per_device_batch, devices)
    found = compiling.compiled_figures(lowered, context.target, lambda executable: {
        k: v for k, v in fit.program_memory(executable).items() if k in ("argument", "temp", "total")})
    if "refused_temp" in found:
        weights = nbytes(scorers.params)
        found.update(argument=weights, temp=found["refused_temp"], total=weights + found["refused_temp"])
    return found


def with_scorer(program: dict, scorer: dict | None) -> int:
    """What a chip needs for the sampler and the scoring program together: both programs'
    arguments (their weights) stay on the chip, while a chip runs one program at a time,
    so only the running one's temporaries are live; the sampler's total without scores."""
    if scorer is None:
        return program["total"]
    return max(program["total"] + scorer["argument"], scorer["total"] + program["argument"])


def _whole_figures(compiled) -> dict:
    memory = fit.program_memory(compiled)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    estimate = cost.get("optimal_seconds")
    text = compiled.as_text()
    return {"argument": memory["argument"], "temp": memory["temp"], "total": memory["total"],
            "xla_flops": cost.get("flops"), "optimal_seconds": estimate if estimate is not None and estimate >= 0
            else None, "all_gather_bytes": all_gather_bytes(text),
            "pallas_calls": text.count('custom_call_target="tpu_custom_call"')}
