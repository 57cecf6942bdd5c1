"""Before the plan pipeline runs: the settings resolved, and OUT made ready for the run.

``prepare`` is the one preparation that ``run_plan`` and the beam engine both call:
every path on a filesystem Beam can reach, at least one prompt file of a known format,
the model's defaults filled in (``resolve_settings``), and ``run.json`` written or
resumed (``prepare_out``).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
from importlib import metadata

from pipeline import __version__
from pipeline.core import logs, naming
from pipeline.core.choices import LEGACY_ATTENTION
from pipeline.core.settings import Lora, Run, Settings
from pipeline.io import beamio, runs, storage
from pipeline.plan.layout import PlanError, match_prompt_files


def prepare(settings: Settings, overwrite: bool = False) -> tuple[Settings, Run]:
    """The resolved settings and the run in force in ``settings.out``, once OUT holds its
    ``run.json``; PlanError when no prompt file matches or OUT holds another run.

    ``overwrite``: delete an earlier run in ``settings.out`` first (``prepare_out``).
    """
    beamio.require_filesystem(settings.prompts, settings.out)
    if not match_prompt_files(settings.prompts):  # also: every file has a known format
        raise PlanError(f"no prompt files match {settings.prompts!r}")
    settings, run = resolve_settings(settings)
    return settings, prepare_out(settings.out, run, overwrite)


def _versions() -> dict:
    names = ("jax", "jaxlib", "flax", "diffusers", "transformers", "apache-beam", "numpy", "pillow", "pyarrow")
    found = {"promptmill": __version__}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def resolve_settings(settings: Settings) -> tuple[Settings, Run]:
    """Settings with the model's defaults filled in, and the run they plan."""
    from pipeline.model import load as model
    from pipeline.model.scorers import models as scorer_models

    settings.validate()
    described = model.describe(settings.model, settings.scheduler, settings.timestep_spacing, settings.steps,
                               settings.unet, settings.loras, settings.max_sequence_length)
    size, multiple = described["native_size"], described["size_multiple"]
    for name in ("width", "height"):
        value = getattr(settings, name)
        if value is not None and value % multiple:
            raise PlanError(f"--{name} {value}: {settings.model}'s images are multiples of {multiple} pixels each way "
                            f"({described['family']}: the VAE's scale factor{' x 2 for the 2x2 latent packing' if multiple > 8 else ''})")
    guidance = settings.guidance_scale if settings.guidance_scale is not None else described["default_guidance"]
    resolved = dict(width=settings.width or size, height=settings.height or size,
                    scheduler=settings.scheduler or described["scheduler"], guidance_scale=float(guidance),
                    max_sequence_length=described["max_sequence_length"])
    if not described["cfg"]:  # no classifier-free guidance: the program is decided by the family, now
        resolved.update(guidance_rule=described["guidance_rule"], guided=False)
    settings = settings.replace(**resolved).validate()
    run = Run.create(settings, described["fingerprint"], versions=_versions(),
                     created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     loras=tuple(Lora(**lora) for lora in described["loras"]), license=described["license"],
                     sharding=_sharding(settings),
                     scorers=scorer_models.describe(settings, described["fingerprint"])["fingerprints"])
    return settings, run


def _sharding(settings: Settings) -> dict | None:
    """With --fsdp > 1: where each component's weights live, by the sharding rule
    (``pipeline.generate.sharding``), from the model's shapes alone; logged."""
    if settings.fsdp == 1:
        return None
    if not isinstance(settings.fsdp, int):
        raise PlanError("--fsdp auto is resolved to a number before planning (pipeline.generate.fit)")
    from pipeline.model import load as model_lib, sharding

    params = model_lib.load(settings.model, settings.dtype, settings.scheduler, settings.timestep_spacing,
                            abstract=True, max_sequence_length=settings.max_sequence_length).params
    sizes = sharding.component_bytes(params)
    placed = sharding.layout_of(params, settings.fsdp).describe(sizes)
    logs.event("fsdp_layout", fsdp=settings.fsdp, components=placed,
               rule=f"the denoiser, and text encoders of {sharding.ENCODER_SHARDED_FROM / 2 ** 30:g} GiB or more, are "
                    f"sharded; the rest replicated")
    return placed


def prepare_out(out: str, run: Run, overwrite: bool = False) -> Run:
    """Make ``out`` ready for ``run``; returns the run in force.

    * An empty OUT gets ``run``.
    * An OUT holding the same run (same settings fingerprint) is resumed: its run.json,
      and so its ``created_at``, is kept, so every rewritten object has the same bytes.
    * An OUT holding a run with other settings is refused, since it would mix two runs'
      slices in one dataset, unless ``overwrite``.
    ``overwrite`` deletes everything promptmill wrote under OUT (``naming.OWNED``) first.
    """
    if overwrite:
        deleted = sum(storage.delete_prefix(naming.join(out, name)) for name in naming.OWNED)
        if deleted:
            logs.event("overwrite", out=out, objects_deleted=deleted)
    elif runs.exists(out):
        previous = runs.read(out)
        # the guidance rule is a version's, not a flag: a run keeps the one it was planned with;
        # whether it is guided was decided by its plan, which checks it again (decide_guidance)
        asked = run.settings.replace(guidance_rule=previous.settings.guidance_rule, guided=previous.settings.guided)
        if previous.settings.attention == LEGACY_ATTENTION:  # planned before the attention seam: keeps its program
            asked = asked.replace(attention=LEGACY_ATTENTION)
        if previous.settings_fingerprint == run.fingerprint_of(asked):
            return previous
        changed = sorted(f.name for f in dataclasses.fields(Settings)  # a moved OUT is the same run
                         if f.name != "out" and getattr(previous.settings, f.name) != getattr(asked, f.name))
        if previous.model_fingerprint != run.model_fingerprint:
            changed.append("model weights")
        if previous.scorers != run.scorers and set(dict(previous.scorers)) == set(dict(run.scorers)):
            changed.append("scorer model weights")
        raise PlanError(f"{out} already holds a run with other settings (changed: {', '.join(changed)}); "
                        "use another --out, or add --overwrite to delete the old run and start over")
    runs.write(out, run)
    return run
