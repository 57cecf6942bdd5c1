"""The TPU check: compile, on this machine and without a TPU, the very program one host
of a TPU slice will run, and say whether it fits the chip.

libtpu compiles real TPU programs for a described topology
(``jax.experimental.topologies.get_topology_desc``: deviceless, ahead-of-time), so a
submission can be refused before anything is provisioned. The program is lowered from
shapes alone (``load(abstract=True)``: the checkpoint's configs, no weight byte read),
with the run's sampler, family, size, steps, dtype, guidance mode, attention (``auto``
resolves on the TPU platform, so the Pallas kernel appears where a host would run it)
and per-device batch, pmapped over one host's chips exactly as
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
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import tempfile
import time
from importlib import metadata

import numpy as np

from pipeline.core import logs
from pipeline.generate import compile_cache, compile_process, fit, parts
from pipeline.model import sharding

GIB = fit.GIB
INSTALL_HINT = ('install the TPU compiler with pip install "promptmill[tpu]" (it brings libtpu, the version '
                'jax[tpu] pins), or pass --no-tpu-check to submit without the check')


class TpuCheckError(RuntimeError):
    """The check could not run (no libtpu, a topology libtpu does not know)."""


class DoesNotFit(ValueError):
    """The run's program does not fit the target chip; the message has the figures."""


@dataclasses.dataclass(frozen=True)
class Target:
    """The chips of one host of a TPU slice: ``tpu_type`` (v5e, v6e, v5p), the host's
    ``chips``, and each chip's HBM in GiB as the TPU table lists it."""
    tpu_type: str
    chips: int
    hbm_gib: float
    topology: str = ""  # the whole slice's, for reports
    machine_type: str = ""
    usable_gib: float | None = None  # what one program may use; None: what XLA reports for the chip

    @property
    def host_topology(self) -> tuple[str, tuple[int, int, int]]:
        """(libtpu's topology name, chips per host bounds) of one host's chips."""
        shapes = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
        if self.chips not in shapes:
            raise TpuCheckError(f"a TPU host of {self.chips} chips is not one the check knows (1, 4 or 8)")
        bounds = shapes[self.chips]
        dims = bounds if self.tpu_type == "v5p" else bounds[:2]
        return f"{self.tpu_type}:{'x'.join(map(str, dims))}", bounds


def libtpu_version() -> str | None:
    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def require_libtpu() -> str:
    version = libtpu_version()
    if version is None:
        raise TpuCheckError(f"the TPU check needs libtpu, which is not installed: {INSTALL_HINT}")
    return version


