"""Before the plan pipeline runs: the settings resolved, and OUT made ready for the run.

``prepare`` is the one preparation that ``run_plan`` and the beam engine both call:
every path on a filesystem Beam can reach, at least one prompt file of a known format,
the model's defaults filled in (``resolve_settings``), and ``run.json`` written or
resumed (``prepare_out``).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
from importlib import metadata

from pipeline import __version__
from pipeline.core import buckets, logs, naming
from pipeline.core.decode_batch import DECODE_BATCH  # what --decode-batch auto resolves to, as the sampler reads it
from pipeline.core.settings import AUTO, Lora, Run, Settings
from pipeline.io import beamio, runs, storage
from pipeline.plan import input_table
from pipeline.plan.layout import PlanError, match_prompt_files


def prepare(settings: Settings, overwrite: bool = False) -> tuple[Settings, Run]:
    """The resolved settings and the run in force in ``settings.out``, once OUT holds its
    ``run.json``; PlanError when no prompt file matches or OUT holds another run.

    ``overwrite``: delete an earlier run in ``settings.out`` first (``prepare_out``).
    """
    beamio.require_filesystem(settings.prompts, settings.out)
    if not match_prompt_files(settings.prompts):  # also: every file has a known format
        raise PlanError(f"no prompt files match {settings.prompts!r}")
    settings, run = resolve_settings(kept_decode_batch(kept_steps(settings, overwrite), overwrite))
    run = prepare_out(settings.out, run, overwrite)
    # a resumed run keeps the names its plan gave (``key_names``): a re-plan writes the same keys
    return settings.replace(key_names=run.settings.key_names), run


def kept_steps(settings: Settings, overwrite: bool = False) -> Settings:
    """``settings`` with ``--steps`` left out (None) made the steps of the run already in
    OUT, which a resumed run keeps (logged as ``steps_kept``): a run planned when its
    family's default was another number goes on with its own. Otherwise as they are (the
    model's default is filled in by ``resolve_settings``)."""
    if settings.steps is not None or overwrite or not runs.exists(settings.out):
        return settings
    kept = runs.read(settings.out).settings.steps
    logs.event("steps_kept", steps=kept, out=settings.out)
    return settings.replace(steps=kept)


def kept_decode_batch(settings: Settings, overwrite: bool = False) -> Settings:
    """``settings`` with ``decode_batch`` "auto" made that of the run already in OUT, which a
    resumed run keeps (None, the whole batch at once, for a run planned before the decoder
    took micro-batches); otherwise as they are (``resolve_settings`` resolves "auto")."""
    if settings.decode_batch != AUTO or overwrite or not runs.exists(settings.out):
        return settings
    return settings.replace(decode_batch=runs.read(settings.out).settings.decode_batch)


def _versions() -> dict:
    names = ("jax", "jaxlib", "flax", "tokenizers", "safetensors", "apache-beam", "numpy", "pillow", "pyarrow")
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
    described = model.describe(model.LoadRequest.of(settings))
    size, multiple = described["native_size"], described["size_multiple"]
    sizes = settings.sizes
    if sizes == (buckets.PRESET,):
        sizes = buckets.preset_sizes(size, multiple)
        logs.event("sizes_preset", preset=buckets.PRESET, model=settings.model, sizes=list(sizes))
    for name in ("width", "height"):
        _check_side(f"--{name}", getattr(settings, name), settings.model, described)
    for name in sizes:
        for side, value in zip(("width", "height"), buckets.parse_size(name)):
            _check_side(f"--sizes {name}: the {side}", value, settings.model, described)
    steps = described["default_steps"] if settings.steps is None else settings.steps
    if not described["min_steps"] <= steps <= described["max_steps"]:
        raise PlanError(f"--steps {steps}{'' if settings.steps is not None else ' (the model default)'}: "
                        f"{settings.model} runs {described['min_steps']} to "
                        f"{described['max_steps']} steps ({described['steps_bound'] or described['family']})")
    if settings.steps is None:
        logs.event("steps_default", steps=steps, model=settings.model,
                   **({"note": described["steps_note"]} if described["steps_note"] else {}))
    if described["defaults_note"] and (settings.steps is None or settings.guidance_scale is None):
        logs.event("defaults_note", logging.WARNING, model=settings.model, note=described["defaults_note"])
    guidance = settings.guidance_scale if settings.guidance_scale is not None else described["default_guidance"]
    if described["guidance_rule"] == "unused" and settings.guidance_scale not in (None, 0):
        logs.event("guidance_unused", logging.WARNING, guidance_scale=settings.guidance_scale, model=settings.model,
                   why=f"{settings.model} takes no guidance ({described['family']}, guidance-distilled): the scale "
                       f"is recorded with each image and counted in the dataset's stats, never used")
    first = buckets.parse_size(sizes[0]) if sizes else (settings.width or size, settings.height or size)
    resolved = dict(width=first[0], height=first[1], sizes=tuple(sizes), steps=steps,
                    decode_batch=DECODE_BATCH if settings.decode_batch == AUTO else settings.decode_batch,
                    scheduler=settings.scheduler or described["scheduler"], guidance_scale=float(guidance),
                    max_sequence_length=described["max_sequence_length"])
    resolved.update(guidance_rule=described["guidance_rule"])  # the family's (a resumed run keeps its own)
    if not described["cfg"]:  # no classifier-free guidance: the program is decided by the family, now
        resolved.update(guided=False)
    settings = settings.replace(**resolved).validate()
    run = Run.create(settings, described["fingerprint"], versions=_versions(),
                     created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     loras=tuple(Lora(**lora) for lora in described["loras"]), license=described["license"],
                     sharding=_sharding(settings),
                     scorers=scorer_models.describe(settings, described["fingerprint"])["fingerprints"])
    return settings, run


