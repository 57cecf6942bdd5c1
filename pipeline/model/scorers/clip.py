"""CLIP as a scorer: a transformers-format CLIP checkpoint, its prompt and image embeddings.

The networks are our own (``pipeline.model.scorers.towers``: CLIP's text and vision towers
and projections); the weights are the folder's PyTorch safetensors or transformers' Flax
msgpack, read without torch and converted by rule once per machine
(``pipeline.model.loading.weights.converted``). The image side takes
the uint8 images the sampler made and preprocesses them on the device
(``pipeline.model.scorers.preprocess``: the folder's ``preprocessor_config.json``, i.e.
what ``CLIPProcessor`` would do with the written images). The prompt is tokenised on the
host with the folder's tokenizer, truncated to CLIP's 77 tokens, as DataComp and LAION
compute their CLIP scores.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from pipeline.model.loading import weights
from pipeline.model.scorers import preprocess

if TYPE_CHECKING:
    import numpy as np


class ScorerError(ValueError):
    """A scorer model that cannot be used; the message names the flag and the bad piece."""


@dataclasses.dataclass(frozen=True)
class Clip:
    path: str  # as --clip-model gave it
    directory: str  # the local folder
    config: object  # towers.ClipConfig
    module: object  # towers.ClipModel
    tokenizer: object  # pipeline.model.loading.tokenizer.Tokenizer
    preprocessing: preprocess.Preprocessing
    params: dict  # numpy arrays, or ShapeDtypeStructs for an abstract one

    @property
    def projection_dim(self) -> int:
        return self.config.projection_dim

    @property
    def image_size(self) -> int:
        return self.config.vision.image_size

    @property
    def max_length(self) -> int:
        """Tokens per prompt: CLIP's context (77), or less if its tokenizer says so."""
        return min(self.tokenizer.model_max_length, self.config.text.max_position_embeddings)


def find_weights(folder: str, flag: str) -> tuple[str, str]:
    """("flax" | "safetensors", path) of a transformers model folder's weights; Flax msgpack wins."""
    for kind, name in (("flax", weights.FLAX_FILES["transformers"]),
                       ("safetensors", weights.SAFETENSORS_FILES["transformers"])):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return kind, path
    found = sorted(name for name in os.listdir(folder) if name.endswith((".bin", ".pt", ".pth", ".index.json")))
    also = f" (it has {', '.join(found)}: PyTorch pickles and sharded weights are not read; save it with " \
           f"save_pretrained(..., safe_serialization=True))" if found else ""
    raise ScorerError(f"{flag} {folder}: no {weights.FLAX_FILES['transformers']} or "
                      f"{weights.SAFETENSORS_FILES['transformers']}{also}")


def load_params(folder: str, flag: str, from_torch, from_flax) -> dict:
    """The params of a transformers-format folder's weights: PyTorch safetensors by
    ``from_torch(state, where)``, Flax msgpack by ``from_flax(flat, where)`` (the networks'
    naming rules); converted once per machine and memory-mapped after."""
    kind, path = find_weights(folder, flag)
    try:
        if kind == "flax":
            return weights.converted(path, folder, lambda: from_flax(weights.read_msgpack(path), folder))
        return weights.converted(path, folder, lambda: from_torch(weights.read_mapped(path), folder))
    except (weights.WeightsError, ValueError) as e:
        raise ScorerError(f"{flag} {folder}: {e}") from None


def read_config(directory: str, path: str, flag: str, text: bool = True):
    """The ``towers.ClipConfig`` of a folder's config.json; ScorerError naming the flag."""
    import json

    from pipeline.model.scorers import towers

    file = os.path.join(directory, "config.json")
    if not os.path.isfile(file):
        raise ScorerError(f"{flag} {path}: no config.json in {directory} (not a transformers-format CLIP model)")
    try:
        with open(file, encoding="utf-8") as f:
            return towers.ClipConfig.from_dict(json.load(f), text=text)
    except ValueError as e:
        raise ScorerError(f"{flag} {path}: {e}") from None


def load(directory: str, path: str, abstract: bool = False) -> Clip:
    """The CLIP model of ``directory`` (``path``: what --clip-model named); ``abstract``:
    its params as ShapeDtypeStructs, from the config alone (enough to compile)."""
    import jax.numpy as jnp

    from pipeline.model.loading import convert, tokenizer as tokenizer_lib
    from pipeline.model.scorers import towers

    flag = "--clip-model"
    config = read_config(directory, path, flag)
    try:
        tokenizer = tokenizer_lib.clip(directory, config.text.max_position_embeddings)
    except tokenizer_lib.TokenizerError as e:
        raise ScorerError(f"--clip-model {path}: no CLIP tokenizer in {directory} (vocab.json and merges.txt, or "
                          f"tokenizer.json): {e}") from None
    pre, _ = preprocess.read(directory, config.vision.image_size)
    if abstract:
        params = convert.abstract_params({"clip": towers.NETWORK.param_shapes(config)}, jnp.float32)["clip"]
    else:
        params = load_params(directory, flag, lambda state, where: towers.NETWORK.from_torch(state, config, where),
                             lambda flat, where: towers.from_flax(flat, config, where))
    return Clip(path=path, directory=directory, config=config, module=towers.ClipModel(config), tokenizer=tokenizer,
                preprocessing=pre, params=params)


def tokenize(clip: Clip, texts) -> np.ndarray:
    """int32 [N, max_length] token ids of ``texts``, padded and truncated (the end token kept)."""
    return clip.tokenizer.ids(list(texts), clip.max_length)


def image_embeds(clip: Clip, params, pixels):
    """The projected image embeddings [B, projection_dim] of preprocessed pixels [B, S, S, 3]."""
    return clip.module.apply({"params": params}, pixels, method="image_features")


def text_embeds(clip: Clip, params, ids):
    """The projected prompt embeddings [B, projection_dim] of token ids [B, L]."""
    return clip.module.apply({"params": params}, ids, method="text_features")


def normalized(x):
    """``x`` / its L2 norm along the last axis (torch's ``F.normalize``: the norm at least 1e-12)."""
    import jax.numpy as jnp

    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def similarity(images, texts):
    """Cosine of each image embedding with its prompt's, [B]."""
    import jax.numpy as jnp

    return jnp.sum(normalized(images) * normalized(texts), axis=-1)
