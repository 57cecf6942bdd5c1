"""Copies of remote files in the local cache: a ``gs://`` checkpoint, whole or its
configs alone, and the files of ``--unet``, ``--lora`` and the scorers' flags.

A ``gs://`` checkpoint is copied once per machine into the local cache, keyed by its
objects' checksums and checked against them as it downloads; planning copies only its
configs (``CONFIG_SUFFIXES``), and its listing kept beside the copy
(``remote_objects``) is what ``pipeline.model.loading.identity`` fingerprints and
``pipeline.model.loading.components`` checks. ``--unet`` names a UNet-only safetensors
file (local or ``gs://``, copied once into the cache) that replaces the checkpoint's
UNet weights, and each ``--lora`` a LoRA adapter's file, found the same way
(``pipeline.model.loading.lora`` merges it).
"""
from __future__ import annotations

import hashlib
import json
import os

from pipeline.core import naming
from pipeline.model.loading.cache import cache_dir, is_made, materialize
from pipeline.model.loading.checkpoint import ModelError

LORA_FILE = "pytorch_lora_weights.safetensors"  # a --lora folder's file, as diffusers' save_lora_weights names it

# what describing a checkpoint reads: model_index.json, every component's config, the
# tokenizers' vocabularies and merges, the scheduler's config (never a weights file)
CONFIG_SUFFIXES = (".json", ".txt")
CHECKSUMS = ("size", "md5", "crc32c")  # what a gs:// checkpoint's file table keeps of each object


def _remote_root() -> str:
    return os.path.join(cache_dir(), "models", "remote")


def _configs_root() -> str:
    return os.path.join(cache_dir(), "models", "remote-configs")


def listed(prefix: str, marker: str = "model_index.json") -> dict:
    """{relative name: {"size", "md5", "crc32c"}} of a gs:// checkpoint's objects (the listing);
    ModelError unless it holds ``marker`` (a diffusers checkpoint's ``model_index.json``)."""
    from pipeline.io import storage

    objects = storage.object_checksums(prefix)
    unsafe = sorted(relative for relative in objects if not safe_name(relative))
    if unsafe:  # each name becomes a path in the cache folder: none may lead out of it
        shown = ", ".join(repr(name) for name in unsafe[:5]) + (f" and {len(unsafe) - 5} more" if len(unsafe) > 5 else "")
        raise ModelError(f"{prefix}: objects whose names cannot be files of a checkpoint (absolute, '..' or '.' "
                         f"parts, empty parts, backslashes or control characters): {shown}; nothing was copied")
    if marker not in objects:
        what = "a diffusers-format checkpoint" if marker == "model_index.json" else "a model folder"
        raise ModelError(f"{prefix}: missing {marker} (not {what})")
    return {relative: {key: entry[key] for key in CHECKSUMS} for relative, entry in objects.items()}


def safe_name(relative: str) -> bool:
    """Whether an object's name under a checkpoint's prefix is a plain relative path that
    stays inside the folder it is copied to (pure)."""
    parts = relative.split("/")
    return (bool(relative) and not relative.startswith("/") and "\\" not in relative
            and all(part not in ("", ".", "..") for part in parts)
            and not any(ord(c) < 32 or ord(c) == 127 for c in relative))


def _cache_key(objects: dict) -> str:
    """The cache folder of a remote checkpoint: a hash of every object's name, size and
    checksum (md5, else crc32c)."""
    sums = {relative: f"{entry['size']}:{entry['md5'] or entry['crc32c']}" for relative, entry in objects.items()}
    return hashlib.sha256(json.dumps(sorted(sums.items())).encode()).hexdigest()[:24]


def fetch_remote(prefix: str, weights: bool = True, marker: str = "model_index.json") -> str:
    """Copy a remote checkpoint into the local cache once per machine; returns the local folder.

    The cache key is a hash of every object's name, size and checksum, so a changed
    checkpoint is fetched anew and an unchanged one never is. Each object is checked
    against its listed checksums as it downloads (``storage.download_verified``: large
    ones in parallel ranges); a mismatch is a ModelError naming it. Processes on one
    machine asking at once download it once (``cache.materialize``: the others wait),
    into a scratch folder renamed into place, so a crash leaves no half-copied model.
    The listing is kept beside the copy (``KEY.objects.json``): the copy's fingerprint
    is the listing's (``identity.fingerprint``).

    ``weights=False``: the whole copy if the cache has it, else a folder of the configs
    alone (``CONFIG_SUFFIXES``), made the same way under ``remote-configs/KEY``; its
    listing still names every object, weights included (``components.check_components`` reads it).
    ``marker``: the file that makes a folder a model (a transformers model's folder, such as
    a CLIP scorer's, holds ``config.json`` rather than ``model_index.json``).
    """
    objects = listed(prefix, marker)
    key = _cache_key(objects)
    _keep_listing(key, objects)
    whole = os.path.join(_remote_root(), key)
    if not weights and not is_made(whole, marker):
        configs = {relative: entry for relative, entry in objects.items() if relative.endswith(CONFIG_SUFFIXES)}
        return materialize(os.path.join(_configs_root(), key), lambda scratch: _copy(prefix, configs, scratch),
                           marker)
    return materialize(whole, lambda scratch: _copy(prefix, objects, scratch), marker)


