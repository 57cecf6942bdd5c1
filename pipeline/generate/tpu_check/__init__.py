"""The TPU check: compile, on this machine and without a TPU, the very program one host
of a TPU slice will run, and say whether it fits the chip.

libtpu compiles real TPU programs for a described topology
(``jax.experimental.topologies.get_topology_desc``: deviceless, ahead-of-time), so a
submission can be refused before anything is provisioned. The program is lowered from
shapes alone (``load(abstract=True)``: the checkpoint's configs, no weight byte read),
with the run's sampler, family, size, steps, dtype, guidance mode, attention (``auto``
resolves on the TPU platform, so the Pallas kernel appears where a host would run it)
and per-device batch, over the mesh of one host's chips exactly as
``generator.lower_sampler`` lowers it on the host itself. Hosts exchange nothing, so one
host's program is the same in a 4-chip slice and in a 256-chip one: the check compiles
for a topology of one host's chips.

XLA's buffer assignment (``memory_analysis``) gives each chip's argument (the weights
and inputs), temporary and total bytes; a program too large for the chip does not
compile at all (RESOURCE_EXHAUSTED), and the figures are read from XLA's message. The
chip's usable HBM is what XLA reports available (15.75 GiB of a v5e chip's 16), probed
once per chip kind; a program fits when its total is at most ``fit.HEADROOM`` of it,
the rule ``--per-device-batch auto`` applies to every device.

``largest_batch`` finds the most images per chip that fit: the memory of the step's
parts (text encoders, one denoiser call, the VAE decode: ``parts``) at a few batches
predicts it, each part compiled only up to XLA's buffer assignment (``assigned_figures``:
seconds, where a whole compile of SDXL's UNet for v6e takes half an hour on 2 cores);
then the whole program is compiled at that batch to confirm it, and what it measured
corrects the next prediction. Results are kept in the compile cache's folder
(``compile_cache.remember``), keyed by what the program is made of, so an unchanged
submission does not compile again.

Every compile runs in a child process (``compile_process``): a program that crashes
libtpu's compiler is then a result, one that does not compile (``crashed``, remembered),
and the submitting process lives to say so.

One check is of one ``Context`` (the settings, the target, the abstract model, the size,
whether guided), built once and handed whole to the compiling children. The modules, each
importing only those above it:

- ``errors``: ``TpuCheckError``, ``DoesNotFit``.
- ``xla_text``: XLA's text read, pure (out-of-memory messages, all-gather bytes, the
  memory-usage report).
- ``chips``: the target (``Target``), libtpu, the host's compile-only devices, capacity.
- ``context``: ``Context``; ``run_guided``, ``size_of``.
- ``messages``: the run described, the refusal.
- ``child``: a compile in a process of its own, and a crash noted.
- ``compiling``: a lowered program compiled here, its figures remembered by its text.
- ``program``: the host program and the scoring program, lowered and compiled.
- ``remember``: results kept by what the program is made of.
- ``step_parts``: what the parts of a step need, at buffer assignment.
- ``report``: ``check``, the ``tpu_program`` report.
- ``search``: ``largest_batch``, ``estimated_fit``.
"""
from __future__ import annotations

from pipeline.generate.tpu_check.chips import (GIB, INSTALL_HINT, Target, available_hbm, capacity, host_devices,
                                               libtpu_version, require_libtpu)
from pipeline.generate.tpu_check.compiling import assigned_figures, compiled_figures
from pipeline.generate.tpu_check.context import Context, run_guided, size_of
from pipeline.generate.tpu_check.errors import DoesNotFit, TpuCheckError
from pipeline.generate.tpu_check.messages import describe_run, describe_settings, refusal
from pipeline.generate.tpu_check.program import (Program, compile_program, compile_scorer_program, lowered_sampler,
                                                 with_scorer)
from pipeline.generate.tpu_check.report import check, program_report
from pipeline.generate.tpu_check.search import estimated_fit, largest_batch, search_largest
from pipeline.generate.tpu_check.step_parts import assigned_part, lowered_parts, parts_memory
from pipeline.generate.tpu_check.xla_text import all_gather_bytes, memory_report, out_of_memory

__all__ = ["GIB", "INSTALL_HINT", "Context", "DoesNotFit", "Program", "Target", "TpuCheckError", "all_gather_bytes",
           "assigned_figures", "assigned_part", "available_hbm", "capacity", "check", "compile_program",
           "compile_scorer_program", "compiled_figures", "describe_run", "describe_settings", "estimated_fit",
           "host_devices", "largest_batch", "libtpu_version", "lowered_parts", "lowered_sampler", "memory_report",
           "out_of_memory", "parts_memory", "program_report", "refusal", "require_libtpu", "run_guided",
           "search_largest", "size_of", "with_scorer"]
