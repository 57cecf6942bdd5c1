"""Before the plan pipeline runs: the settings resolved, and OUT made ready for the run.

``prepare`` is the one preparation that ``run_plan`` and the beam engine both call:
every path on a filesystem Beam can reach, at least one prompt file of a known format,
the model's defaults filled in (``resolve_settings``), and ``run.json`` written or
resumed (``prepare_out``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
from importlib import metadata

from pipeline import __version__
from pipeline.core import buckets, logs, naming
from pipeline.core.decode_batch import DECODE_BATCH  # what --decode-batch auto resolves to, as the sampler reads it
from pipeline.core.settings import AUTO, Lora, Run, Settings
from pipeline.io import beamio, listing, runs, storage
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
    check_apart(settings.prompts, settings.out)
    settings, run = resolve_settings(kept_batches_per_slice(kept_decode_batch(kept_steps(settings, overwrite),
                                                                              overwrite), overwrite))
    run = prepare_out(settings.out, run, overwrite)
    return settings, run


# names a run writes under OUT that a prompt pattern could take for prompt files
_WRITTEN_AS_PROMPTS = ("plan/slices/00000.jsonl", "plan/rejects/x.jsonl", "images/metadata.jsonl",
                       "shards/00000.parquet", "parquet/00000.parquet", "dataset/metadata.parquet",
                       "dataset/metadata/part-00000.parquet", "images/00000/metadata.jsonl")


def check_apart(prompts: str, out: str) -> None:
    """PlanError when ``prompts`` could match files the run writes into ``out`` (an OUT inside
    the prompt folder): a resume would then find its inputs changed by its own outputs."""
    def norm(path: str) -> str:
        return path if storage.is_gcs(path) else os.path.abspath(path)

    wildcard = listing.WILDCARD.search(prompts)
    literal = norm(prompts if not wildcard else prompts[:wildcard.start()].rpartition("/")[0] or ".")
    if not wildcard and not (storage.is_gcs(prompts) or os.path.isdir(prompts)):
        return  # one file
    rest = prompts[len(prompts[:wildcard.start()].rpartition("/")[0]) + 1:] if wildcard else "**"
    inside = norm(out).rstrip("/") + "/"
    if not inside.startswith(literal.rstrip("/") + "/"):
        return
    matches = listing.regex(rest).match
    under = inside[len(literal.rstrip("/")) + 1:]
    taken = [name for name in _WRITTEN_AS_PROMPTS if matches(under + name)]
    if taken:
        raise PlanError(f"--out {out} is inside the prompt folder, and --prompts {prompts!r} would read what the run "
                        f"writes there as prompts (e.g. {under}{taken[0]}): give an --out outside it")


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


def kept_batches_per_slice(settings: Settings, overwrite: bool = False) -> Settings:
    """``settings`` with ``batches_per_slice`` "auto" made that of the run already in OUT, which
    a resumed run keeps (its slices were cut with it); otherwise as they are (the plan
    decides "auto" once it has counted the images: ``decide.decide_batches_per_slice``)."""
    if settings.batches_per_slice != AUTO or overwrite or not runs.exists(settings.out):
        return settings
    return settings.replace(batches_per_slice=runs.read(settings.out).settings.batches_per_slice)


# the packages whose versions run.json records beside promptmill's, where installed
RECORDED_PACKAGES = ("jax", "jaxlib", "flax", "tokenizers", "safetensors", "apache-beam", "numpy", "pillow", "pyarrow")


def _installed(name: str) -> str | None:
    """The installed version of package ``name``, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _versions() -> dict:
    """promptmill's version and those of the ``RECORDED_PACKAGES`` installed, for run.json."""
    installed = {name: _installed(name) for name in RECORDED_PACKAGES}
    return {"promptmill": __version__, **{name: version for name, version in installed.items() if version}}


