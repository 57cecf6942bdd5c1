"""CLIP as a scorer: a transformers-format CLIP checkpoint, its prompt and image embeddings.

The networks are transformers' Flax CLIP modules (``FlaxCLIPModule``), which run on our
jax; the weights are the folder's Flax msgpack or safetensors, read without torch and
converted once per machine (``pipeline.model.loading.weights.converted``). The image side takes
the uint8 images the sampler made and preprocesses them on the device
(``pipeline.model.scorers.preprocess``: the folder's ``preprocessor_config.json``, i.e.
what ``CLIPProcessor`` would do with the written images). The prompt is tokenised on the
host with the folder's tokenizer, truncated to CLIP's 77 tokens, as DataComp and LAION
compute their CLIP scores.
"""
from __future__ import annotations

import dataclasses
import os

from pipeline.model.loading import weights
from pipeline.model.scorers import preprocess


class ScorerError(ValueError):
    """A scorer model that cannot be used; the message names the flag and the bad piece."""


@dataclasses.dataclass(frozen=True)
class Clip:
    path: str  # as --clip-model gave it
    directory: str  # the local folder
    config: object  # transformers' CLIPConfig
    module: object  # FlaxCLIPModule
    tokenizer: object
    preprocessing: preprocess.Preprocessing
    params: dict  # numpy arrays, or ShapeDtypeStructs for an abstract one

    @property
    def projection_dim(self) -> int:
        return self.config.projection_dim

    @property
    def image_size(self) -> int:
        return self.config.vision_config.image_size

    @property
    def max_length(self) -> int:
        """Tokens per prompt: CLIP's context (77), or less if its tokenizer says so."""
        return min(self.tokenizer.model_max_length, self.config.text_config.max_position_embeddings)


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


def load_params(folder: str, shapes, flag: str, base_model_prefix: str = "clip") -> dict:
    """The Flax params of a transformers-format folder's weights for a module of ``shapes``
    (its ``params_shape_tree``): Flax msgpack as stored, or PyTorch safetensors converted by
    transformers' renaming rules; converted once per machine and memory-mapped after."""
    import types

    kind, path = find_weights(folder, flag)
    try:
        if kind == "flax":
            return weights.converted(path, folder, lambda: weights.params_from_msgpack(shapes, path))
        target = types.SimpleNamespace(params_shape_tree=shapes, base_model_prefix=base_model_prefix)
        return weights.converted(path, folder, lambda: weights.transformers_params_from_safetensors(target, path))
    except (weights.WeightsError, ValueError) as e:
        raise ScorerError(f"{flag} {folder}: {e}") from None


def load(directory: str, path: str, abstract: bool = False) -> Clip:
    """The CLIP model of ``directory`` (``path``: what --clip-model named); ``abstract``:
    its params as ShapeDtypeStructs, from the config alone (enough to compile)."""
    from pipeline.model.loading.libraries import quiet_libraries

    quiet_libraries()  # before the Flax classes: they warn at every instance
    import jax
    import jax.numpy as jnp
    from transformers import CLIPConfig, FlaxCLIPModel

    from pipeline.model.loading.shapes import transformers_model

    flag = "--clip-model"
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ScorerError(f"{flag} {path}: no config.json in {directory} (not a transformers-format CLIP model)")
    config = CLIPConfig.from_pretrained(directory)
    if config.model_type != "clip":
        raise ScorerError(f"{flag} {path}: its config is a {config.model_type!r} model, not CLIP")
    tokenizer = _tokenizer(directory, path)
    pre, _ = preprocess.read(directory, config.vision_config.image_size)
    model = transformers_model(FlaxCLIPModel, config, jnp.float32)  # shapes traced once per machine
    shapes = model.params_shape_tree
    # abstract: a copy of the shapes, the model being shared
    params = (jax.tree_util.tree_map(lambda leaf: leaf, shapes) if abstract
              else load_params(directory, shapes, flag, model.base_model_prefix))
    return Clip(path=path, directory=directory, config=config, module=model.module, tokenizer=tokenizer,
                preprocessing=pre, params=params)


def _tokenizer(directory: str, path: str):
    """The folder's CLIP tokenizer: the Python one from vocab.json and merges.txt (as the
    sampler's; it may be shared by threads), else the fast one from tokenizer.json alone.
    They tokenise alike (CLIPProcessor loads the fast one)."""
    from transformers import CLIPTokenizer, CLIPTokenizerFast

    errors = []
    for cls in (CLIPTokenizer, CLIPTokenizerFast):
        try:
            return cls.from_pretrained(directory)
        except (OSError, TypeError, ValueError, AttributeError) as e:
            errors.append(f"{cls.__name__}: {type(e).__name__}: {e}")
    raise ScorerError(f"--clip-model {path}: no CLIP tokenizer in {directory} (vocab.json and merges.txt, or "
                      f"tokenizer.json): {'; '.join(errors)}")


def tokenize(clip: Clip, texts) -> "np.ndarray":
    """int32 [N, max_length] token ids of ``texts``, padded and truncated (the end token kept)."""
    import numpy as np

    ids = clip.tokenizer(list(texts), padding="max_length", max_length=clip.max_length, truncation=True,
                         return_tensors="np").input_ids
    return ids.astype(np.int32)


def _image_features(module, pixels):
    return module.visual_projection(module.vision_model(pixel_values=pixels, deterministic=True)[1])


def _text_features(module, ids):
    import jax.numpy as jnp

    positions = jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)
    pooled = module.text_model(input_ids=ids, attention_mask=jnp.ones_like(ids), position_ids=positions,
                               deterministic=True)[1]  # at the end token, as transformers pools
    return module.text_projection(pooled)


def image_embeds(clip: Clip, params, pixels):
    """The projected image embeddings [B, projection_dim] of preprocessed pixels [B, S, S, 3]."""
    return clip.module.apply({"params": params}, pixels, method=_image_features)


def text_embeds(clip: Clip, params, ids):
    """The projected prompt embeddings [B, projection_dim] of token ids [B, L]."""
    return clip.module.apply({"params": params}, ids, method=_text_features)


def normalized(x):
    """``x`` / its L2 norm along the last axis (torch's ``F.normalize``: the norm at least 1e-12)."""
    import jax.numpy as jnp

    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def similarity(images, texts):
    """Cosine of each image embedding with its prompt's, [B]."""
    import jax.numpy as jnp

    return jnp.sum(normalized(images) * normalized(texts), axis=-1)
