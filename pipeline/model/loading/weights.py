"""Component weights: PyTorch safetensors (single or sharded) or the libraries' Flax
msgpack, read without torch, and converted once per machine.

A diffusers-format checkpoint keeps each network's weights in its own folder, either
as PyTorch safetensors (``diffusion_pytorch_model.safetensors`` / ``model.safetensors``,
or shards named by their ``.index.json``) or as Flax msgpack written by diffusers' or
transformers' Flax modules (``diffusion_flax_model.msgpack`` / ``flax_model.msgpack``).
Either is read as numpy arrays (safetensors memory-mapped, ``read_mapped``) and mapped to
our networks' names and layouts by their naming rule (``pipeline.model.loading.convert``:
``from_torch``, ``from_flax``), each array in its stored dtype; torch is never imported.
Weights stay on the host until the generator puts them on its devices.

Converting costs more than the bytes: parsing, renaming, transposing, stacking. So each
component's weights are converted once per machine and kept in the promptmill cache as
one safetensors file of Flax names and layouts (``converted``), keyed by the source file
(path, size, mtime, inode), the component's config and what of it the network reads;
every later load memory-maps that file (``read_mapped``): its arrays are views of the
page cache, and their only copy is the one onto the devices.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile

import numpy as np

FLAX_FILES = {"diffusers": "diffusion_flax_model.msgpack", "transformers": "flax_model.msgpack"}
SAFETENSORS_FILES = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}
LIBRARY = {"unet": "diffusers", "vae": "diffusers", "transformer": "diffusers", "text_encoder": "transformers",
           "text_encoder_2": "transformers"}


class WeightsError(ValueError):
    pass


def weight_file_names(library: str) -> tuple[str, ...]:
    """The weight files a component of ``library`` may have, in the order ``find`` prefers
    them: Flax msgpack, PyTorch safetensors, and the index of sharded safetensors."""
    return FLAX_FILES[library], SAFETENSORS_FILES[library], f"{SAFETENSORS_FILES[library]}.index.json"


def find(component_dir: str, component: str, library: str | None = None) -> tuple[str, str]:
    """("flax" | "safetensors" | "sharded", path) of a component's weights (``library``:
    whose file names; default by the component's name): Flax msgpack wins, then a single
    safetensors file, then the index of sharded ones."""
    library = library or LIBRARY[component]
    for kind, name in zip(("flax", "safetensors", "sharded"), weight_file_names(library)):
        path = os.path.join(component_dir, name)
        if os.path.isfile(path):
            return kind, path
    raise WeightsError(f"{component_dir}: no weights for '{component}' (expected "
                       f"{' or '.join(weight_file_names(library))})")


def source_files(source: str) -> list[str]:
    """The files whose bytes a component's weights are: ``source`` itself, or for the
    index of sharded safetensors the index and every shard it names."""
    if not source.endswith(".index.json"):
        return [source]
    try:
        with open(source) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise WeightsError(f"{source}: not a readable safetensors index ({type(e).__name__}: {e})") from e
    return [source] + [os.path.join(os.path.dirname(source), os.path.basename(shard)) for shard in shards]


# safetensors' dtype names (https://github.com/huggingface/safetensors, the format's spec)
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
                       "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_mapped(path: str) -> dict[str, np.ndarray]:
    """{name: array} of a safetensors file, memory-mapped: each array is a read-only view
    of the file (nothing is read until used, and pages are shared with other processes).

    The format is an 8-byte little-endian header length, a JSON header ({name: dtype,
    shape, data_offsets}) and the bytes; bf16 is read through ml_dtypes (jax's)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        size = os.path.getsize(path) - 8 - length
        data = np.memmap(path, np.uint8, mode="r", offset=8 + length) if size else np.zeros(0, np.uint8)
        arrays = {}
        for name, info in header.items():
            if name == "__metadata__" or name.startswith(_PADDING):
                continue
            start, end = info["data_offsets"]
            if end > size or start > end:
                raise ValueError(f"{name}'s bytes {start}..{end} are past the end of the data ({size} bytes)")
            arrays[name] = np.asarray(data[start:end]).view(_dtype(info["dtype"])).reshape(info["shape"])
        return arrays
    except FileNotFoundError:
        raise
    except Exception as e:  # a truncated or foreign file: name it
        raise WeightsError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def _dtype(name: str):
    if name == "BF16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    if name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {name} is not supported")
    return _SAFETENSORS_DTYPES[name]


_PADDING = "__padding__"  # the names of the filler entries ``write_safetensors`` adds; never read as weights
ALIGN = 64  # bytes: XLA's CPU client uses a host array in place when it is this aligned


