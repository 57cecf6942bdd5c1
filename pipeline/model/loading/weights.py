"""Component weights: Flax msgpack, or PyTorch safetensors converted without torch.

A diffusers-format checkpoint keeps each network's weights in its own folder, either
as Flax msgpack (``diffusion_flax_model.msgpack`` / ``flax_model.msgpack``) or as
PyTorch safetensors (``diffusion_pytorch_model.safetensors`` / ``model.safetensors``).
Safetensors are read as numpy arrays and mapped to Flax names and layouts with the
libraries' own renaming rules; the target tree comes from ``jax.eval_shape``, so no
random initialisation runs and torch is never imported. Flax msgpack is read the same
way, as numpy arrays checked against that tree. Weights stay on the host until the
generator puts them on its devices.

Converting costs more than the bytes: parsing, renaming, transposing, and tracing each
module's init for its shapes. So each component's weights are converted once per
machine and kept in the promptmill cache as one safetensors file of Flax names and
layouts (``converted``), keyed by the source file (path, size, mtime, inode) and the
component's config; every later load memory-maps that file (``read_mapped``): its
arrays are views of the page cache, and their only copy is the one onto the devices.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import types

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


def _check_complete(where: str, shapes: dict, flat: dict) -> None:
    missing = sorted("/".join(k) for k in set(shapes) - set(flat))
    if missing:
        raise WeightsError(f"{where}: {len(missing)} weight(s) missing, e.g. {', '.join(missing[:5])}")
    for key, spec in shapes.items():
        if tuple(flat[key].shape) != tuple(spec.shape):
            raise WeightsError(f"{where}: weight {'/'.join(key)} has shape {tuple(flat[key].shape)}, "
                               f"the model expects {tuple(spec.shape)}")


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


CONVERTED_VERSION = "2"  # bump whenever the conversion's result could change


def converted_path(source: str, component_dir: str) -> str:
    """Where the converted weights of ``source`` (a component's weights file, or the index
    of its shards) are kept: keyed by its files (path, size, mtime, inode: a changed file
    is converted anew; ``source_files``), the component's config (the module they were
    checked against) and the libraries whose renaming rules convert them."""
    import diffusers
    import transformers

    from pipeline.model.loading.cache import cache_dir

    parts = [CONVERTED_VERSION]
    for path in source_files(source):
        stat = os.stat(path)
        parts += [os.path.abspath(path), str(stat.st_size), str(stat.st_mtime_ns), str(stat.st_ino)]
    with open(os.path.join(component_dir, "config.json"), "rb") as f:
        config = f.read()
    parts += [diffusers.__version__, transformers.__version__]
    key = hashlib.sha256("\0".join(parts).encode() + b"\0" + config).hexdigest()[:32]
    return os.path.join(cache_dir(), "weights", f"{key}.safetensors")


def converted_files(directory: str) -> list[str]:
    """The converted files (``converted_path``) of a checkpoint's components' weights on
    this machine, those that exist."""
    found = []
    for component in LIBRARY:
        component_dir = os.path.join(directory, component)
        if os.path.isfile(os.path.join(component_dir, "config.json")):
            path = converted_path(find(component_dir, component)[1], component_dir)
            if os.path.isfile(path):
                found.append(path)
    return found


def converted(source: str, component_dir: str, convert) -> dict:
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

    path = converted_path(source, component_dir)
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


def _read_msgpack(path: str) -> dict:
    """The nested dict of numpy arrays in a Flax msgpack file (nothing goes to a device)."""
    from flax.serialization import msgpack_restore

    with open(path, "rb") as f:
        data = f.read()
    try:
        return msgpack_restore(data)
    except Exception as e:  # a truncated or foreign file: name it
        raise WeightsError(f"{path}: not a readable Flax msgpack file ({e})") from e


def params_from_msgpack(shapes_tree, path: str) -> dict:
    """Flax params from a Flax msgpack file, checked against the module's shapes: numpy
    arrays on the host, as stored, so the cast to the run's dtype happens on the host
    and each device receives its weights in one transfer."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    shapes = flatten_dict(shapes_tree)
    flat = {key: np.asarray(value) for key, value in flatten_dict(_read_msgpack(path)).items() if key in shapes}
    _check_complete(path, shapes, flat)
    return unflatten_dict(flat)


def _shapes(module):
    """The params' shapes of a diffusers Flax module, from its config alone: no
    initialiser runs, and its trace is kept (``shapes.diffusers_shapes``)."""
    from pipeline.model.loading.shapes import diffusers_shapes

    return diffusers_shapes(module)


