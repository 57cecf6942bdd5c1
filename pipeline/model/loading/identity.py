"""What a checkpoint is: its fingerprint, its file table and the checks against them.

``fingerprint`` pins a checkpoint's bytes (a ``gs://`` checkpoint's through its
objects' checksums: planning downloads only its configs, and hosts check it by listing
it, ``check_objects``); ``file_table`` is what a plan writes for hosts to check their
copy against (``check_files``), each file's sha256 remembered while the file is
unchanged; ``configs_digest`` is what a checkpoint's programs are built from; and
``model_fingerprint`` pins what a run samples with, the checkpoint with its ``--unet``
and ``--lora`` files.
"""
from __future__ import annotations

import hashlib
import json
import os

from pipeline.model.loading.builtin import SHAPES_ONLY
from pipeline.model.loading.cache import cache_dir
from pipeline.model.loading.checkpoint import ModelError
from pipeline.model.loading.fetch import CHECKSUMS, CONFIG_SUFFIXES, listed, remote_objects


def listing_fingerprint(objects: dict) -> str:
    """sha256 over each object's relative name, size, md5 and crc32c (``fetch.listed``), in name order."""
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


def _files(directory: str) -> list[tuple[str, str]]:
    """(relative name, path) of every file of a checkpoint, in a fixed order."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            found.append((os.path.relpath(path, directory).replace(os.sep, "/"), path))
    return found


# what a saved config records of how it was saved, never of the network: a built-in model's
# configs-only copy (``builtin.SHAPES_ONLY``) and its whole copy differ in these alone
_SAVED_BY = ("architectures", "_name_or_path", "transformers_version", "_diffusers_version", "_commit_hash")


def configs_digest(directory: str) -> str:
    """sha256 of what a checkpoint's programs are built from: its configs alone
    (``CONFIG_SUFFIXES``: model_index.json, the components' and the scheduler's configs,
    the tokenizers' files), by relative name and content, less what only records how a
    file was saved (``_SAVED_BY``; the built-in models' configs-only mark). Weights change
    values, never a program; their shapes come from the configs."""
    digest = hashlib.sha256()
    for relative, path in _files(directory):
        if not relative.endswith(CONFIG_SUFFIXES) or relative == SHAPES_ONLY:
            continue
        with open(path, "rb") as f:
            content = f.read()
        if relative.endswith(".json"):
            try:
                config = json.loads(content)
            except ValueError:
                config = None
            if isinstance(config, dict):
                content = json.dumps({k: v for k, v in config.items() if k not in _SAVED_BY}, sort_keys=True).encode()
        digest.update(relative.encode() + b"\0" + content + b"\0")
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
    itself, or its copy in the cache (``fetch.fetch_remote``, whole or configs only), which
    has the same fingerprint: it is keyed by those checksums and was checked against them
    as it downloaded."""
    from pipeline.io import storage

    if storage.is_gcs(directory):
        return listing_fingerprint(listed(directory))
    objects = remote_objects(directory)
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
