"""The built-in random models' mechanism: what every family's presets share.

A family names its built-in random models (``--model tiny``, ``random-flux``, ...) in
its own folder (``families/<name>/presets.py``: configs, and how to build and save
them in diffusers format) and the registry gathers them (``pipeline.model.families``:
``builtin_folder``). Here is what they have in common, and no family: building a
model once per machine into the cache (``ensure``), weights drawn leaf by leaf
(``random_params``, ``random_weights``), the tokenizer files of a byte-level CLIP vocabulary, and the
mark of a real-size model saved with its configs alone (``SHAPES_ONLY``: its weights
are never written; the TPU check, FLOP counts and memory benchmarks need its shapes
alone, and it cannot run). Their images are noise.
"""
from __future__ import annotations

import json
import os
import zlib

from pipeline.model.loading.cache import cache_dir, is_made, materialize

SHAPES_ONLY = "promptmill_shapes_only.json"  # marks a built-in model saved without weights
# the diffusers and transformers releases whose on-disk format the built-in models are written in
# (their configs' ``_diffusers_version`` and ``transformers_version``): the last with Flax
DIFFUSERS_VERSION, TRANSFORMERS_VERSION = "0.39.0", "4.57.6"
CLIP_MAX_LENGTH = 77  # the built-in CLIP tokenizers' length, as CLIP's
CLIP_SPECIAL = ("<|startoftext|>", "<|endoftext|>")


def write_json(path: str, data: dict) -> None:
    """A config file as diffusers writes them: indented, keys sorted, a final newline."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def models_dir() -> str:
    """Where the built-in models are built, once per machine."""
    return os.path.join(cache_dir(), "models")


def ensure(version: str, build, shapes: bool = False, shapes_only_preset: bool = False) -> str:
    """The cached folder of a built-in model (``version``: its folder's name), built on
    first use by ``build(folder, weights)`` (once, even when several host processes ask at
    the same time: see ``cache.materialize``).

    ``shapes``: its configs alone will do (a program is compiled from its shapes): the
    whole model if it was built already, else its configs and tokenizers, built without
    weights (a minute and gigabytes less for the real-size presets). A
    ``shapes_only_preset`` is never built with weights."""
    whole = os.path.join(models_dir(), version)
    if shapes_only_preset:
        return materialize(whole, lambda scratch: build(scratch, False))
    if not shapes or is_made(whole):
        return materialize(whole, lambda scratch: build(scratch, True))
    return materialize(f"{whole}-shapes", lambda scratch: build(scratch, False))


def ensure_preset(presets: dict, name: str, build, shapes: bool = False) -> str:
    """The folder of the built-in model ``name`` of a family's ``presets`` ({name: preset,
    each with its ``version`` and maybe ``shapes_only``}), built by ``build(folder, name,
    weights)`` once per machine (``ensure``)."""
    preset = presets[name]
    return ensure(preset["version"], lambda folder, weights: build(folder, name, weights),
                  shapes=shapes, shapes_only_preset=bool(preset.get("shapes_only")))


def shapes_only(directory: str) -> bool:
    """Whether ``directory`` is a built-in model saved with its configs alone."""
    return os.path.isfile(os.path.join(directory, SHAPES_ONLY))


def mark_shapes_only(directory: str, name: str) -> None:
    """Mark a built-in model's folder as saved without weights (``shapes_only``)."""
    with open(os.path.join(directory, SHAPES_ONLY), "w") as f:
        json.dump({"preset": name, "why": "a built-in random model saved without weights: its shapes are for the "
                   "TPU check, FLOP counts and memory benchmarks"}, f)


def random_params(shapes, seed: int, embeddings: tuple[str, ...] = ("['embedding']",)):
    """Weights for a tree of ShapeDtypeStructs, from numpy, leaf by leaf.

    Flax's own initialisers would run the whole model eagerly (tens of seconds on a
    CPU); the shapes come from ``jax.eval_shape`` instead and each leaf is drawn from
    a generator seeded by (seed, leaf path), so the result does not depend on order:
    ones for norms' scales, zeros for biases, else normal with 1/sqrt(fan-in) (0.02 for
    the parameters whose names end in one of ``embeddings``).
    """
    import jax
    import numpy as np

    def leaf(path, spec):
        name = jax.tree_util.keystr(path)
        if name.endswith("['scale']"):
            return np.ones(spec.shape, np.float32)
        if name.endswith("['bias']"):
            return np.zeros(spec.shape, np.float32)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        fan_in = int(np.prod(spec.shape[:-1])) or 1
        std = 0.02 if name.endswith(embeddings) else fan_in ** -0.5
        return (rng.standard_normal(spec.shape) * std).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, shapes)


def clip_vocabulary() -> dict[str, int]:
    """The built-in models' byte-level CLIP BPE vocabulary, which needs no merges: the 256
    byte symbols, each again ending a word (``</w>``), then the 2 specials (``CLIP_SPECIAL``)."""
    from pipeline.model.loading.tokenizer import byte_symbols

    symbols = byte_symbols()
    return {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols] + list(CLIP_SPECIAL))}


def write_clip_tokenizer_files(folder: str) -> tuple[str, str]:
    """The built-in vocabulary (``clip_vocabulary``) as CLIP's tokenizer files: (vocab.json,
    merges.txt)."""
    vocab = clip_vocabulary()
    vocab_file, merges_file = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merges_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    return vocab_file, merges_file


def random_flat_params(shapes, seed: int, stacked=lambda path: False):
    """Weights for flat Flax param shapes ({path: shape}), float32 numpy, leaf by leaf:
    norms' scales and batch-norm variances 1, biases and means 0, embeddings N(0, 0.02),
    kernels N(0, 1/fan_in) (fan_in without the leading layer axis of a ``stacked`` one);
    each leaf's generator seeded by (seed, its path)."""
    import numpy as np

    params = {}
    for path, shape in shapes.items():
        if path[-1] in ("scale", "running_var", "weight"):
            params[path] = np.ones(shape, np.float32)
        elif path[-1] in ("bias", "running_mean"):
            params[path] = np.zeros(shape, np.float32)
        else:
            rng = np.random.default_rng([seed, zlib.crc32("/".join(path).encode())])
            fan_in = int(np.prod(shape[1 if stacked(path) else 0:-1])) or 1
            std = 0.02 if path[-1] == "embedding" else fan_in ** -0.5
            params[path] = (rng.standard_normal(shape) * std).astype(np.float32)
    return params


def random_weights(network, config, seed: int) -> dict:
    """A network's random weights, as a built-in model's files hold them: drawn leaf by leaf
    from ``seed`` (``random_flat_params``; a scanned stack's kernels at one block's fan-in)
    for ``network`` (a ``convert.Network``) of ``config``, in PyTorch's names and layouts
    (``network.to_torch``)."""
    from pipeline.model.loading import convert

    stacked = lambda path: convert.stack_of(path, network.torch_names) is not None  # noqa: E731
    return network.to_torch(convert.unflatten(random_flat_params(network.param_shapes(config), seed, stacked)))


def random_torch_state(shapes: dict[str, tuple[int, ...]], seed: int) -> dict:
    """Weights for a PyTorch state dict's {name: shape}, float32 numpy, leaf by leaf, each
    seeded by (seed, its name): biases 0, a norm's weight (1-D) 1, a Linear's or a
    convolution's weight N(0, 1/fan_in) (fan_in: every axis but the first)."""
    import numpy as np

    state = {}
    for name, shape in shapes.items():
        if name.endswith(".bias"):
            state[name] = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            state[name] = np.ones(shape, np.float32)
        else:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            state[name] = (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
    return state
