"""The aesthetic head: LAION's improved aesthetic predictor on CLIP's image embedding.

LAION's released predictor (``improved-aesthetic-predictor``, ``sac+logos+ava1-l14-linearMSE``)
is a stack of linear layers, 768 -> 1024 -> 128 -> 64 -> 16 -> 1, on the L2-normalised
CLIP ViT-L/14 image embedding. Its ReLUs are commented out and its dropout is off at
inference, so it is linear layers and nothing between them. It is read from a
safetensors file with the names of LAION's PyTorch state dict (``layers.0.weight``,
``layers.0.bias``, ``layers.2.weight``, ... ``layers.7.bias``: the indices of the linear
layers in its ``nn.Sequential``); the README says how to write that file from LAION's
``.pth``. The layers' shapes must chain, from the CLIP model's embedding width to 1.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from pipeline.model.scorers.clip import ScorerError, normalized

_NAME = re.compile(r"layers\.(\d+)\.(weight|bias)")


@dataclasses.dataclass(frozen=True)
class Head:
    path: str  # as --aesthetic-head gave it
    file: str  # the local file
    params: tuple  # ((weight [out, in], bias [out]), ...) in layer order: arrays or ShapeDtypeStructs

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.params[0][0].shape[1],) + tuple(w.shape[0] for w, _ in self.params)


def read_layers(file: str, path: str) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(index, weight, bias) of each linear layer of a head file, in index order;
    ScorerError naming the file for a name, shape or chain that is not the predictor's."""
    from pipeline.model.loading import weights

    try:
        tensors = weights.read_mapped(file)
    except (OSError, weights.WeightsError) as e:
        raise ScorerError(f"--aesthetic-head {path}: {e}") from None
    layers: dict[int, dict] = {}
    for name, array in tensors.items():
        match = _NAME.fullmatch(name)
        if not match:
            raise ScorerError(f"--aesthetic-head {path}: unexpected tensor {name!r} (the head's names are LAION's "
                              f"state dict's: layers.N.weight and layers.N.bias)")
        layers.setdefault(int(match.group(1)), {})[match.group(2)] = array
    if not layers:
        raise ScorerError(f"--aesthetic-head {path}: no layers.N.weight tensors")
    ordered = []
    for index in sorted(layers):
        parts = layers[index]
        if set(parts) != {"weight", "bias"}:
            raise ScorerError(f"--aesthetic-head {path}: layers.{index} has {' and '.join(sorted(parts))} only "
                              f"(each linear layer has a weight and a bias)")
        weight, bias = parts["weight"], parts["bias"]
        if weight.ndim != 2 or bias.shape != (weight.shape[0],):
            raise ScorerError(f"--aesthetic-head {path}: layers.{index} has weight {tuple(weight.shape)} and bias "
                              f"{tuple(bias.shape)}, not a linear layer's [out, in] and [out]")
        if ordered and ordered[-1][1].shape[0] != weight.shape[1]:
            raise ScorerError(f"--aesthetic-head {path}: layers.{index} takes {weight.shape[1]} inputs, but the "
                              f"layer before gives {ordered[-1][1].shape[0]}")
        ordered.append((index, weight, bias))
    if ordered[-1][1].shape[0] != 1:
        raise ScorerError(f"--aesthetic-head {path}: its last layer gives {ordered[-1][1].shape[0]} outputs, not 1")
    return ordered


def load(file: str, path: str, embedding_width: int, abstract: bool = False) -> Head:
    """The head in ``file`` (``path``: what --aesthetic-head named), checked against the
    CLIP model's image embedding width; ``abstract``: ShapeDtypeStructs of its float32 params."""
    import jax

    layers = read_layers(file, path)
    if layers[0][1].shape[1] != embedding_width:
        raise ScorerError(f"--aesthetic-head {path}: it takes {layers[0][1].shape[1]}-wide embeddings, but the "
                          f"--clip-model's image embeddings are {embedding_width} wide (LAION's head is for "
                          f"CLIP ViT-L/14, 768)")
    if abstract:
        params = tuple((jax.ShapeDtypeStruct(w.shape, np.float32), jax.ShapeDtypeStruct(b.shape, np.float32))
                       for _, w, b in layers)
    else:
        params = tuple((np.asarray(w, np.float32), np.asarray(b, np.float32)) for _, w, b in layers)
    return Head(path=path, file=file, params=params)


def apply(params, image_embeds):
    """The head's score [B] of CLIP image embeddings [B, D] (normalised here, as LAION does):
    the linear layers in order, nothing between them."""
    import jax.numpy as jnp
    from jax import lax

    x = normalized(image_embeds.astype(jnp.float32))
    for weight, bias in params:
        x = jnp.matmul(x, weight.T, precision=lax.Precision.HIGHEST) + bias
    return x[:, 0]