def resolve_settings(settings: Settings) -> tuple[Settings, Run]:
    """Settings with the model's defaults filled in, and the run they plan."""
    from pipeline.model import families, load as model
    from pipeline.model.scorers import models as scorer_models

    settings.validate()
    described = model.describe(model.LoadRequest.of(settings))
    size, multiple = described.native_size, described.size_multiple
    sizes = settings.sizes
    if sizes == (buckets.PRESET,):
        sizes = buckets.preset_sizes(size, multiple)
        logs.event("sizes_preset", preset=buckets.PRESET, model=settings.model, sizes=list(sizes))
    problem = families.size_problem(settings, described, sizes)
    if problem:
        raise PlanError(problem)
    steps = described.default_steps if settings.steps is None else settings.steps
    if not described.min_steps <= steps <= described.max_steps:
        raise PlanError(f"--steps {steps}{'' if settings.steps is not None else ' (the model default)'}: "
                        f"{settings.model} runs {described.min_steps} to "
                        f"{described.max_steps} steps ({described.steps_bound or described.family})")
    if settings.steps is None:
        logs.event("steps_default", steps=steps, model=settings.model,
                   **({"note": described.steps_note} if described.steps_note else {}))
    if described.defaults_note and (settings.steps is None or settings.guidance_scale is None):
        logs.event("defaults_note", logging.WARNING, model=settings.model, note=described.defaults_note)
    guidance = settings.guidance_scale if settings.guidance_scale is not None else described.default_guidance
    if settings.guidance_scale is not None and families.guidance_rule(described.guidance_rule).guidance_unused(
            settings.guidance_scale):
        logs.event("guidance_unused", logging.WARNING, guidance_scale=settings.guidance_scale, model=settings.model,
                   why=f"{settings.model} takes no guidance ({described.family}, guidance-distilled): the scale "
                       f"is recorded with each image and counted in the dataset's stats, never used")
    first = buckets.parse_size(sizes[0]) if sizes else (settings.width or size, settings.height or size)
    resolved = dict(width=first[0], height=first[1], sizes=tuple(sizes), steps=steps,
                    decode_batch=DECODE_BATCH if settings.decode_batch == AUTO else settings.decode_batch,
                    scheduler=settings.scheduler or described.scheduler, guidance_scale=float(guidance),
                    max_sequence_length=described.max_sequence_length)
    resolved.update(guidance_rule=described.guidance_rule)  # the family's (a resumed run keeps its own)
    if not described.cfg:  # no classifier-free guidance: the program is decided by the family, now
        resolved.update(guided=False)
    settings = settings.replace(**resolved).validate()
    run = Run.create(settings, described.fingerprint, versions=_versions(),
                     created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     loras=tuple(Lora(**lora) for lora in described.loras), license=described.license,
                     sharding=_sharding(settings),
                     scorers=scorer_models.describe(settings, described.fingerprint)["fingerprints"])
    return settings, run


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
        asked = run.settings.replace(guidance_rule=previous.settings.guidance_rule, guided=previous.settings.guided)
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
    else:  # a folder of a user's files is not a run's to write into
        refuse_foreign(out, "promptmill writes a run only into an empty folder or one that holds a promptmill run; "
                            "give a new --out")
    input_table.record(out, pattern)  # before run.json: a run.json without a table is an earlier version's
    runs.write(out, run)
    return run


DELETE_BATCH = 1000  # objects deleted at a time while --overwrite lists OUT (a GCS listing page)
SHOWN = 5  # names a refusal or a report shows