def _copy(prefix: str, objects: dict, scratch: str) -> None:
    from pipeline.io import storage

    root = os.path.realpath(scratch)
    for relative in sorted(objects):
        target = os.path.realpath(os.path.join(scratch, relative))
        if not target.startswith(root + os.sep):  # ``listed`` refused such names; never write outside
            raise ModelError(f"{prefix}: {relative!r} would be written outside the model cache ({target})")
        try:
            storage.download_verified(f"{prefix.rstrip('/')}/{relative}", target, objects[relative])
        except storage.ChecksumError as e:
            raise ModelError(f"{prefix}: {relative} does not match its listed checksum ({e}); fetch it again "
                             f"once the checkpoint is no longer being written") from None


def _listing_path(key: str) -> str:
    return os.path.join(_remote_root(), f"{key}.objects.json")


def _keep_listing(key: str, objects: dict) -> None:
    """Write a remote checkpoint's listing beside its cache folders, before either is made
    (its content follows from ``key``, so processes racing to write it agree)."""
    path = _listing_path(key)
    if os.path.isfile(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    scratch = f"{path}.{os.getpid()}.partial"
    with open(scratch, "w") as f:
        json.dump(objects, f, sort_keys=True)
    os.replace(scratch, path)


def remote_objects(directory: str) -> dict | None:
    """The listing of the gs:// checkpoint ``directory`` is a cache copy of (whole or
    configs only), or None for any other folder."""
    parent, key = os.path.split(os.path.abspath(directory))
    if parent not in (os.path.abspath(_remote_root()), os.path.abspath(_configs_root())):
        return None
    try:
        with open(_listing_path(key)) as f:
            objects = json.load(f)
    except (OSError, ValueError):
        return None
    return objects if _cache_key(objects) == key else None


def configs_only(directory: str) -> bool:
    """Whether ``directory`` is a gs:// checkpoint's configs-only copy (``fetch_remote``
    with ``weights=False``)."""
    return os.path.dirname(os.path.abspath(directory)) == os.path.abspath(_configs_root())


def resolve_unet(path: str) -> str:
    """The local file of ``--unet``: a local safetensors file, or a ``gs://`` object copied
    once into the cache (keyed by its checksum, renamed into place when complete)."""
    if not path.endswith(".safetensors"):
        raise ModelError(f"--unet {path}: give a UNet's PyTorch weights as a .safetensors file")
    return _local_file(path, "--unet", "unets", "diffusion_pytorch_model.safetensors")


def resolve_lora(path: str) -> str:
    """The local file of a ``--lora`` PATH: a ``.safetensors`` file, or a folder holding
    ``pytorch_lora_weights.safetensors`` (diffusers' ``save_lora_weights`` name); local, or
    ``gs://`` copied once into the cache as ``resolve_unet`` copies."""
    from pipeline.io import storage

    if path.endswith(".safetensors"):
        return _local_file(path, "--lora", "loras", os.path.basename(path))
    if not storage.is_gcs(path) and not os.path.isdir(path):
        what = "no such file or folder" if not os.path.exists(path) else "not a .safetensors file"
        raise ModelError(f"--lora {path}: {what} (give a LoRA's .safetensors file, or a folder holding "
                         f"{LORA_FILE})")
    try:
        return _local_file(naming.join(path, LORA_FILE), "--lora", "loras", LORA_FILE)
    except ModelError:
        raise ModelError(f"--lora {path}: the folder holds no {LORA_FILE}") from None


def resolve_file(path: str, flag: str, folder: str) -> str:
    """The local file of a ``flag`` PATH: ``path`` itself when local, else the ``gs://``
    object copied once into the cache under ``folder`` (as ``resolve_unet`` copies)."""
    return _local_file(path, flag, folder, os.path.basename(path))


def _local_file(path: str, flag: str, folder: str, name: str) -> str:
    """``path`` itself when local, else the ``gs://`` object copied once into the cache under
    ``folder`` (keyed by its path and checksum, renamed into place when complete)."""
    from pipeline.io import storage

    try:
        sum_ = storage.checksum(path)
    except (FileNotFoundError, IsADirectoryError):
        raise ModelError(f"{flag} {path}: no such file") from None
    if not storage.is_gcs(path):
        return path
    key = hashlib.sha256(f"{path}\0{sum_}".encode()).hexdigest()[:24]
    target = os.path.join(cache_dir(), folder, key, name)
    if not os.path.isfile(target):
        scratch = f"{target}.{os.getpid()}.partial"
        storage.download(path, scratch)
        os.replace(scratch, target)
    return target
