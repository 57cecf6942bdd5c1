"""The scorer models of a run: where each comes from, what pins its bytes, and loading them.

``--clip-model`` and ``--safety-checker`` name a folder (a built-in random one, a local
folder, a ``gs://`` prefix copied once per machine into the cache, or a Hugging Face id
where the network allows); ``--aesthetic-head`` names a file (built-in, local or
``gs://``). Without ``--safety-checker`` the checker is the checkpoint's own
``safety_checker/`` (SD 1.x checkpoints ship one).

Each model's fingerprint goes in run.json (``Run.scorers``) and in the settings
fingerprint: a local folder's is a hash of its file table (each file's size and sha256,
remembered while the file is unchanged: ``identity.file_table``), a ``gs://`` folder's of
its objects' listed checksums, a head's the sha256 of its file, and the checkpoint's own
checker's follows from the checkpoint's fingerprint. Hosts compute them again when they
load the models, and refuse models that changed since the plan.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

from pipeline.model.scorers import aesthetic, clip as clip_lib, preprocess, presets, safety
from pipeline.model.scorers.clip import ScorerError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.txt", "*.safetensors", "flax_model.msgpack"]


@dataclasses.dataclass(frozen=True)
class Scorers:
    """The loaded scorer models of a run (None where its scores do not need one)."""
    scores: tuple[str, ...]
    clip: clip_lib.Clip | None = None
    head: aesthetic.Head | None = None
    checker: safety.SafetyChecker | None = None

    @property
    def params(self) -> dict:
        """Every model's params, by model: what the scoring program takes."""
        found = {"clip": self.clip, "aesthetic": self.head, "safety": self.checker}
        return {name: model.params for name, model in found.items() if model is not None}


