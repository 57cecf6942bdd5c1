"""Built-in random scorer models, saved once into the cache and loaded like a user's.

``tiny-clip``, ``tiny-safety-checker`` and ``tiny-aesthetic`` are small enough to compile
in seconds on a CPU, for tests and demos; ``random-clip-vit-l-14``,
``random-safety-checker`` and ``random-aesthetic`` have the real sizes (CLIP ViT-L/14,
SD 1.x's safety checker, LAION's 768-wide head), for benchmarks. Their weights are
random, so their scores mean nothing. Each is built from a fixed seed by our own networks
and written in the formats users' files come in: a CLIP folder as transformers'
``CLIPModel.save_pretrained`` writes it (config, PyTorch-named safetensors, tokenizer,
``preprocessor_config.json``), a checker folder as diffusers'
``StableDiffusionSafetyChecker`` (CLIP config, safetensors, ``preprocessor_config.json``),
an aesthetic head as a safetensors file with LAION's names; then
``pipeline.model.scorers.models`` loads them by the same code as any other. Bump a
preset's version when its recipe changes.
"""
from __future__ import annotations

import json
import os
import zlib

import numpy as np

from pipeline.model.loading import builtin
from pipeline.model.loading.cache import cache_dir, materialize

SEED = 0
MAX_LENGTH = 77
SPECIAL = ("<|startoftext|>", "<|endoftext|>")

_TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2)
_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2)
_L14_VISION = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24,
                   image_size=224, patch_size=14)

CLIPS = {
    # images are resized (24 < the tiny models' 32) and cropped like a real CLIP's
    "tiny-clip": dict(version="tiny-clip-v2", text=_TINY_TEXT, vision=dict(_TINY_VISION, image_size=24, patch_size=6),
                      projection_dim=16),
    "random-clip-vit-l-14": dict(
        version="random-clip-vit-l-14-v2", projection_dim=768, vision=_L14_VISION,
        text=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                  vocab_size=49408)),
}
CHECKERS = {
    "tiny-safety-checker": dict(version="tiny-safety-checker-v3", vision=dict(_TINY_VISION, image_size=20,
                                                                              patch_size=5), projection_dim=16),
    "random-safety-checker": dict(version="random-safety-checker-v2", vision=_L14_VISION, projection_dim=768),
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


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_preprocessor(folder: str, image_size: int) -> None:
    """``preprocessor_config.json`` as transformers' ``CLIPImageProcessor.save_pretrained``
    writes CLIP's: bicubic resize of the shorter side, centre crop, CLIP's mean and std."""
    from pipeline.model.scorers.preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    _write_json(os.path.join(folder, "preprocessor_config.json"), {
        "crop_size": {"height": image_size, "width": image_size}, "do_center_crop": True, "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": list(OPENAI_CLIP_MEAN),
        "image_processor_type": "CLIPImageProcessor", "image_std": list(OPENAI_CLIP_STD), "resample": 3,
        "rescale_factor": 1 / 255, "size": {"shortest_edge": image_size}})


def _clip_config(preset: dict, architecture: str) -> dict:
    """A ``config.json`` as transformers' ``CLIPConfig`` saves one, the text tower's special
    ids the built-in vocabulary's (a checker's text tower is transformers' default)."""
    vocab = builtin.clip_vocabulary()
    bos, eos = (vocab[token] for token in SPECIAL)
    text = dict(dict(vocab_size=len(vocab)), **preset.get("text", {}), max_position_embeddings=MAX_LENGTH,
                bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, model_type="clip_text_model")
    vision = dict(preset["vision"], model_type="clip_vision_model", hidden_act="quick_gelu", num_channels=3)
    return {"architectures": [architecture], "model_type": "clip", "projection_dim": preset["projection_dim"],
            "logit_scale_init_value": 2.6592, "text_config": text if "text" in preset else {}, "vision_config": vision,
            "dtype": "float32", "transformers_version": builtin.TRANSFORMERS_VERSION}


def _write_weights(folder: str, state: dict) -> None:
    from pipeline.model.loading import weights

    weights.write_safetensors(os.path.join(folder, weights.SAFETENSORS_FILES["transformers"]),
                              dict(sorted(state.items())), align=False, metadata={"format": "pt"})


def _random(shapes: dict, names, seed: int) -> dict:
    """Weights for flat param shapes, as the tiny models draw theirs (``builtin.random_flat_params``),
    CLIP's class embedding among the embeddings (N(0, 0.02))."""
    from pipeline.model.loading import convert

    params = builtin.random_flat_params(shapes, seed, lambda path: convert.stack_of(path, names) is not None)
    for path in params:
        if path[-1] == "class_embedding":
            params[path] = params[path] * np.float32(0.02)
    return convert.unflatten(params)


def build_clip(folder: str, name: str) -> None:
    from pipeline.model.loading import tokenizer
    from pipeline.model.scorers import towers

    preset = CLIPS[name]
    os.makedirs(folder, exist_ok=True)
    config = _clip_config(preset, "CLIPModel")
    shapes = towers.NETWORK.param_shapes(towers.ClipConfig.from_dict(config))
    params = _random(shapes, towers.MODEL_TORCH_NAMES, SEED)
    params["logit_scale"] = np.asarray(np.log(1 / 0.07), np.float32)
    _write_weights(folder, towers.NETWORK.to_torch(params))
    tokenizer.write_clip(folder, builtin.clip_vocabulary(), [], model_max_length=MAX_LENGTH)
    _write_preprocessor(folder, preset["vision"]["image_size"])
    _write_json(os.path.join(folder, "config.json"), config)  # last: it marks the folder made


def build_checker(folder: str, name: str) -> None:
    """Random weights, concept thresholds of 0.5 and special-care ones of 0.3: the tiny
    models' noise images then have largest concept scores on both sides of 0, so some are
    flagged and some are not (tests and demos see both)."""
    from pipeline.model.scorers import safety, towers

    preset = CHECKERS[name]
    os.makedirs(folder, exist_ok=True)
    config = _clip_config(preset, "StableDiffusionSafetyChecker")
    shapes = safety.NETWORK.param_shapes(towers.ClipConfig.from_dict(config, text=False))
    params = _random(shapes, safety.TORCH_NAMES, SEED + 1)
    params["concept_embeds_weights"] = np.full((safety.CONCEPTS,), 0.5, np.float32)
    params["special_care_embeds_weights"] = np.full((safety.SPECIAL_CARE,), 0.3, np.float32)
    _write_weights(folder, safety.NETWORK.to_torch(params))
    _write_preprocessor(folder, preset["vision"]["image_size"])
    _write_json(os.path.join(folder, "config.json"), config)


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

