"""Where a checkpoint comes from, and what it is: the folder behind ``--model``.

A checkpoint is a diffusers-format directory (``model_index.json``, ``tokenizer/``,
``text_encoder/``, ``unet/``, ``vae/``, ``scheduler/``; SDXL adds ``tokenizer_2/`` and
``text_encoder_2/``): a built-in random model, a local folder, a ``gs://`` prefix
copied once per machine into the local cache, or a Hugging Face id. ``fingerprint`` pins
its bytes (a ``gs://`` checkpoint's through its objects' checksums: planning downloads
only its configs, and hosts check it by listing it, ``check_model``).
``--unet`` names a UNet-only safetensors file (local or ``gs://``, copied once into the
cache) that replaces the checkpoint's UNet weights, and each ``--lora`` a LoRA adapter's
file, found the same way (``pipeline.model.loading.lora`` merges it); ``model_fingerprint`` pins
them all.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

from pipeline.core import naming
from pipeline.model.loading import builtin, weights
from pipeline.model.loading.cache import cache_dir, is_made, materialize

LORA_FILE = "pytorch_lora_weights.safetensors"  # a --lora folder's file, as diffusers' save_lora_weights names it


class ModelError(ValueError):
    """A checkpoint that cannot be used; the message names the missing or bad piece."""


def read_json_file(path: str):
    """A checkpoint's JSON file (``model_index.json``, a config), or ModelError naming the
    file and where it stops being JSON."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ModelError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.txt", "*.msgpack", "*.safetensors"]


def resolve(name: str, weights: bool = True) -> str:
    """The local diffusers-format directory of a checkpoint that is not built in
    (``pipeline.model.load.resolve`` takes the built-in names first).

    A local folder, a ``gs://`` prefix (copied once into the cache, keyed by the
    objects' checksums), or a Hugging Face id (fetched through the hub's own cache,
    where the network allows). ``weights=False``: for a ``gs://`` prefix, a folder of its
    configs alone (``fetch_remote``), enough to describe the model; every other source
    is whole either way.
    """
    from pipeline.io import storage

    if storage.is_gcs(name):
        return fetch_remote(name, weights)
    if os.path.isdir(name):
        return name
    if _HUB_ID.fullmatch(name) and not os.path.exists(name):
        return _fetch_hub(name)
    raise ModelError(f"model {name!r} is not a directory (give a diffusers-format folder, a gs:// prefix or a "
                     f"Hugging Face id)")


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
    if marker not in objects:
        what = "a diffusers-format checkpoint" if marker == "model_index.json" else "a model folder"
        raise ModelError(f"{prefix}: missing {marker} (not {what})")
    return {relative: {key: entry[key] for key in CHECKSUMS} for relative, entry in objects.items()}


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
    is the listing's (``fingerprint``).

    ``weights=False``: the whole copy if the cache has it, else a folder of the configs
    alone (``CONFIG_SUFFIXES``), made the same way under ``remote-configs/KEY``; its
    listing still names every object, weights included (``check_layout`` reads it).
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

    for relative in sorted(objects):
        try:
            storage.download_verified(f"{prefix.rstrip('/')}/{relative}", os.path.join(scratch, relative),
                                      objects[relative])
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


def _remote_objects(directory: str) -> dict | None:
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


def listing_fingerprint(objects: dict) -> str:
    """sha256 over each object's relative name, size, md5 and crc32c (``_listed``), in name order."""
    rows = [[relative, *(objects[relative].get(key) for key in CHECKSUMS)] for relative in sorted(objects)]
    return hashlib.sha256(json.dumps(["gcs-objects", rows]).encode()).hexdigest()


def check_objects(prefix: str, table: dict) -> None:
    """ModelError naming the first object under ``prefix`` that differs from the plan's
    ``table`` (``load.model_table``): missing or extra, another size, or another checksum.
    Reads the listing only."""
    found = listed(prefix)
    for relative in sorted(set(found) | set(table)):
        if relative not in found:
            raise ModelError(f"{prefix}: {relative} is missing, but the run was planned with it")
        if relative not in table:
            raise ModelError(f"{prefix}: {relative} was not part of the checkpoint the run was planned with")
        if found[relative]["size"] != table[relative]["size"]:
            raise ModelError(f"{prefix}: {relative} has {found[relative]['size']} bytes, the run was planned "
                             f"with {table[relative]['size']}: generating needs the same checkpoint")
    for relative in sorted(found):
        if any(found[relative][key] != table[relative].get(key) for key in ("md5", "crc32c")):
            raise ModelError(f"{prefix}: {relative} differs from the object the run was planned with (another "
                             f"checksum): generating needs the same checkpoint")


