"""Built-in random scorer models, saved once into the cache and loaded like a user's.

``tiny-clip``, ``tiny-safety-checker`` and ``tiny-aesthetic`` are small enough to compile
in seconds on a CPU, for tests and demos; ``random-clip-vit-l-14``,
``random-safety-checker`` and ``random-aesthetic`` have the real sizes (CLIP ViT-L/14,
SD 1.x's safety checker, LAION's 768-wide head), for benchmarks. Their weights are
random, so their scores mean nothing. Each is built from a fixed seed and written in
the formats users' files come in: a CLIP folder as ``FlaxCLIPModel.save_pretrained``
writes it (config, Flax msgpack, tokenizer, ``preprocessor_config.json``), a checker
folder (CLIP config, Flax msgpack, ``preprocessor_config.json``), an aesthetic head as a
safetensors file with LAION's names; then ``pipeline.model.scorers.models`` loads them by
the same code as any other. Bump a preset's version when its recipe changes.
"""
from __future__ import annotations

import json
import os
import zlib

import numpy as np

from pipeline.model.loading.cache import cache_dir, materialize
from pipeline.model.loading.libraries import quiet_libraries

SEED = 0
MAX_LENGTH = 77
SPECIAL = ("<|startoftext|>", "<|endoftext|>")

_TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2)
_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2)
_L14_VISION = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24,
                   image_size=224, patch_size=14)

CLIPS = {
    # images are resized (24 < the tiny models' 32) and cropped like a real CLIP's
    "tiny-clip": dict(version="tiny-clip-v1", text=_TINY_TEXT, vision=dict(_TINY_VISION, image_size=24, patch_size=6),
                      projection_dim=16),
    "random-clip-vit-l-14": dict(
        version="random-clip-vit-l-14-v1", projection_dim=768, vision=_L14_VISION,
        text=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                  vocab_size=49408)),
}
CHECKERS = {
    "tiny-safety-checker": dict(version="tiny-safety-checker-v1", vision=dict(_TINY_VISION, image_size=20,
                                                                              patch_size=5), projection_dim=16),
    "random-safety-checker": dict(version="random-safety-checker-v1", vision=_L14_VISION, projection_dim=768),
}
HEADS = {
    "tiny-aesthetic": dict(version="tiny-aesthetic-v1", widths=(16, 32, 16, 8, 4, 1)),
    "random-aesthetic": dict(version="random-aesthetic-v1", widths=(768, 1024, 128, 64, 16, 1)),
}
# the indices of the linear layers in LAION's nn.Sequential (dropouts between the first four)
HEAD_LAYERS = (0, 2, 4, 6, 7)
HEAD_FILE = "aesthetic.safetensors"


def _root() -> str:
    return os.path.join(cache_dir(), "models", "scorers")


def random_params(shapes, seed: int):
    """Weights for a tree of ShapeDtypeStructs, leaf by leaf (no initialiser is run), as the
    tiny models draw theirs, with CLIP's embeddings among the embeddings."""
    from pipeline.model.loading import builtin

    return builtin.random_params(shapes, seed, embeddings=("['embedding']", "_embedding']", "embeds']"))


def _write_tokenizer(folder: str) -> None:
    """A byte-level CLIP BPE vocabulary with no merges (512 symbols, 2 specials), saved as
    ``CLIPTokenizer.save_pretrained`` saves one."""
    import tempfile

    from transformers import CLIPTokenizer
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols] + list(SPECIAL))}
    with tempfile.TemporaryDirectory() as scratch:
        vocab_file, merges_file = os.path.join(scratch, "vocab.json"), os.path.join(scratch, "merges.txt")
        with open(vocab_file, "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
        with open(merges_file, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
        CLIPTokenizer(vocab_file, merges_file, model_max_length=MAX_LENGTH).save_pretrained(folder)


def _write_preprocessor(folder: str, image_size: int) -> None:
    from transformers import CLIPImageProcessor

    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size}).save_pretrained(folder)


def _clip_config(preset: dict):
    from transformers import CLIPConfig

    bos, eos = 512, 513  # the byte-level vocabulary's specials
    text = dict(preset["text"])
    text.setdefault("vocab_size", 514)
    return CLIPConfig(text_config=dict(text, max_position_embeddings=MAX_LENGTH, bos_token_id=bos, eos_token_id=eos,
                                       pad_token_id=eos),
                      vision_config=preset["vision"], projection_dim=preset["projection_dim"])


def build_clip(folder: str, name: str) -> None:
    import jax.numpy as jnp
    from transformers import FlaxCLIPModel

    quiet_libraries()
    preset = CLIPS[name]
    model = FlaxCLIPModel(_clip_config(preset), dtype=jnp.float32, _do_init=False)
    params = random_params(model.params_shape_tree, SEED)
    params["logit_scale"] = np.asarray(np.log(1 / 0.07), np.float32)
    model.save_pretrained(folder, params=params)
    _write_tokenizer(folder)
    _write_preprocessor(folder, preset["vision"]["image_size"])


def build_checker(folder: str, name: str) -> None:
    """Random weights, concept thresholds of 0.34 and special-care ones of 0.3: the tiny
    models' noise images then have largest concept scores on both sides of 0, so some are
    flagged and some are not (tests and demos see both)."""
    import jax
    from flax.serialization import msgpack_serialize
    from transformers import CLIPConfig

    from pipeline.model.scorers import safety

    quiet_libraries()
    preset = CHECKERS[name]
    config = CLIPConfig(text_config={}, vision_config=preset["vision"], projection_dim=preset["projection_dim"])
    config.architectures = ["StableDiffusionSafetyChecker"]
    size = preset["vision"]["image_size"]
    params = random_params(safety.param_shapes(safety.module_class()(config), size), SEED + 1)
    params["concept_embeds_weights"] = np.full((safety.CONCEPTS,), 0.34, np.float32)
    params["special_care_embeds_weights"] = np.full((safety.SPECIAL_CARE,), 0.3, np.float32)
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    with open(os.path.join(folder, "flax_model.msgpack"), "wb") as f:
        f.write(msgpack_serialize(jax.tree_util.tree_map(np.asarray, params)))
    _write_preprocessor(folder, size)


def build_head(folder: str, name: str) -> None:
    from safetensors.numpy import save_file

    widths = HEADS[name]["widths"]
    rng = np.random.default_rng([SEED + 2, zlib.crc32(name.encode())])
    tensors = {}
    for index, (n_in, n_out) in zip(HEAD_LAYERS, zip(widths, widths[1:])):
        tensors[f"layers.{index}.weight"] = (rng.standard_normal((n_out, n_in)) * n_in ** -0.5).astype(np.float32)
        tensors[f"layers.{index}.bias"] = (rng.standard_normal(n_out) * 0.1).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, HEAD_FILE))
    with open(os.path.join(folder, "config.json"), "w") as f:  # marks the folder made (cache.materialize)
        json.dump({"aesthetic_head": name, "widths": list(widths)}, f)


def ensure(name: str) -> str:
    """The local folder of the built-in scorer ``name`` (for a head, the folder of its
    file), built once per machine on first use (``cache.materialize``)."""
    for table, build in ((CLIPS, build_clip), (CHECKERS, build_checker), (HEADS, build_head)):
        if name in table:
            target = os.path.join(_root(), table[name]["version"])
            return materialize(target, lambda scratch: build(scratch, name), marker="config.json")
    raise KeyError(name)


NAMES = (*CLIPS, *CHECKERS, *HEADS)
