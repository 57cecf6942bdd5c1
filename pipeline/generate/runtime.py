"""The generation runtime: what every engine does to generate a planned run.

The pod host loop (``host_loop.generate``), the beam engine's DoFn, ``reproduce`` and
the benchmarks all call these, so a run's model, compiled generator, zarr outputs and
resume decisions are the same whichever engine made its images.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.core import logs, naming
from pipeline.core.settings import Run, Settings
from pipeline.generate.generator import Generator, SamplerProgram, compile_sampler, indexed_sampler
from pipeline.generate.spec import ProgramSpec
from pipeline.io import runs, storage
from pipeline.output import writer


class GenerateError(RuntimeError):
    pass


def load_planned(out: str) -> tuple[Run, dict]:
    """(the run, its plan manifest) of a planned ``out``; GenerateError if it was not planned."""
    manifest = naming.manifest(out)
    if not runs.exists(out) or not storage.exists(manifest):
        missing = naming.run_json(out) if not runs.exists(out) else manifest
        raise GenerateError(f"{missing} does not exist: run 'promptmill plan' for this --out first")
    return runs.read(out), storage.read_json(manifest)


def load_model(run: Run, out: str | None = None):
    """The run's model, loaded as every host loads it; GenerateError unless its
    fingerprint is the one the run was planned with.

    With ``out``, whose plan wrote the checkpoint's file table (``naming.model_files``),
    and neither --unet nor --lora, the files are checked against that table
    (``load.check_model``: for a local checkpoint, sizes and sha256s that are
    remembered rather than read when the files have not changed; for gs://, the objects'
    listed checksums) instead of hashing every byte again."""
    from pipeline.model import load as model_lib
    from pipeline.model.loading.checkpoint import ModelError

    settings = run.settings
    table = naming.model_files(out) if out else None
    quick = table is not None and not settings.unet and not settings.loras and storage.exists(table)
    model = model_lib.load(model_lib.LoadRequest.of(settings), fingerprint=not quick)
    if quick:
        try:
            model_lib.check_model(settings.model, storage.read_json(table)["files"])
        except ModelError as e:
            raise GenerateError(f"model {settings.model!r}: {e}") from None
        return dataclasses.replace(model, fingerprint=run.model_fingerprint)
    if model.fingerprint != run.model_fingerprint:
        raise GenerateError(f"model {settings.model!r} has fingerprint {model.fingerprint[:12]}, but the run was "
                            f"planned with {run.model_fingerprint[:12]}: generating needs the same checkpoint "
                            f"(and the same --unet and --lora files)")
    return model


def _check_guided(settings: Settings) -> None:
    if settings.guided is None:
        raise GenerateError("the run's settings do not say whether it is guided: its plan did not finish; "
                            "run 'promptmill plan' for this --out again")


def make_generator(model, settings: Settings, devices=None, program: SamplerProgram | None = None,
                   params=None) -> Generator:
    """The run's generator on ``devices`` (default: every local device), compiled once:
    the program of its settings (``ProgramSpec.of``: the guided or the guidance-free one,
    as the plan decided). ``program``: its sampler, compiled already
    (``compile_run_sampler``); ``params``: the model's params already on ``devices``
    (``generator.place_params``)."""
    _check_guided(settings)
    return Generator(model, ProgramSpec.of(settings), devices, program=program, params=params)


def abstract_model(settings: Settings):
    """The run's model from its configs alone (``load(abstract=True)``: no weight is read),
    enough to compile its sampler. Neither --unet nor --lora is needed for that: they
    change weights, never shapes."""
    from pipeline.model import load as model_lib

    return model_lib.load(model_lib.LoadRequest.of(settings), abstract=True)


def compile_run_sampler(settings: Settings, devices, abstract=None) -> SamplerProgram:
    """The run's sampler for ``devices``: found through the executable cache's index when
    this host made it before (nothing is traced), else compiled (or loaded from the
    executable cache) from the shapes of ``abstract`` (default: ``abstract_model``)."""
    from pipeline.generate import compile_cache

    _check_guided(settings)
    devices = list(devices)
    spec = ProgramSpec.of(settings)
    key = compile_cache.index_key(spec.description(), devices)
    program = indexed_sampler(key, devices, spec.fsdp)
    if program is not None:
        return program
    return compile_sampler(abstract or abstract_model(settings), spec, devices, index_key=key)


def ready_generator(run: Run, out: str | None = None, devices=None) -> tuple[object, Generator, dict]:
    """(the run's model, its generator, seconds of each part): ``load_model`` and
    ``make_generator``, but the sampler is made on a thread while this one reads and
    checks the weights (``compile_run_sampler``: found through the executable cache's
    index, else lowered from the configs' shapes and compiled or loaded). The program is
    the one ``make_generator`` alone would compile (the same text and cache key), so the
    images are the same bytes.

    Seconds: ``load`` (the weights, on this thread: memory-mapped once converted on this
    machine, ``weights.converted``), ``transfer`` (then the weights onto the devices, on
    this thread too: on CPU devices a mapped array is used in place), ``compile`` (the
    other thread, meanwhile: finding, or lowering and compiling or loading, the sampler),
    ``wait`` (for it, once the weights were on the devices)."""
    import jax

    from pipeline.generate.generator import place_params

    devices = list(devices or jax.local_devices())
    _check_guided(run.settings)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile") as pool:
        compiling = pool.submit(compile_run_sampler, run.settings, devices)
        model = load_model(run, out)
        loaded = time.perf_counter()
        if run.settings.fsdp != 1:
            logs.event("fsdp_layout", fsdp=run.settings.fsdp, components=run.sharding,
                       rule="the denoiser, and text encoders of 1 GiB or more, are sharded; the rest replicated")
        params = jax.block_until_ready(place_params(model, devices, run.settings.fsdp))
        transferred = time.perf_counter()
        try:
            program = compiling.result()
        except Exception as e:  # noqa: BLE001 - the generator compiles it from the weights instead
            logs.event("sampler_from_shapes_failed", error=f"{type(e).__name__}: {e}")
            program = None
        waited = time.perf_counter()
    generator = make_generator(model, run.settings, devices, program, params)
    if program is not None and generator.program is not program:
        # the weights' shapes or dtypes are not the configs' (e.g. float16 Flax weights)
        logs.event("sampler_recompiled", reason="the weights' shapes differ from the configs'")
    timings = {"load": loaded - started, "transfer": transferred - loaded,
               "compile": program.seconds if program else 0.0, "wait": waited - transferred}
    return model, generator, timings


def program_tag(run: Run) -> tuple:
    """What decides a compiled generator: runs with equal tags can share one in a process."""
    s = run.settings
    return (ProgramSpec.of(s), run.model_fingerprint, s.devices_per_host,
            s.scores, run.scorers)  # the scorers too: a worker holds its scoring program beside the sampler


def open_zarr(out: str, run: Run, model, images: int, group: str = ""):
    """(images array, latents array) of a zarr run, each None when not written; ``group``:
    a size's group in a run of several sizes (``OUT/zarr/WxH``), "" for ``OUT/zarr``."""
    settings = run.settings
    if "zarr" not in settings.formats:
        return None, None
    from pipeline.output import formats

    # one shard per slice: a slice's first position (within its size's group) is a multiple of its size
    zarr_images = formats.open_zarr_images(out, images, settings.height, settings.width, group=group,
                                           per_shard=settings.slice_size)
    zarr_latents = None
    if settings.save_latents:
        zarr_latents = formats.open_zarr_latents(out, images, model.latent_shape(settings.width, settings.height),
                                                 model.family.latents_note(model), group=group,
                                                 per_shard=settings.slice_size)
    return zarr_images, zarr_latents


@dataclasses.dataclass(frozen=True)
class SliceDecision:
    """What resume does with a slice: ``skip`` a committed one, ``redo`` one an earlier
    attempt left half-written (its objects are rewritten with the same bytes), or
    generate a ``new`` one."""
    action: str  # skip | redo | new
    leftover_objects: int = 0


def decide(out: str, settings: Settings, index: int) -> SliceDecision:
    if writer.is_committed(out, index):
        return SliceDecision("skip")
    leftovers = writer.leftovers(out, settings, index)
    return SliceDecision("redo", len(leftovers)) if leftovers else SliceDecision("new")