def diffusers_params_from_safetensors(module, path: str) -> dict:
    """Flax params for a diffusers Flax module (UNet, VAE) from PyTorch safetensors."""
    from diffusers.models.modeling_flax_pytorch_utils import rename_key, rename_key_and_reshape_tensor
    from flax.traverse_util import flatten_dict, unflatten_dict

    shapes = flatten_dict(_shapes(module))
    flat = {}
    for pt_key, tensor in read_weights(path).items():
        key, tensor = rename_key_and_reshape_tensor(tuple(rename_key(pt_key).split(".")), tensor, shapes)
        if key in shapes:  # anything else (buffers, unused heads) is not a weight of the Flax module
            flat[key] = np.asarray(tensor, dtype=np.float32)
    _check_complete(path, shapes, flat)
    return unflatten_dict(flat)


def transformers_params_from_safetensors(module, path: str) -> dict:
    """Flax params for a transformers Flax CLIP text model (``shapes.TransformersModel``)."""
    from flax.traverse_util import flatten_dict, unflatten_dict
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    shapes = flatten_dict(module.params_shape_tree)
    # The converter only reads the target's key names and shapes and its prefix.
    target = types.SimpleNamespace(params=module.params_shape_tree, base_model_prefix=module.base_model_prefix)
    converted = flatten_dict(convert_pytorch_state_dict_to_flax(read_weights(path), target))
    flat = {k: np.asarray(v, dtype=np.float32) for k, v in converted.items() if k in shapes}  # drops position_ids
    _check_complete(path, shapes, flat)
    return unflatten_dict(flat)


def load_diffusers(cls, directory: str, component: str, dtype, weights_file: str | None = None,
                   abstract: bool = False):
    """(module, params) of a UNet or VAE folder, whatever its weight format; with
    ``weights_file`` (PyTorch safetensors), the folder's config with that file's weights.
    ``abstract``: params as float32 ``jax.ShapeDtypeStruct``s, from the config alone (no
    weight is read or initialised)."""
    component_dir = os.path.join(directory, component)
    module = cls.from_config(cls.load_config(component_dir), dtype=dtype)
    if abstract:
        return module, _shapes(module)
    kind, path = ("safetensors", weights_file) if weights_file else find(component_dir, component)
    if kind == "flax":
        return module, converted(path, component_dir, lambda: params_from_msgpack(_shapes(module), path))
    return module, converted(path, component_dir, lambda: diffusers_params_from_safetensors(module, path))


def load_transformers(cls, directory: str, component: str, dtype, abstract: bool = False):
    """(module, params) of a CLIP text encoder folder, whatever its weight format;
    ``abstract``: see ``load_diffusers``."""
    import jax
    from transformers import CLIPTextConfig

    from pipeline.model.loading.shapes import transformers_model

    component_dir = os.path.join(directory, component)
    # no random initialisation of weights the file replaces anyway (the eager init took most
    # of a small model's load time); its shapes traced once per machine, built once per process
    module = transformers_model(cls, CLIPTextConfig.from_pretrained(component_dir), dtype)
    if abstract:  # a copy of the tree: the model is shared
        return module, jax.tree_util.tree_map(lambda leaf: leaf, module.params_shape_tree)
    kind, path = find(component_dir, component)
    if kind == "flax":
        return module, converted(path, component_dir, lambda: params_from_msgpack(module.params_shape_tree, path))
    return module, converted(path, component_dir, lambda: transformers_params_from_safetensors(module, path))


def param_shapes(directory: str, component: str) -> dict:
    """{flat parameter path: shape} of a component's Flax network, from its config alone
    (``abstract``: no weights are read and no initialiser runs)."""
    import jax.numpy as jnp
    from flax.traverse_util import flatten_dict

    if LIBRARY[component] == "diffusers":
        from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel

        cls = FlaxUNet2DConditionModel if component == "unet" else FlaxAutoencoderKL
        _, tree = load_diffusers(cls, directory, component, jnp.float32, abstract=True)
    else:
        from transformers import FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

        cls = FlaxCLIPTextModelWithProjection if component == "text_encoder_2" else FlaxCLIPTextModel
        _, tree = load_transformers(cls, directory, component, jnp.float32, abstract=True)
    return {path: tuple(leaf.shape) for path, leaf in flatten_dict(tree).items()}


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


def converted_components(directory: str, rules: dict, libraries: dict, title: str) -> dict:
    """{component: params} of a checkpoint of promptmill's own networks: each component's
    PyTorch safetensors (``libraries[component]``'s file names), converted once per machine
    by ``rules[component](state, where)`` (the networks' naming rule, in the stored dtype)
    and memory-mapped after (``converted``). A component stored as Flax msgpack is refused,
    naming the family (``title``)."""
    from pipeline.model.loading.checkpoint import ModelError

    params = {}
    for component, rule in rules.items():
        component_dir = os.path.join(directory, component)
        library = libraries[component]
        kind, source = find(component_dir, component, library)
        if kind == "flax":
            raise ModelError(f"{component_dir}: {title} reads PyTorch safetensors weights, not Flax msgpack")
        params[component] = converted(
            source, component_dir,
            lambda rule=rule, component_dir=component_dir, library=library: rule(
                read_safetensors_weights(component_dir, library), component_dir))
    return params
