"""The generation runtime: what every engine does to generate a planned run.

The pod host loop (``host_loop.generate``), the beam engine's DoFn, ``reproduce`` and
the benchmarks all call these, so a run's model, compiled generator, zarr outputs and
resume decisions are the same whichever engine made its images.
"""
from __future__ import annotations

import dataclasses

from pipeline.core import naming
from pipeline.core.settings import Run, Settings
from pipeline.generate.generator import Generator
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
    (``sources.check_files``: sizes, and sha256s that are remembered rather than read
    when the files have not changed) instead of hashing every byte again."""
    from pipeline.model import load as model_lib, sources

    settings = run.settings
    table = naming.model_files(out) if out else None
    quick = table is not None and not settings.unet and not settings.loras and storage.exists(table)
    model = model_lib.load(settings.model, settings.dtype, settings.scheduler, settings.timestep_spacing, settings.unet,
                           settings.loras, fingerprint=not quick)
    if quick:
        try:
            sources.check_files(sources.resolve(settings.model), storage.read_json(table)["files"])
        except sources.ModelError as e:
            raise GenerateError(f"model {settings.model!r}: {e}") from None
        return dataclasses.replace(model, fingerprint=run.model_fingerprint)
    if model.fingerprint != run.model_fingerprint:
        raise GenerateError(f"model {settings.model!r} has fingerprint {model.fingerprint[:12]}, but the run was "
                            f"planned with {run.model_fingerprint[:12]}: generating needs the same checkpoint "
                            f"(and the same --unet and --lora files)")
    return model


def make_generator(model, settings: Settings, devices=None) -> Generator:
    """The run's generator on ``devices`` (default: every local device), compiled once:
    the guided or the guidance-free program, as the plan decided (``Settings.guided``)."""
    if settings.guided is None:
        raise GenerateError("the run's settings do not say whether it is guided: its plan did not finish; "
                            "run 'promptmill plan' for this --out again")
    return Generator(model, settings.width, settings.height, settings.steps, settings.per_device_batch,
                     devices=devices, latents=settings.save_latents, guidance_rule=settings.guidance_rule,
                     guided=settings.guided, attention=settings.attention)


def program_tag(run: Run) -> tuple:
    """What decides a compiled generator: runs with equal tags can share one in a process."""
    s = run.settings
    return (s.model, run.model_fingerprint, s.dtype, s.scheduler, s.width, s.height, s.steps, s.per_device_batch,
            s.save_latents, s.devices_per_host, s.guidance_rule, s.timestep_spacing, s.guided, s.attention)


def open_zarr(out: str, run: Run, model, images: int):
    """(images array, latents array) of a zarr run, each None when not written."""
    settings = run.settings
    if "zarr" not in settings.formats:
        return None, None
    from pipeline.output import formats

    zarr_images = formats.open_zarr_images(out, images, settings.height, settings.width)
    zarr_latents = None
    if settings.save_latents:
        zarr_latents = formats.open_zarr_latents(out, images, model.latent_shape(settings.width, settings.height),
                                                 model.vae.config.scaling_factor)
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