def _fetch_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except Exception as e:  # offline, unknown id, gated repo: say which and why
        raise ModelError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
                         "download it elsewhere and pass the folder or a gs:// copy") from e


def _files(directory: str) -> list[tuple[str, str]]:
    """(relative name, path) of every file of a checkpoint, in a fixed order."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            found.append((os.path.relpath(path, directory).replace(os.sep, "/"), path))
    return found


def configs_digest(directory: str) -> str:
    """sha256 of what a checkpoint's programs are built from: its configs alone
    (``CONFIG_SUFFIXES``: model_index.json, the components' and the scheduler's configs,
    the tokenizers' files), by relative name and content. Weights change values, never a
    program; their shapes come from the configs."""
    import hashlib

    digest = hashlib.sha256()
    for relative, path in _files(directory):
        if relative.endswith(CONFIG_SUFFIXES):
            with open(path, "rb") as f:
                digest.update(relative.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def _memo_path(path: str) -> str:
    return os.path.join(cache_dir(), "digests", hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:32])


def _stat_key(path: str) -> dict:
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}


def _remember(path: str, key: dict, sha256: str) -> None:
    """Keep a file's sha256 for as long as its size, mtime and inode stay the same."""
    memo = _memo_path(path)
    os.makedirs(os.path.dirname(memo), exist_ok=True)
    scratch = f"{memo}.{os.getpid()}.partial"
    with open(scratch, "w") as f:
        json.dump({**key, "sha256": sha256}, f)
    os.replace(scratch, memo)


def _remembered(path: str) -> str | None:
    """The sha256 ``_remember`` kept for ``path``, if the file has not changed since."""
    try:
        with open(_memo_path(path)) as f:
            memo = json.load(f)
    except (OSError, ValueError):
        return None
    return memo.get("sha256") if {k: memo.get(k) for k in ("size", "mtime_ns", "inode")} == _stat_key(path) \
        else None


def fingerprint(directory: str) -> str:
    """sha256 over every file of the checkpoint (relative name and content).

    The same pass keeps each file's own sha256 (``file_table`` then reads nothing).

    A gs:// checkpoint's fingerprint is of its objects' checksums instead, not of their
    bytes: ``listing_fingerprint`` of each object's name, size, md5 and crc32c as GCS
    lists them, so planning downloads no weight. ``directory`` may be the gs:// prefix
    itself, or its copy in the cache (``fetch_remote``, whole or configs only), which has
    the same fingerprint: it is keyed by those checksums and was checked against them
    as it downloaded."""
    from pipeline.io import storage

    if storage.is_gcs(directory):
        return listing_fingerprint(listed(directory))
    objects = _remote_objects(directory)
    if objects is not None:
        return listing_fingerprint(objects)
    digest = hashlib.sha256()
    for relative, path in _files(directory):
        key = _stat_key(path)
        own = hashlib.sha256()
        digest.update(relative.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
                own.update(block)
        digest.update(b"\0")
        _remember(path, key, own.hexdigest())
    return digest.hexdigest()


def file_table(directory: str) -> dict:
    """{relative name: {"size", "sha256"}} of every file of a checkpoint, written with the
    plan so hosts can check their copy (``check_files``). A file hashed since it last
    changed (by ``fingerprint``, on this machine) is not read again."""
    table = {}
    for relative, path in _files(directory):
        table[relative] = {"size": os.path.getsize(path), "sha256": _remembered(path) or _hash_and_remember(path)}
    return table


def _hash_and_remember(path: str) -> str:
    key = _stat_key(path)
    value = file_sha256(path)
    _remember(path, key, value)
    return value


def check_files(directory: str, table: dict) -> None:
    """ModelError naming the first file of ``directory`` that differs from the plan's
    ``table`` (``file_table``): a file missing or extra, another size, or other bytes.

    Sizes are compared first; a file's bytes are read only when its sha256 is not
    remembered since it last changed, so a host checking the checkpoint its plan hashed
    on the same machine, or that it checked before, reads none of it."""
    files = dict(_files(directory))
    for relative in sorted(set(files) | set(table)):
        if relative not in files:
            raise ModelError(f"{directory}: {relative} is missing, but the run was planned with it")
        if relative not in table:
            raise ModelError(f"{directory}: {relative} was not part of the checkpoint the run was planned with")
        if os.path.getsize(files[relative]) != table[relative]["size"]:
            raise ModelError(f"{directory}: {relative} has {os.path.getsize(files[relative])} bytes, the run was "
                             f"planned with {table[relative]['size']}: generating needs the same checkpoint")
    for relative in sorted(files):
        path = files[relative]
        if (_remembered(path) or _hash_and_remember(path)) != table[relative]["sha256"]:
            raise ModelError(f"{directory}: {relative} differs from the file the run was planned with "
                             f"(another sha256): generating needs the same checkpoint")


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


def file_sha256(path: str) -> str:
    """sha256 of a local file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_fingerprint(directory: str, unet_file: str | None = None,
                      loras: list[tuple[str, float]] | tuple = ()) -> str:
    """The fingerprint of what a run samples with: the checkpoint's; with ``--unet``, a hash
    of it and of the UNet file's bytes; with LoRA adapters ((local file, scale), in the order
    they are merged), chained with each file's sha256 and scale."""
    value = fingerprint(directory)
    if unet_file is not None:
        digest = hashlib.sha256(f"{value}\0unet\0".encode())
        with open(unet_file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        value = digest.hexdigest()
    for lora_file, scale in loras:
        value = hashlib.sha256(f"{value}\0lora\0{file_sha256(lora_file)}\0{float(scale)!r}".encode()).hexdigest()
    return value


def check_unet_file(directory: str, unet_file: str) -> None:
    """ModelError unless ``unet_file`` is a safetensors file of a UNet shaped like the
    checkpoint's (its first and last convolutions, read from the header alone; every
    weight's shape is checked when a host loads it)."""
    from safetensors import safe_open

    config = read_json_file(os.path.join(directory, "unet", "config.json"))
    try:
        with safe_open(unet_file, "np") as tensors:
            names = set(tensors.keys())
            shapes = {name: tuple(tensors.get_slice(name).get_shape()) for name in ("conv_in.weight", "conv_out.weight")
                      if name in names}
    except Exception as e:  # not safetensors at all: name the file
        raise ModelError(f"--unet {unet_file}: not a readable safetensors file ({e})") from None
    first = config.get("block_out_channels", [320])[0]
    expected = {"conv_in.weight": (first, config.get("in_channels", 4), 3, 3),
                "conv_out.weight": (config.get("out_channels", 4), first, 3, 3)}
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            found = shapes.get(name, "missing")
            raise ModelError(f"--unet {unet_file}: {name} is {found}, the checkpoint's UNet needs {shape} (a UNet "
                             f"for another architecture, or not a diffusers-format UNet)")


def check_layout(directory: str, components, libraries: dict) -> None:
    """Check that every component folder a checkpoint's family needs (``components``) is
    present, and that each one holding weights (``libraries``: {component: library})
    has its config and weights; ModelError naming the first missing piece."""
    objects = _remote_objects(directory)
    # a gs:// checkpoint's configs-only copy: its listing says which files it has
    names = set(objects) if objects is not None and _configs_only(directory) else None
    index = read_json_file(os.path.join(directory, "model_index.json"))
    for component in components:
        present = os.path.isdir(os.path.join(directory, component)) if names is None else \
            any(name.startswith(f"{component}/") for name in names)
        if component not in index or not present:
            raise ModelError(f"{directory}: missing component '{component}/'")
    for component, library in libraries.items():
        sub = os.path.join(directory, component)
        if not os.path.isfile(os.path.join(sub, "config.json")):
            raise ModelError(f"{directory}: missing {component}/config.json")
        if builtin.shapes_only(directory):
            continue  # a built-in with its configs alone: shapes, never weights
        try:
            if names is None:
                weights.find(sub, component, library)
            else:
                _findlisted(sub, component, library, names)
        except weights.WeightsError as e:
            raise ModelError(str(e)) from None
    if "scheduler" in components and not os.path.isfile(os.path.join(directory, "scheduler",
                                                                     "scheduler_config.json")):
        raise ModelError(f"{directory}: missing scheduler/scheduler_config.json")


def _configs_only(directory: str) -> bool:
    return os.path.dirname(os.path.abspath(directory)) == os.path.abspath(_configs_root())


def _findlisted(component_dir: str, component: str, library: str, names: set) -> None:
    """``weights.find`` for a component whose weights are listed but not downloaded."""
    files = weights.weight_file_names(library)
    if not any(f"{component}/{name}" in names for name in files):
        raise weights.WeightsError(f"{component_dir}: no weights for '{component}' (expected {' or '.join(files)})")