def _fetch_hub(repo_id: str, flag: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except Exception as e:  # offline, unknown id, gated repo: say which and why
        raise ScorerError(f"{flag} {repo_id}: could not fetch it from the Hugging Face hub ({type(e).__name__}: "
                          f"{e}); download it elsewhere and pass the folder or a gs:// copy") from e


def resolve_folder(name: str, flag: str, builtins, weights: bool = True) -> str:
    """The local folder of a scorer model ``name``: built-in (``builtins``), ``gs://``
    (copied once; ``weights=False``: its configs alone), a local folder, or a hub id."""
    from pipeline.io import storage
    from pipeline.model.loading import fetch
    from pipeline.model.loading.checkpoint import ModelError

    if name in builtins:
        return presets.ensure(name)
    if storage.is_gcs(name):
        try:
            return fetch.fetch_remote(name, weights, marker="config.json")
        except ModelError as e:
            raise ScorerError(f"{flag} {name}: {e}") from None
    if os.path.isdir(name):
        return name
    if _HUB_ID.fullmatch(name) and not os.path.exists(name):
        return _fetch_hub(name, flag)
    raise ScorerError(f"{flag} {name!r} is not a folder (give a local folder, a gs:// prefix, a Hugging Face id, "
                      f"or a built-in random one: {', '.join(builtins)})")


def resolve_head(name: str) -> str:
    """The local file of ``--aesthetic-head``: built-in, a local file, or a ``gs://`` object
    copied once into the cache."""
    from pipeline.model.loading import fetch
    from pipeline.model.loading.checkpoint import ModelError

    if name in presets.HEADS:
        return os.path.join(presets.ensure(name), presets.HEAD_FILE)
    if not name.endswith(".safetensors"):
        raise ScorerError(f"--aesthetic-head {name}: give the head as a .safetensors file (the README says how to "
                          f"write one from LAION's .pth), or a built-in one: {', '.join(presets.HEADS)}")
    try:
        return fetch.resolve_file(name, "--aesthetic-head", "scorers")
    except ModelError as e:
        raise ScorerError(str(e)) from None


def checker_source(settings) -> tuple[str, str | None]:
    """(what names the safety checker, for messages; the --safety-checker value, or None
    for the checkpoint's own ``safety_checker/``)."""
    if settings.safety_checker:
        return settings.safety_checker, settings.safety_checker
    return f"{settings.model} (its safety_checker/)", None


def resolve_checker(settings, weights: bool = True) -> str:
    """The local folder of the run's safety checker (``checker_source``)."""
    from pipeline.model import load as model_load

    if settings.safety_checker:
        folder = resolve_folder(settings.safety_checker, "--safety-checker", presets.CHECKERS, weights)
        return safety.folder_of(folder)
    folder = os.path.join(model_load.resolve(settings.model, weights=weights), "safety_checker")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ScorerError(f"--score safety: the model {settings.model!r} has no safety_checker/ folder; give "
                          f"--safety-checker PATH (a safety_checker folder, or a checkpoint that has one; the "
                          f"built-in {', '.join(presets.CHECKERS)} are random)")
    return folder


def _table_fingerprint(folder: str) -> str:
    from pipeline.model.loading import identity

    table = identity.file_table(folder)
    return hashlib.sha256(json.dumps(["scorer-folder", sorted(table.items())], sort_keys=True).encode()).hexdigest()


def folder_fingerprint(name: str, folder: str) -> str:
    """The fingerprint of a scorer folder: a ``gs://`` one's listed checksums (nothing read),
    else a hash of its file table."""
    from pipeline.io import storage
    from pipeline.model.loading import identity

    if storage.is_gcs(name):
        return identity.fingerprint(name.rstrip("/"))
    return _table_fingerprint(folder)


def fingerprints(settings, model_fingerprint: str | None = None) -> dict:
    """{"clip", "aesthetic", "safety"}: the fingerprint of each scorer model the run reads
    (``settings.scorer_models``). ``model_fingerprint``: the checkpoint's, for its own checker."""
    from pipeline.core.settings import scorer_models
    from pipeline.model.loading import identity
    from pipeline.model import load as model_load

    found = {}
    for name in scorer_models(settings):
        if name == "clip":
            folder = resolve_folder(settings.clip_model, "--clip-model", presets.CLIPS, weights=False)
            found[name] = folder_fingerprint(settings.clip_model, folder)
        elif name == "aesthetic":
            found[name] = identity.file_sha256(resolve_head(settings.aesthetic_head))
        elif settings.safety_checker:
            folder = resolve_checker(settings, weights=False)
            value = folder_fingerprint(settings.safety_checker, folder)
            # a checkpoint's checker reads its feature_extractor/ too
            sibling = os.path.join(os.path.dirname(os.path.abspath(folder)), "feature_extractor")
            if not os.path.isfile(os.path.join(folder, "preprocessor_config.json")) and os.path.isdir(sibling):
                value = hashlib.sha256(f"{value}\0{_table_fingerprint(sibling)}".encode()).hexdigest()
            found[name] = value
        else:
            resolve_checker(settings, weights=False)  # it must exist
            base = model_fingerprint or identity.fingerprint(model_load.resolve(settings.model, weights=False))
            found[name] = hashlib.sha256(f"{base}\0safety_checker".encode()).hexdigest()
    return found


def load(settings, abstract: bool = False) -> Scorers:
    """The run's scorer models; ``abstract``: their params as ShapeDtypeStructs, from the
    configs alone (enough to compile the scoring program)."""
    scores = tuple(settings.scores)
    clip = head = checker = None
    if {"clip", "aesthetic"} & set(scores):
        folder = resolve_folder(settings.clip_model, "--clip-model", presets.CLIPS, weights=not abstract)
        clip = clip_lib.load(folder, settings.clip_model, abstract)
    if "aesthetic" in scores:
        head = aesthetic.load(resolve_head(settings.aesthetic_head), settings.aesthetic_head, clip.projection_dim,
                              abstract)
    if "safety" in scores:
        label, _ = checker_source(settings)
        checker = safety.load(resolve_checker(settings, weights=not abstract), label, abstract)
    return Scorers(scores, clip, head, checker)


def check_images(scorers: Scorers, width: int, height: int) -> None:
    """ScorerError unless each model's preprocessing turns ``width`` x ``height`` images into
    what it takes."""
    for flag, model in (("--clip-model", scorers.clip), ("--safety-checker", scorers.checker)):
        if model is not None:
            try:
                preprocess.check(model.preprocessing, model.image_size, height, width, f"{flag} {model.path}")
            except ValueError as e:
                raise ScorerError(str(e)) from None


def describe(settings, model_fingerprint: str | None = None) -> dict:
    """What planning needs of the scorer models, from their configs (no weights read):
    each one resolved and checked (configs, tokenizer, the head's shapes against CLIP's
    embedding width, the images' size against each model's preprocessing), and
    ``fingerprints``. ScorerError names the flag of a model that cannot be used."""
    if not settings.scores:
        return {"fingerprints": {}}
    check_images(load(settings, abstract=True), settings.width, settings.height)
    return {"fingerprints": fingerprints(settings, model_fingerprint)}


def program_description(settings) -> dict:
    """What the scoring program is made of, for the executable cache's index: each model's
    configs, tokenizer and preprocessing files by content (never weights), and the head's
    layer shapes."""
    def configs(folder: str) -> str:
        digest = hashlib.sha256()
        for name in sorted(os.listdir(folder)):
            if name.endswith((".json", ".txt")):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(name.encode() + b"\0" + f.read() + b"\0")
        return digest.hexdigest()

    found = {"scores": list(settings.scores)}
    if {"clip", "aesthetic"} & set(settings.scores):
        found["clip"] = configs(resolve_folder(settings.clip_model, "--clip-model", presets.CLIPS, weights=False))
    if "aesthetic" in settings.scores:
        layers = aesthetic.read_layers(resolve_head(settings.aesthetic_head), settings.aesthetic_head)
        found["aesthetic"] = [list(w.shape) for _, w, _ in layers]
    if "safety" in settings.scores:
        folder = resolve_checker(settings, weights=False)
        sibling = os.path.join(os.path.dirname(os.path.abspath(folder)), "feature_extractor")
        found["safety"] = [configs(folder), configs(sibling) if os.path.isdir(sibling) else None]
    return found