def write_safetensors(path: str, arrays: dict[str, np.ndarray], align: bool = True,
                      metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of ``arrays`` ({name: array}), written array by array (no copy
    of the whole in memory), into a scratch file renamed into place: processes that
    write the same file at once each write a whole one, and no reader sees half of one.

    Every array starts ``ALIGN`` bytes into a page-aligned mapping of the file, so that
    devices that share the host's memory (CPU) can use the mapped arrays without a copy:
    the header is padded with spaces, and an array that would start unaligned follows a
    small filler entry of its own (the format allows no unnamed gap). ``align=False``
    writes the arrays back to back with no filler, as PyTorch's ``save_file`` does (a
    checkpoint for other programs to read: the built-in random ones); ``metadata`` is the
    header's ``__metadata__`` (PyTorch's files say {"format": "pt"})."""
    names = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}
    header, order, offset = ({"__metadata__": dict(metadata)} if metadata else {}), [], 0
    for name, array in arrays.items():
        dtype = "BF16" if array.dtype.name == "bfloat16" else names.get(array.dtype)
        if dtype is None:
            raise WeightsError(f"{path}: cannot store {name} of dtype {array.dtype}")
        gap = -offset % ALIGN if align else 0
        if gap:
            filler = f"{_PADDING}.{len(order)}"
            header[filler] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            order.append(np.zeros(gap, np.uint8))
            offset += gap
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        order.append(array)
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % (ALIGN if align else 8))  # the data starts aligned too
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=".weights-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
            for array in order:
                f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        os.chmod(scratch, 0o644)  # mkstemp made it private; the cache is shared
        os.replace(scratch, path)
    finally:
        if os.path.exists(scratch):
            os.remove(scratch)


CONVERTED_VERSION = "3"  # bump whenever the conversion's result could change


def converted_path(source: str, component_dir: str, variant: str = "") -> str:
    """Where the converted weights of ``source`` (a component's weights file, or the index
    of its shards) are kept: named by its files (path, size, mtime, inode: a changed file
    is converted anew; ``source_files``) and the component's config (the network they were
    checked against), then by ``variant``: what of the network is read (e.g. a text
    encoder's layers up to the deepest state a family reads)."""
    from pipeline.model.loading.cache import cache_dir

    parts = [CONVERTED_VERSION]
    for path in source_files(source):
        stat = os.stat(path)
        parts += [os.path.abspath(path), str(stat.st_size), str(stat.st_mtime_ns), str(stat.st_ino)]
    with open(os.path.join(component_dir, "config.json"), "rb") as f:
        config = f.read()
    key = hashlib.sha256("\0".join(parts).encode() + b"\0" + config).hexdigest()[:32]
    read = hashlib.sha256(variant.encode()).hexdigest()[:8]
    return os.path.join(cache_dir(), "weights", f"{key}-{read}.safetensors")


def converted_files(directory: str) -> list[str]:
    """The converted files (``converted_path``, any variant) of a checkpoint's components'
    weights on this machine, those that exist."""
    import glob

    found = []
    for component in LIBRARY:
        component_dir = os.path.join(directory, component)
        if os.path.isfile(os.path.join(component_dir, "config.json")):
            named = converted_path(find(component_dir, component)[1], component_dir)
            found += sorted(glob.glob(named.rsplit("-", 1)[0] + "-*.safetensors"))
    return found


def converted(source: str, component_dir: str, convert, variant: str = "") -> dict:
    """Flax params of ``source``: memory-mapped from its converted file when this machine
    converted it before, else ``convert()`` (read, converted and checked against the
    module's shapes), kept as that file for the next load; processes converting the same
    file at once take turns on a file lock, so the second maps what the first wrote. An
    unreadable converted file is logged and replaced."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    from pipeline.core import logs

    from filelock import FileLock

    def mapped():
        return unflatten_dict({tuple(name.split("/")): array for name, array in read_mapped(path).items()})

    path = converted_path(source, component_dir, variant)
    if os.path.isfile(path):
        try:
            return mapped()
        except WeightsError as e:
            logs.event("converted_weights_unreadable", path=path, error=str(e))
            os.remove(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with FileLock(f"{path}.lock"):  # processes of one machine convert it once: the others wait, then map it
        if os.path.isfile(path):
            return mapped()
        params = convert()
        write_safetensors(path, {"/".join(key): np.asarray(value) for key, value in flatten_dict(params).items()})
    return params


def read_msgpack(path: str) -> dict[tuple[str, ...], np.ndarray]:
    """{key path: numpy array} of a Flax msgpack file (as diffusers' and transformers' Flax
    modules save their params), in its stored dtypes; nothing goes to a device."""
    from flax.serialization import msgpack_restore
    from flax.traverse_util import flatten_dict

    with open(path, "rb") as f:
        data = f.read()
    try:
        tree = msgpack_restore(data)
    except Exception as e:  # a truncated or foreign file: name it
        raise WeightsError(f"{path}: not a readable Flax msgpack file ({e})") from e
    return {key: np.asarray(value) for key, value in flatten_dict(tree).items()}


# ---- sharded safetensors: a checkpoint split over several files, named by an index

def read_sharded(component_dir: str, index_name: str) -> dict[str, np.ndarray]:
    """{name: array} of a component whose safetensors weights are split over several
    files: ``index_name`` (e.g. ``model.safetensors.index.json``) holds a ``weight_map``
    of each weight's file, as ``save_pretrained`` writes it. Every file is memory-mapped
    (``read_mapped``) and nothing is copied. WeightsError naming the index, the file or
    the weight when the index is unreadable, names a file outside the folder or one that
    is missing, or maps a weight its file does not hold."""
    index_path = os.path.join(component_dir, index_name)
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not a {weight: file} object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"{index_path}: not a readable safetensors index ({type(e).__name__}: {e})") from e
    arrays: dict[str, np.ndarray] = {}
    for file in sorted(set(weight_map.values())):
        if os.path.basename(file) != file or file.startswith("."):
            raise WeightsError(f"{index_path}: shard {file!r} is not a file name in {component_dir}")
        shard = os.path.join(component_dir, file)
        if not os.path.isfile(shard):
            raise WeightsError(f"{index_path}: shard {file} is missing from {component_dir}")
        held = read_mapped(shard)
        wanted = [name for name, owner in weight_map.items() if owner == file]
        absent = [name for name in wanted if name not in held]
        if absent:
            raise WeightsError(f"{index_path}: {file} lacks {len(absent)} weight(s) the index puts there, e.g. "
                               f"{', '.join(absent[:5])}")
        arrays.update({name: held[name] for name in wanted})
    return arrays


def read_weights(path: str) -> dict[str, np.ndarray]:
    """{name: array} of a safetensors file, or of the shards a ``.index.json`` names,
    memory-mapped (``read_mapped``, ``read_sharded``)."""
    if path.endswith(".index.json"):
        return read_sharded(os.path.dirname(path), os.path.basename(path))
    return read_mapped(path)


def read_safetensors_weights(component_dir: str, library: str) -> dict[str, np.ndarray]:
    """{name: array} of a component's PyTorch safetensors weights, memory-mapped: the
    single file ``SAFETENSORS_FILES[library]`` or, when it is absent, the shards its
    ``.index.json`` names (``read_sharded``)."""
    name = SAFETENSORS_FILES[library]
    single = os.path.join(component_dir, name)
    if os.path.isfile(single):
        return read_mapped(single)
    if os.path.isfile(os.path.join(component_dir, f"{name}.index.json")):
        return read_sharded(component_dir, f"{name}.index.json")
    raise WeightsError(f"{component_dir}: no PyTorch safetensors weights (expected {name} or {name}.index.json)")


def converted_components(directory: str, rules: dict, libraries: dict, title: str, flax_rules: dict | None = None,
                         variants: dict | None = None) -> dict:
    """{component: params} of a checkpoint of promptmill's own networks: each component's
    weights (``libraries[component]``'s file names), converted once per machine and
    memory-mapped after (``converted``; ``variants[component]``: what of it is read). PyTorch
    safetensors go through ``rules[component](state, where)``, Flax msgpack through
    ``flax_rules[component](flat, where)`` (the networks' naming rules, in the stored dtype); a
    component stored as Flax msgpack without a rule for it is refused, naming the family
    (``title``)."""
    from pipeline.model.loading.checkpoint import ModelError

    flax_rules, variants = flax_rules or {}, variants or {}
    params = {}
    for component, rule in rules.items():
        component_dir = os.path.join(directory, component)
        library = libraries[component]
        kind, source = find(component_dir, component, library)
        if kind == "flax":
            if component not in flax_rules:
                raise ModelError(f"{component_dir}: {title} reads PyTorch safetensors weights, not Flax msgpack")
            params[component] = converted(
                source, component_dir, lambda rule=flax_rules[component], source=source, component_dir=component_dir:
                rule(read_msgpack(source), component_dir), variants.get(component, ""))
            continue
        params[component] = converted(
            source, component_dir,
            lambda rule=rule, component_dir=component_dir, library=library: rule(
                read_safetensors_weights(component_dir, library), component_dir), variants.get(component, ""))
    return params