def clear_run(out: str) -> int:
    """Delete what an earlier promptmill run wrote under ``out`` (``naming.owned``) and
    nothing else; returns how many objects were deleted. ``out`` must be empty, hold a
    promptmill run (its ``run.json`` reads as one), or hold only objects that promptmill
    writes (a plan stopped before its run.json): a folder holding anything else and no
    run is refused, since its files are a user's.

    OUT is listed as it is deleted, a page at a time, so memory does not grow with the
    run. A symbolic link is never followed nor deleted (promptmill makes none): it is
    kept and reported, as is every object that is not promptmill's. ``run.json`` goes
    last, so an overwrite stopped halfway can be run again."""
    if not storage.is_gcs(out) and os.path.exists(out) and not os.path.isdir(out):
        raise PlanError(f"--out {out} is a file, not a folder: give a folder for the run's outputs")
    if runs.exists(out):
        try:
            runs.read_document(out, any_version=True)  # a run of an earlier version is cleared like any other
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"{naming.run_json(out)} is not a promptmill run's ({e}); --overwrite deletes only what "
                            f"a promptmill run wrote: use another --out") from None
    else:
        refuse_foreign(out, "--overwrite deletes only what a promptmill run wrote; use an empty or new --out")
    kept = Kept()
    deleted, batch = 0, []
    for path, name in _owned_entries(out, kept):
        # run.json goes last; the lease is this command's own
        if name not in (naming.run_json.name, naming.lease.name):
            batch.append(path)
        if len(batch) >= DELETE_BATCH:
            deleted += storage.delete(batch)
            batch = []
    deleted += storage.delete(batch)
    if runs.exists(out):
        deleted += storage.delete([naming.run_json(out)])
    if not storage.is_gcs(out):  # the folders the deletions emptied go too (GCS has no folders)
        if os.path.isdir(out):
            _remove_empty_folders(out)
    if deleted or kept.count:
        logs.event("overwrite", logging.WARNING if kept.links else logging.INFO, out=out, objects_deleted=deleted,
                   objects_kept=kept.count, **({"kept": kept.names} if kept.names else {}),
                   **({"links_kept": kept.links,
                       "why": "a symbolic link is never followed nor deleted: promptmill makes none"}
                      if kept.links else {}))
    return deleted


class Kept:
    """What an OUT listing left alone: how many objects, and the first few names and links."""

    def __init__(self):
        self.count, self.names, self.links = 0, [], []

    def add(self, name: str, kind: str) -> None:
        self.count += 1
        shown = self.links if kind != "file" else self.names
        if len(shown) < SHOWN * 2:
            shown.append(name + {"link": " (a symbolic link)", "other": " (not a regular file)"}.get(kind, ""))


def _owned_entries(out: str, kept: Kept):
    """``(path, name relative to out)`` of each object under ``out`` that promptmill wrote,
    streamed; every other entry is counted into ``kept``."""
    root = out.rstrip("/")
    for path, kind in storage.entries(root):
        name = path[len(root) + 1:].replace(os.sep, "/")
        # the dataset card is ours to delete only when it says so
        if kind == "file" and naming.owned(name) and (name != naming.dataset_card.name or _is_our_card(path)):
            yield path, name
        else:
            kept.add(name, kind)


def _is_our_card(path: str) -> bool:
    try:
        return naming.is_our_card(storage.read_text(path))
    except (UnicodeDecodeError, OSError):
        return False


def refuse_foreign(out: str, advice: str) -> None:
    """PlanError naming what is in ``out`` when it holds anything that no promptmill run
    wrote (a user's file, a link) and no run.json; stops listing at the first few."""
    kept = Kept()
    for _ in _owned_entries(out, kept):
        if kept.count >= SHOWN:
            break
    if kept.count:
        shown = sorted(kept.names + kept.links)
        more = " and more" if kept.count >= SHOWN else ""
        raise PlanError(f"{out} holds files that no promptmill run wrote ({', '.join(shown)}{more}) and no run.json: "
                        f"{advice}")


def _remove_empty_folders(folder: str, top: bool = True) -> None:
    """Remove the folders under local ``folder`` that are empty now, deepest first, never
    entering a link (nor ``folder`` itself when ``top``)."""
    with os.scandir(folder) as found:
        inner = [entry.path for entry in found if entry.is_dir(follow_symlinks=False)]
    for path in inner:
        _remove_empty_folders(path, top=False)
    if not top:
        with contextlib.suppress(OSError):  # not empty: a user's file, or a link, is in it
            os.rmdir(folder)