def _check_side(what: str, value: int | None, model: str, described: dict) -> None:
    """PlanError unless ``value`` (a side of an image, None: the model's) is a size the
    model's family makes: a multiple of its size unit, at most its largest."""
    size, multiple = described["native_size"], described["size_multiple"]
    if value is not None and value % multiple:
        raise PlanError(f"{what} {value}: {model}'s images are multiples of {multiple} pixels each way "
                        f"({described['family']}: the VAE's scale factor"
                        f"{' x 2 for the 2x2 latent packing' if multiple > 8 else ''})")
    if value is not None and value > described["max_size"]:
        raise PlanError(f"{what} {value}: {described['family']} images are at most {described['max_size']} "
                        f"pixels each way ({described['max_size'] * described['max_size'] / size ** 2:g} times "
                        f"the model's native area, {size}x{size})")


def _sharding(settings: Settings) -> dict | None:
    """With --fsdp > 1: where each component's weights live, by the sharding rule
    (``pipeline.generate.sharding``), from the model's shapes alone; logged."""
    if settings.fsdp == 1:
        return None
    if not isinstance(settings.fsdp, int):
        raise PlanError("--fsdp auto is resolved to a number before planning (pipeline.generate.fit)")
    from pipeline.model import load as model_lib, sharding

    params = model_lib.load(model_lib.LoadRequest.of(settings), abstract=True).params
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
    ``overwrite`` deletes what an earlier promptmill run wrote under OUT first
    (``clear_run``). The input table (``input_table``) is written before ``run.json``
    for a new run, and checked against the inputs for a resumed one.
    """
    pattern = run.settings.prompts
    if overwrite:
        clear_run(out)
    elif runs.exists(out):
        previous = runs.read(out)
        # the guidance rule is a version's, not a flag: a run keeps the one it was planned with;
        # whether it is guided was decided by its plan, which checks it again (decide_guidance)
        asked = run.settings.replace(guidance_rule=previous.settings.guidance_rule, guided=previous.settings.guided,
                                     filter_rule=previous.settings.filter_rule, key_names=previous.settings.key_names)
        if previous.settings_fingerprint == run.fingerprint_of(asked):
            input_table.check(out, pattern, "resume")
            return previous
        changed = sorted(f.name for f in dataclasses.fields(Settings)  # a moved OUT is the same run
                         if f.name != "out" and getattr(previous.settings, f.name) != getattr(asked, f.name))
        if previous.model_fingerprint != run.model_fingerprint:
            changed.append("model weights")
        if previous.scorers != run.scorers and set(dict(previous.scorers)) == set(dict(run.scorers)):
            changed.append("scorer model weights")
        raise PlanError(f"{out} already holds a run with other settings (changed: {', '.join(changed)}); "
                        "use another --out, or add --overwrite to delete the old run and start over")
    elif not storage.is_gcs(out) and os.path.exists(out) and not os.path.isdir(out):
        raise PlanError(f"--out {out} is a file, not a folder: give a folder for the run's outputs")
    input_table.record(out, pattern)  # before run.json: a run.json without a table is an earlier version's
    runs.write(out, run)
    return run


def clear_run(out: str) -> int:
    """Delete what an earlier promptmill run wrote under ``out`` (``naming.owned``) and
    nothing else; returns how many objects were deleted. ``out`` must be empty, hold a
    promptmill run (its ``run.json`` reads as one), or hold only objects that promptmill
    writes (a plan stopped before its run.json): a folder holding anything else and no
    run is refused, since its files are a user's."""
    if not storage.is_gcs(out) and os.path.exists(out) and not os.path.isdir(out):
        raise PlanError(f"--out {out} is a file, not a folder: give a folder for the run's outputs")
    relative = {path: path[len(out.rstrip("/")) + 1:] for path in storage.glob(out)}
    card_path = naming.dataset_card(out)
    if card_path in relative and not naming.is_our_card(storage.read_text(card_path)):
        relative.pop(card_path)  # a README.md that collect did not write is a user's: kept, never deleted
        foreign_card = ["README.md"]
    else:
        foreign_card = []
    foreign = sorted([name for name in relative.values() if not naming.owned(name)] + foreign_card)
    if runs.exists(out):
        try:
            runs.read(out)
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"{naming.run_json(out)} is not a promptmill run's ({e}); --overwrite deletes only what "
                            f"a promptmill run wrote: use another --out") from None
    elif foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise PlanError(f"{out} holds files that no promptmill run wrote ({shown}) and no run.json: "
                        f"--overwrite deletes only what a promptmill run wrote; use an empty or new --out")
    doomed = [path for path, name in relative.items() if naming.owned(name)]
    deleted = storage.delete(doomed)
    if not storage.is_gcs(out):  # the folders the deletions emptied go too (GCS has no folders)
        root = os.path.abspath(out)
        for folder in sorted({os.path.dirname(os.path.abspath(p)) for p in doomed}, key=len, reverse=True):
            while folder != root and folder.startswith(root + os.sep) and os.path.isdir(folder) \
                    and not os.listdir(folder):
                os.rmdir(folder)
                folder = os.path.dirname(folder)
    if deleted or foreign:
        logs.event("overwrite", out=out, objects_deleted=deleted, objects_kept=len(foreign),
                   **({"kept": foreign[:10]} if foreign else {}))
    return deleted