@contextlib.contextmanager
def _quiet_stderr():
    """Hold back what libtpu prints on the process's stderr while it loads without a TPU
    (no TPU_ACCELERATOR_TYPE, no TPU_WORKER_HOSTNAMES: warnings about the machine it is
    not running on); yields a function returning the text, for an error message. In a
    compiling child (``compile_process``) it is held in the file its parent named, which
    the parent reads if the compiler crashes."""
    saved = os.dup(2)
    named = os.environ.get(compile_process.HELD)
    with (open(named, "w+b") if named else tempfile.TemporaryFile(mode="w+b")) as held:
        os.dup2(held.fileno(), 2)
        try:
            yield lambda: (held.seek(0), held.read().decode("utf-8", "replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


_DEVICES: dict[tuple, list] = {}


def host_devices(target: Target) -> list:
    """The chips of one host of ``target``: compile-only TPU devices (no TPU needed)."""
    name, bounds = target.host_topology
    if (name, bounds) not in _DEVICES:
        require_libtpu()
        # libtpu takes a machine-wide lock file so that two processes never drive one TPU;
        # compiling for described chips drives none, and two checks (two submissions, or a
        # test suite's workers) may well run at once
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from jax.experimental import topologies

        with _quiet_stderr() as held:
            try:
                topology = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                                        chips_per_host_bounds=bounds)
            except Exception as e:  # noqa: BLE001 - libtpu's reasons, with what it printed
                raise TpuCheckError(f"libtpu cannot describe {name} ({type(e).__name__}: {e}) {held()[-500:]}") \
                    from None
        _DEVICES[(name, bounds)] = [d for d in topology.devices if d.process_index == 0]
    return _DEVICES[(name, bounds)]


_SIZE = re.compile(r"([0-9.]+)\s*([KMGT]?)(i?B?)?")
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _bytes(text: str) -> int:
    number, unit, _ = _SIZE.fullmatch(text.strip()).groups()
    return int(float(number) * _UNITS[unit])


def out_of_memory(message: str) -> dict | None:
    """{"temp", "available"} bytes from XLA's out-of-HBM compile error, e.g. "the total
    memory required for HLO temporaries (8.07T) exceeds available HBM (15.75G)"; None for
    another error (pure)."""
    if "Ran out of memory" not in message and "RESOURCE_EXHAUSTED" not in message:
        return None
    found = {}
    for key, pattern in (("temp", r"required for HLO temporaries \(([^)]+)\)"),
                         ("available", r"available HBM \(([^)]+)\)")):
        match = re.search(pattern, message)
        if match:
            found[key] = _bytes(match.group(1))
    return found or None


_AVAILABLE: dict[str, int] = {}


def available_hbm(device) -> int | None:
    """The HBM XLA lets one program of this chip kind use, in bytes (a v5e chip: 15.75 GiB
    of its 16), read from the compiler's refusal of a program far too large; None if it
    says no figure. Probed once per chip kind (a compile of well under a second)."""
    kind = device.device_kind
    if kind not in _AVAILABLE:
        import jax
        import jax.numpy as jnp

        single = jax.sharding.SingleDeviceSharding(device)
        # a sort keeps the whole 64 GiB product alive: XLA cannot tile it away
        program = jax.jit(lambda x: jnp.sort(x @ x.T, axis=0)[:8])
        try:
            program.lower(jax.ShapeDtypeStruct((2 ** 17, 128), jnp.float32, sharding=single)).compile()
            _AVAILABLE[kind] = None
        except Exception as e:  # noqa: BLE001 - the refusal is the answer
            _AVAILABLE[kind] = (out_of_memory(str(e)) or {}).get("available")
    return _AVAILABLE[kind]


def _nbytes(tree) -> int:
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


def _program_args(settings, model) -> dict:
    """The arguments of ``generator.lower_sampler`` a run's settings decide."""
    rule = settings.guidance_rule if settings.guided is not None else model.family.guidance_rule(model)
    return dict(steps=settings.steps, latents=settings.save_latents, guidance_rule=rule,
                guided=run_guided(settings, model), attention=settings.attention)


def run_guided(settings, model=None) -> bool:
    """Whether the checked program is the guided one: the plan's decision when there is
    one, else what ``--guidance-scale`` alone implies (records that carry their own
    guidance above 1 make a run guided: ``submit`` checks again once the plan decided;
    without one, the family's default guides where the family has classifier-free
    guidance at all)."""
    if settings.guided is not None:
        return settings.guided
    if model is not None and not model.family.cfg:
        return False
    return settings.guidance_scale is None or settings.guidance_scale > 1


def size_of(settings, model) -> tuple[int, int]:
    return settings.width or model.native_size, settings.height or model.native_size


def compile_program(settings, target: Target, per_device_batch: int, model=None) -> Program:
    """The host program of ``settings`` at ``per_device_batch`` images per chip, compiled
    for ``target``'s chips; a program XLA refuses for memory comes back with
    ``compiled=False`` and the figures of its message."""
    from pipeline.generate import generator, runtime
    from pipeline.model.layers import attention

    devices = host_devices(target)
    model = model or runtime.abstract_model(settings)
    width, height = size_of(settings, model)
    args = _program_args(settings, model)
    with attention.record() as calls:
        lowered = generator.lower_sampler(model, width, height, per_device_batch=per_device_batch, devices=devices,
                                          fsdp=settings.fsdp, **args)
    params = sharding.device_bytes(model.params, settings.fsdp, model.param_dtype)  # each chip's share
    kernels = tuple(attention.summary(calls))
    found = compiled_figures(lowered, target, _whole_figures)
    if "refused_temp" in found:
        return Program(per_device_batch, params, found["refused_temp"], params + found["refused_temp"], False,
                       found["compile_s"], kernels=kernels)
    return Program(per_device_batch, found["argument"], found["temp"], found["total"], True, found["compile_s"],
                   found["xla_flops"], found["optimal_seconds"], kernels, found["all_gather_bytes"],
                   found["pallas_calls"])


def compile_scorer_program(settings, target: Target, per_device_batch: int, width: int, height: int) -> dict:
    """The bytes per chip (``argument``, ``temp``, ``total``) of the run's scoring program
    (``--score``: ``scoring.lower_scorer``, from the scorer models' configs alone) at
    ``per_device_batch`` images per chip, compiled for ``target``'s chips; a program XLA
    refuses for memory comes back with ``refused_temp``."""
    from pipeline.generate import scoring
    from pipeline.model.scorers import models

    devices = host_devices(target)
    scorers = models.load(settings, abstract=True)
    lowered = scoring.lower_scorer(scorers, width, height, per_device_batch, devices)
    found = compiled_figures(lowered, target, lambda executable: {
        k: v for k, v in fit.program_memory(executable).items() if k in ("argument", "temp", "total")})
    if "refused_temp" in found:
        weights = _nbytes(scorers.params)
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


def _recalled(key: str) -> dict | None:
    """What was kept for the program of ``key`` (``compile_cache.figures_key``), or None;
    ``compile_process.Crashed`` again at once for one that crashed libtpu's compiler before
    (``_crash``)."""
    found = compile_cache.recall(key)
    if found is not None and "crashed" in found:
        raise compile_process.Crashed(found["crashed"], True, found.get("compile_s", 0.0), "", key, remembered=True)
    return found


def compiled_figures(lowered, target: Target, figures) -> dict:
    """``figures(executable)`` (a JSON-able dict) of ``lowered`` compiled for ``target``'s
    chips, or ``{"refused_temp": bytes}`` when XLA refuses it for memory (the temporaries
    of its message); either with ``compile_s``, the seconds XLA took. Remembered by the
    program's own text (``compile_cache.figures_key``), so a program compiled before for
    the same chips with the same libtpu is not compiled again, whatever else changed; one
    that crashed the compiler before raises ``compile_process.Crashed`` again at once."""
    key = compile_cache.figures_key(lowered, host_devices(target))
    found = _recalled(key)
    if found is not None:
        return found
    started = time.perf_counter()
    try:
        with _quiet_stderr(), compile_process.compiling(key):
            executable = lowered.compile()
    except Exception as e:  # noqa: BLE001 - an out-of-memory refusal is a result; anything else is raised
        refused = out_of_memory(str(e))
        if refused is None or "temp" not in refused:
            raise
        value = {"refused_temp": refused["temp"]}
    else:
        value = figures(executable)
    value["compile_s"] = time.perf_counter() - started
    compile_cache.remember(key, value)
    return value


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


def all_gather_bytes(hlo_text: str) -> int:
    """Bytes the all-gathers of a compiled program write, summed over its HLO text: each
    all-gather (or its async start) counted once with its result's size, so one inside a
    loop's body counts once whatever the trip count (pure)."""
    total = 0
    for line in hlo_text.splitlines():
        if " all-gather(" not in line and " all-gather-start(" not in line:
            continue
        result = line.split("=", 1)[1].split("all-gather", 1)[0]
        shapes = [(kind, dims) for kind, dims in _SHAPE.findall(result) if kind in _DTYPE_BYTES]
        if not shapes:
            continue
        kind, dims = shapes[-1]  # an async start's result is (operand, result): the last
        total += _DTYPE_BYTES[kind] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def capacity(target: Target) -> tuple[int, int]:
    """(bytes a program may take on one of ``target``'s chips, the chip's usable HBM):
    ``fit.HEADROOM`` of what XLA reports available, or of the table's HBM without a report."""
    if target.usable_gib is not None:
        return int(target.usable_gib * GIB * fit.HEADROOM), int(target.usable_gib * GIB)
    reported = available_hbm(host_devices(target)[0])
    usable = reported if reported else int(target.hbm_gib * GIB)
    return int(usable * fit.HEADROOM), usable


def _compile(call: str, *args):
    """``call(*args)`` (a function of this module that compiles) in a process of its own,
    so that a compiler crash is a result, not the end of the check: ``compile_process``."""
    try:
        return compile_process.run(f"{__name__}:{call}", *args)
    except compile_process.Crashed:
        raise
    except compile_process.Failed as e:
        raise TpuCheckError(f"the TPU check could not compile: {e}") from None


def _crash(e: compile_process.Crashed, settings, target: Target, per_device_batch: int, what: str) -> None:
    """Log a compile that crashed; TpuCheckError when it was not the compiler's own crash
    (the process was killed from outside or ran out of this machine's memory), which says
    nothing about the program and is not remembered."""
    logs.event("tpu_compile_crashed", level=30, what=what, tpu_type=target.tpu_type, per_device_batch=per_device_batch,
               signal=e.signal_name, compiler=e.compiler, seconds=round(e.seconds, 1), printed=e.printed[-2000:],
               remembered=e.remembered)
    if e.compiler and e.program and not e.remembered:  # by the program's text: it holds across code changes
        compile_cache.remember(e.program, {"crashed": e.signal_name, "compile_s": e.seconds})
    if not e.compiler:
        raise TpuCheckError(f"the TPU check's compile of {what} of {describe_settings(settings)} at {per_device_batch} "
                            f"image(s) per {target.tpu_type} chip was stopped: {e} (out of memory on this machine? "
                            f"run it again, or on a machine with more memory)") from None


def parts_memory(settings, target: Target, per_device_batch: int, model, enough: int | None = None) -> int:
    """The most bytes any part of a step needs beyond its own weights, at
    ``per_device_batch`` images per chip, compiled for one of ``target``'s chips: the
    text encoders (2B rows when guided), one denoiser call, the VAE decode (B), each
    with the run's attention on the TPU platform. Remembered like a whole program's
    figures, so a search that was stopped goes on where it was, compiling again none of
    the parts it had compiled.

    ``enough``: bytes past which the answer no longer matters (the program would not fit).
    The parts are then compiled from the last, the VAE decode (the one that needs the most
    at large batches), and the first part past ``enough`` ends it: what is returned and
    remembered is a lower bound, used again only where it still says "too much".

    A part that crashes libtpu's compiler does not compile: past any ``enough`` (the
    batch cannot run), and a TpuCheckError where the figure itself is needed."""
    def make():
        try:
            beyond, complete = _compiled_parts_memory(settings, target, per_device_batch, model, enough)
        except compile_process.Crashed as e:
            _crash(e, settings, target, per_device_batch, "the parts of a step")
            return {"beyond": None, "crashed": e.signal_name}
        return {"beyond": beyond} if complete else {"beyond": beyond, "at_least": True}

    def usable(found):
        return (not found.get("at_least") or found.get("crashed") is not None
                or (enough is not None and found["beyond"] > enough))

    found, _ = _remembered("parts", settings, target, per_device_batch, make, usable)
    if found.get("crashed"):
        if enough is None:
            raise TpuCheckError(f"libtpu's compiler crashed ({found['crashed']}) on a part of a step of "
                                f"{describe_settings(settings)} at {per_device_batch} image(s) per {target.tpu_type} "
                                f"chip, so what the batch needs cannot be estimated: try another attention or size")
        return enough + 1
    return found["beyond"]


def _compiled_parts_memory(settings, target: Target, per_device_batch: int, model,
                           enough: int | None = None) -> tuple[int, bool]:
    """(the most bytes a part needs beyond its weights, whether every part was compiled):
    each part in a compiling child of its own (``assigned_part``), from the last, the VAE
    decode, up to the first."""
    most, index, count = 0, 1, None
    while count is None or index <= count:
        beyond, count = _compile("assigned_part", settings, target, per_device_batch, -index, model)
        most = max(most, beyond)
        if enough is not None and most > enough:
            return most, index == count
        index += 1
    return most, True


def assigned_part(settings, target: Target, per_device_batch: int, index: int, model=None) -> tuple[int, int]:
    """(the bytes part ``index`` of a step (``parts.parts``' order) needs beyond its own
    weights on one of ``target``'s chips, by XLA's buffer assignment
    (``assigned_figures``); how many parts there are): a compiling child's call, of
    ``model`` or, when None, of ``settings``' model from shapes."""
    from pipeline.generate import runtime

    model = model or runtime.abstract_model(settings)
    programs = lowered_parts(settings, target, per_device_batch, model)
    _, components, lowered = programs[index]
    found = assigned_figures(lowered, target)
    weights = sum(_nbytes(model.params[name]) for name in components)
    return (found["refused_temp"] if "refused_temp" in found else found["total"] - weights), len(programs)


def lowered_parts(settings, target: Target, per_device_batch: int, model) -> list:
    """``parts.parts`` of ``settings``' run, lowered for one of ``target``'s chips with the
    run's attention on the TPU platform."""
    import jax

    from pipeline.model.layers import attention

    single = jax.sharding.SingleDeviceSharding(host_devices(target)[0])
    width, height = size_of(settings, model)

    @contextlib.contextmanager
    def seam():
        with attention.use(settings.attention, platform="tpu"):
            yield

    return parts.parts(model, width, height, per_device_batch, run_guided(settings, model), seam, single)


_REPORT = re.compile(r"Memory Space: default \(color=0\)\s+Total bytes: (\d+)")


def memory_report(folder: str, complete: bool = False) -> int | None:
    """The HBM bytes of the memory-usage report XLA dumped into ``folder`` (its default
    memory space: parameters, outputs, temporaries and constants as buffer assignment
    placed them), once the dump written after it exists (or ``complete``: the compile
    ended); None before. Pure but for reading ``folder``."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    reports = sorted(n for n in names if n.endswith("-memory-usage-report.txt"))
    if not reports or not (complete or any(n.endswith("_after_buffer_assignment.txt") for n in names)):
        return None
    with open(os.path.join(folder, reports[-1]), encoding="utf-8", errors="replace") as f:
        found = _REPORT.search(f.read())
    if found is None:
        raise TpuCheckError(f"XLA's memory-usage report {reports[-1]} names no default memory space")
    return int(found.group(1))


def assigned_figures(lowered, target: Target) -> dict:
    """``{"total": bytes}`` that XLA's buffer assignment placed in one of ``target``'s
    chips' HBM for ``lowered`` (``memory_report``), or ``{"refused_temp": bytes}`` when XLA
    refuses it for memory; with ``compile_s``, the seconds it took to get there.

    Buffer assignment comes early in a TPU compile: the code generation after it takes
    the rest, 50 to 70 times as long for a VAE decode. A compiling child
    (``compile_process``) answers as soon as the report is written and is ended with the
    compile unfinished; elsewhere the compile runs to its end. The backend moves buffers
    after buffer assignment (SD 1.5's VAE decode at 512x512 on v6e measured 70 MB more in
    the whole compile, 14% of what it needs beyond its weights; a small program's
    temporaries can move into VMEM), so these figures predict and a whole compile decides
    (``_search``). Remembered by the program's own text, as ``compiled_figures`` are."""
    import threading

    key = compile_cache.figures_key(lowered, host_devices(target), kind="assigned")
    found = _recalled(key)
    if found is not None:
        return found
    child = compile_process.scratch()  # a child's dump goes in its parent's folder, removed after the child ends
    folder = tempfile.mkdtemp(prefix="xla-dump-", dir=child)
    ended, failed = threading.Event(), []

    def compile_it():
        try:
            lowered.compile(compiler_options={"xla_dump_to": folder})
        except Exception as e:  # noqa: BLE001 - read below
            failed.append(e)
        finally:
            ended.set()

    started = time.perf_counter()
    with _quiet_stderr(), compile_process.compiling(key):
        threading.Thread(target=compile_it, daemon=True).start()
        total = None
        while total is None:
            done = ended.wait(0.2)
            total = memory_report(folder, complete=done)
            if done and total is None:
                break
        seconds = time.perf_counter() - started
        if child is None:
            ended.wait()  # nothing ends this process's compile: let it finish
    if child is None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    if total is not None:
        value = {"total": total}
    else:
        refused = out_of_memory(str(failed[0])) if failed else None
        if refused is None or "temp" not in refused:
            if failed:
                raise failed[0]
            raise TpuCheckError("XLA wrote no memory-usage report for a part of a step")
        value = {"refused_temp": refused["temp"]}
    value["compile_s"] = seconds
    compile_cache.remember(key, value)
    return value


def _description(settings, target: Target, per_device_batch, scorers: bool = False) -> dict:
    """What a remembered result is of; ``scorers``: with the scoring program's models (the
    sampler and its parts are the same programs with scores or without)."""
    from pipeline.generate import runtime

    described = runtime.sampler_description(settings.replace(per_device_batch=per_device_batch
                                                             if per_device_batch is not None else 1))
    if scorers and settings.scores:
        from pipeline.model.scorers import models

        described["scorers"] = models.program_description(settings)
    described.update({"per_device_batch": per_device_batch, "guided": settings.guided,
                      "guidance_scale": settings.guidance_scale,
                      "tpu_type": target.tpu_type, "chips": target.chips, "libtpu": libtpu_version(), "check": 2})
    return described


def _remembered(kind: str, settings, target: Target, per_device_batch, make, usable=lambda found: True):
    """``make()`` (a JSON-able dict), or what it gave the last time for the same program
    on the same target (``compile_cache.remember``), where ``usable`` says it will do."""
    described = {"kind": kind, **_description(settings, target, per_device_batch, kind in ("scorer", "largest"))}
    if kind == "largest":  # a compiled program's figures are the chip's; what fits depends on its memory
        described.update(hbm_gib=target.hbm_gib, usable_gib=target.usable_gib)
    key = compile_cache.index_key(described, host_devices(target))
    found = compile_cache.recall(key)
    if found is not None and usable(found):
        return found, True
    value = make()
    compile_cache.remember(key, value)
    return value, False


def check(settings, target: Target, per_device_batch: int | None = None) -> dict:
    """The ``tpu_program`` report of ``settings``' host program on ``target`` at
    ``per_device_batch`` (default: the settings'): per chip argument, temporary and
    total GiB, the chip's HBM and what XLA reports usable, whether it fits, compile
    time, versions, flops per image and XLA's time estimate, the attention kernels.
    With ``--score``, the scoring program is compiled too (``scorer_*_gib``), and the
    total is what the two need together (``with_scorer``)."""
    import jax

    from pipeline.generate import runtime

    b = per_device_batch or settings.per_device_batch
    model = runtime.abstract_model(settings)
    width, height = size_of(settings, model)
    limit, usable = capacity(target)

    def make():
        logs.event("tpu_program_compiling", model=settings.model, tpu_type=target.tpu_type, chips=target.chips,
                   per_device_batch=b, attention=settings.attention)  # minutes to an hour at real sizes
        try:
            program = _compile("compile_program", settings, target, b, model)  # the shapes travel: no reload
        except compile_process.Crashed as e:
            _crash(e, settings, target, b, "the host program")
            weights = sharding.device_bytes(model.params, settings.fsdp, model.param_dtype)
            program = Program(b, weights, 0, weights, False, e.seconds, crashed=e.signal_name)
        flops = parts.image_flops(model, width, height, settings.steps, 1, run_guided(settings, model))
        return {**program.to_dict(), "flops_per_image": flops}

    def make_scorer():
        try:
            return _compile("compile_scorer_program", settings, target, b, width, height)
        except compile_process.Crashed as e:
            _crash(e, settings, target, b, "the scoring program")
            return {"crashed": e.signal_name}

    found, cached = _remembered("program", settings, target, b, make)
    program = {k: v for k, v in found.items() if k != "flops_per_image"}
    scorer = None
    if settings.scores and program["compiled"]:  # a program of its own, remembered on its own
        scorer, scorer_cached = _remembered("scorer", settings, target, b, make_scorer)
        cached = cached and scorer_cached
        if scorer.get("crashed"):
            program.update(compiled=False, crashed=scorer["crashed"])
            scorer = None
        elif "refused_temp" in scorer:
            program["compiled"] = False
    report = {"model": settings.model, "width": width, "height": height, "steps": settings.steps,
              "dtype": settings.dtype, "attention": settings.attention, "guided": run_guided(settings, model),
              "fsdp": settings.fsdp,
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
              "jax": jax.__version__, "libtpu": libtpu_version()}
    return report


def largest_batch(settings, target: Target, most: int = fit.MOST_PER_DEVICE) -> tuple[int, dict]:
    """(the most images per chip whose host program fits ``target``, {batch: estimated or
    compiled total bytes} of the search); DoesNotFit when one image does not.

    The parts of a step predict, the whole program decides (``_search``): no whole program
    is compiled but at the batches the parts point to, each a confirmation, and what one
    measured corrects the next prediction."""
    def make():
        return _search(settings, target, most)

    found, _ = _remembered("largest", settings, target, None, make)
    if found["batch"] is None:
        raise DoesNotFit(found["message"])
    return found["batch"], {int(b): n for b, n in found["tried"].items()}


def _search(settings, target: Target, most: int) -> dict:
    """The whole program at b needs about its weights + ``scale`` x parts(b), what its
    largest part needs beyond its own weights: the parts' figures come from XLA's buffer
    assignment (``assigned_figures``), a little under what the whole compile finds, and
    the whole holds what only it holds (the latents, the text embeddings, the images).
    Before any whole program is compiled ``scale`` is 1, a lower bound; each whole program
    compiled sets it to what that one measured beyond its weights, over its parts.
    ``fit.largest_batch`` predicts from the parts, below ``high``, the smallest batch known
    not to fit; the whole program at the prediction decides, and the search ends when the
    parts, so corrected, say ``low`` + 1 does not fit, ``low`` the largest known to fit. A whole
    program at one image is compiled only where the parts say nothing fits (the refusal's
    figures, or the answer). A whole program that does not compile halves the gap next:
    XLA's refusal corrects nothing, and a compiler crash (``tpu_compile_crashed``) is one
    the parts cannot foresee, so after one the rest of the search is bisected."""
    from pipeline.generate import runtime

    model = runtime.abstract_model(settings)
    limit, _ = capacity(target)
    whole: dict[int, dict] = {}

    def whole_total(b: int) -> int:
        if b not in whole:
            whole[b] = check(settings, target, b)
        report = whole[b]
        return int(report["total_gib"] * GIB) if report["compiled"] else limit + 1

    weights = sharding.device_bytes(model.params, settings.fsdp, model.param_dtype)
    scale, low, high, tried, halve, crashed = 1.0, 0, most + 1, {}, False, False
    while high - low > 1:
        def needs(b: int, scale=scale) -> int:  # past the limit, a part's exact figure does not matter
            return weights + math.ceil(scale * parts_memory(settings, target, b, model, int((limit - weights) / scale)))

        if halve or crashed:
            chosen = (low + high) // 2
        else:
            try:
                chosen, tried = fit.largest_batch(needs, limit, high - 1)
            except fit.FitError:
                # the parts say none: the whole at 1 says why
                chosen, tried = (1 if low == 0 and 1 not in whole else 0), {}
            if chosen <= low:  # the parts, corrected, point at or below what fits; they need not grow with the
                def above(b: int, low=low) -> int:  # batch everywhere, so above low they are asked again
                    if low + b not in tried:
                        tried[low + b] = needs(low + b)
                    return tried[low + b]

                try:
                    chosen = low + fit.largest_batch(above, limit, high - 1 - low)[0]
                except fit.FitError:  # nor does low + 1 fit: the search ends
                    break
        logs.event("tpu_batch_predicted", tpu_type=target.tpu_type, per_device_batch=chosen, low=low,
                   high=high if high <= most else None, scale=round(scale, 4), halved=halve or crashed,
                   estimated_gib=round(tried[chosen] / GIB, 3) if chosen in tried and not (halve or crashed) else None)
        total = whole_total(chosen)
        if total <= limit:
            low = chosen
        else:
            high = chosen
        # a whole program XLA refused says nothing the parts can be corrected by: the next batch halves the
        # gap; one that crashed the compiler, a crash the parts' buffer assignment cannot see: so does every next
        halve, crashed = not whole[chosen]["compiled"], crashed or bool(whole[chosen].get("crashed"))
        beyond = parts_memory(settings, target, chosen, model, limit)
        if high - low > 1 and whole[chosen]["compiled"] and 0 < beyond <= limit and total > weights:
            scale = (total - weights) / beyond  # what the whole needs beyond its weights, measured
    if low == 0:
        return {"batch": None, "tried": {1: whole_total(1)}, "message": refusal(whole[1], None)}
    logs.event("tpu_batch_searched", tpu_type=target.tpu_type, chips=target.chips, per_device_batch=low,
               limit_gib=round(limit / GIB, 3), whole_compiled=sorted(whole),
               estimated_gib={b: round(n / GIB, 3) for b, n in sorted(tried.items())})
    return {"batch": low, "tried": {**tried, **{b: whole_total(b) for b in whole}}, "message": None}


def estimated_fit(settings, target: Target, report: dict, most: int = fit.MOST_PER_DEVICE) -> int | None:
    """For a refusal: about how many images per chip fit, from the refused program's own
    total (``report``) and how the parts of a step grow with the batch (no other whole
    program compiled: ``largest_batch`` confirms an answer, this one only estimates it).
    None when not even one is predicted to fit."""
    from pipeline.generate import runtime

    model = runtime.abstract_model(settings)
    limit, _ = capacity(target)
    asked = report["per_device_batch"]
    total = int(report["total_gib"] * GIB)
    base = parts_memory(settings, target, asked, model)
    cache: dict[int, int] = {}

    def needs(b: int) -> int:
        if b not in cache:
            cache[b] = total + parts_memory(settings, target, b, model, limit - total + base) - base
        return cache[b]

    try:
        found, _ = fit.largest_batch(needs, limit, min(most, max(1, asked - 1)))
    except fit.FitError:
        return None
    return found


def describe_settings(settings) -> str:
    """``describe_run`` of settings not yet checked (no report to read)."""
    size = f" {settings.width}x{settings.height}" if settings.width and settings.height else ""
    return f"{settings.model}{size} {settings.dtype} ({settings.steps} steps, --attention {settings.attention})"


def describe_run(report: dict) -> str:
    fsdp = f", --fsdp {report['fsdp']}" if report.get("fsdp", 1) != 1 else ""
    fsdp += f", --score {','.join(report['scores'])}" if report.get("scores") else ""
    return (f"{report['model']} {report['width']}x{report['height']} {report['dtype']} "
            f"({'guided' if report['guided'] else 'guidance-free'}, {report['steps']} steps, --attention "
            f"{report['attention']}{fsdp})")


def refusal(report: dict, fitting: int | None, estimated: bool = False) -> str:
    """What ``submit`` says of a program that does not fit: its figures, and what would
    (``estimated``: from the parts' growth, not compiled whole)."""
    if report.get("crashed"):
        return (f"{describe_run(report)} at {report['per_device_batch']} image(s) per chip does not compile for a "
                f"{report['tpu_type']} chip: libtpu's compiler crashed ({report['crashed']}) on it, as it would on "
                f"the TPU host; another --per-device-batch may compile (auto searches the ones that do"
                f"{f', and about {fitting} per chip fit' if fitting else ''})")
    needs = f"needs {report['total_gib']:.2f} GiB" if report["compiled"] else \
        f"needs {report['total_gib']:.2f} GiB ({report['temp_gib']:.2f} of temporaries, by XLA's refusal to " \
        f"compile it)"
    text = (f"{describe_run(report)} at {report['per_device_batch']} image(s) per chip {needs} of a "
            f"{report['tpu_type']} chip's {report['hbm_gib']:g} GiB ({report['usable_gib']:.2f} GiB usable, "
            f"{report['limit_gib']:.2f} GiB with {round((1 - fit.HEADROOM) * 100)}% headroom)")
    if fitting is None:
        return text + "; not even one image per chip fits: use a larger TPU type, a smaller size, bf16 or --fsdp"
    if estimated:
        return text + f"; about {fitting} per chip fit (estimated from the step's parts: --per-device-batch auto " \
                      f"finds and confirms the largest)"
    return text + f"; {fitting} per chip fit{'s' if fitting == 1 else ''}"
