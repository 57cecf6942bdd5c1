"""CLIP's text encoder as our own Flax module: transformers' PyTorch ``CLIPTextModel`` and
``CLIPTextModelWithProjection`` (CLIP-L for SD 1.x, SDXL and FLUX.1; OpenCLIP-H for SD 2.x;
OpenCLIP-bigG with its projection for SDXL), and the encoder CLIP's vision tower shares
(``encoder``, of ``EncoderLayer``s of a ``LayerSpec``).

What it computes, as transformers 4.57's PyTorch module does (checked against it with
stored fixtures: tests/families/test_flux_nets.py, tests/families/test_pipeline_parity.py):
- the token embedding plus the learned position embedding (positions 0..L-1);
- ``num_hidden_layers`` encoder layers, each: a layer norm (``layer_norm1``) then causal
  self-attention (``q_proj``, ``k_proj``, ``v_proj`` with biases, scores scaled by
  head_dim ** -0.5, query i seeing tokens 0..i, ``out_proj``), added back; a layer norm
  (``layer_norm2``) then the MLP ``fc2(act(fc1 x))``, ``hidden_act`` quick-GELU
  (x sigmoid(1.702 x), OpenAI's CLIP) or the exact GELU (OpenCLIP's), added back;
- ``final_layer_norm``: the last hidden state; the pooled output is the final-normed state
  at the end-of-text token (its first position, or, for configs with the old
  ``eos_token_id`` 2, the position of the highest id, as transformers picks it); with a
  projection, ``text_projection`` of it (no bias).

Hidden states, numbered as transformers' ``output_hidden_states``: entry 0 the embeddings,
entry k layer k's raw output (the final norm belongs to the last hidden state only). A
family asks for what it reads (``Output``): SD 1.x/2.x the last hidden state, SDXL the
penultimate entry of both encoders and the second's projected pooled output, FLUX.1 the
pooled output. ``ClipText(config, layers=N, final=False)`` runs only the first N layers and
has no final norm or projection: the layers beyond N are neither loaded nor run
(``from_torch(..., layers=N, final=False)`` skips their weights unread), as SDXL's first
encoder's last layer, which its penultimate state does not need. A call gives the last two
hidden states it reached (``Output``), so SDXL's second encoder takes its penultimate state
and its pooled output from one run.

Every attention's core goes through the attention seam (``attention.compute``, causal, site
"text_encoder"); the layer norms compute in float32, the rest in the module's dtype. The
layers are scanned (``nn.scan``), their weights stacked on a leading axis
(``text_model.encoder.layers.{i}.…`` in the file; ``convert``'s rule).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pipeline.model.layers import attention
from pipeline.model.layers.norms import LayerNorm
from pipeline.model.layers.resnet import Numbered
from pipeline.model.layers.scan import stacked
from pipeline.model.loading import convert

ACTIVATIONS = ("quick_gelu", "gelu")
# transformers 4.57's CLIPTextConfig defaults: a key missing from config.json means these
_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, projection_dim=512, num_hidden_layers=12,
                 num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                 eos_token_id=49407)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "projection_dim", "num_hidden_layers",
                  "num_attention_heads", "max_position_embeddings")
LEGACY_EOS = 2  # configs saved before transformers' PR 24773: the end token is the highest id


@dataclasses.dataclass(frozen=True)
class ClipTextConfig:
    """What CLIP's text features depend on; ``from_dict`` reads a ``text_encoder/config.json``."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int = 77
    projection_dim: int = 512
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ClipTextConfig:
        """The config of transformers' ``CLIPTextConfig`` keys (a text encoder's config.json,
        or a whole CLIP's ``text_config``); ValueError naming the key and value of what this
        module does not do."""
        def refuse(key, why):
            raise ValueError(f"CLIP text config: {key}={config.get(key)!r} {why}")

        if config.get("model_type", "clip_text_model") not in ("clip_text_model", "clip"):
            refuse("model_type", "is not clip_text_model")
        values = {key: config.get(key, default) for key, default in _DEFAULTS.items()}
        for key in _POSITIVE_INTS:
            if isinstance(values[key], bool) or not isinstance(values[key], int) or values[key] < 1:
                refuse(key, "must be a positive integer")
        if values["hidden_size"] % values["num_attention_heads"]:
            refuse("num_attention_heads", f"does not divide hidden_size={values['hidden_size']}")
        if values["hidden_act"] not in ACTIVATIONS:
            refuse("hidden_act", f"is not one of {', '.join(ACTIVATIONS)}, the activations this module has")
        eps = values["layer_norm_eps"]
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            refuse("layer_norm_eps", "must be a positive number")
        if isinstance(values["eos_token_id"], bool) or not isinstance(values["eos_token_id"], int):
            refuse("eos_token_id", "must be an integer")
        return cls(**{key: values[key] for key in _POSITIVE_INTS}, hidden_act=values["hidden_act"],
                   layer_norm_eps=float(eps), eos_token_id=values["eos_token_id"])


class Output(NamedTuple):
    """What a ``ClipText`` call gives: ``hidden`` the raw output of its last layer (hidden
    state entry ``layers``) and ``previous`` its input (entry ``layers - 1``: with every
    layer run, SDXL's penultimate state); with ``final``, ``last`` (the final-normed last
    hidden state) and ``pooled`` (at the end token); with a projection, ``embeds``
    (``text_embeds``)."""
    hidden: Any
    previous: Any
    last: Any = None
    pooled: Any = None
    embeds: Any = None


def activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * jax.nn.sigmoid(1.702 * x)
    return lambda x: nn.gelu(x, approximate=False)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One CLIP encoder layer, of the text tower or the vision tower: its heads, MLP width and
    activation, layer norms' epsilon, whether its attention is causal (the text tower's) and
    its attention's site in the seam (``attention.compute``)."""
    heads: int
    intermediate: int
    act: str
    eps: float
    causal: bool
    site: str

    @classmethod
    def of(cls, config, causal: bool, site: str) -> LayerSpec:
        """The layers of ``config`` (a ``ClipTextConfig`` or a ``towers.ClipVisionConfig``)."""
        return cls(config.num_attention_heads, config.intermediate_size, config.hidden_act, config.layer_norm_eps,
                   causal, site)


class _Attention(nn.Module):
    spec: LayerSpec
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        batch, length, width = x.shape
        heads = self.spec.heads
        head_dim = width // heads

        def project(name):
            return nn.Dense(width, dtype=self.dtype, name=name)(x).reshape(batch, length, heads, head_dim)

        out = attention.compute(self.spec.site, project("q_proj"), project("k_proj"), project("v_proj"),
                                head_dim ** -0.5, causal=self.spec.causal)
        return nn.Dense(width, dtype=self.dtype, name="out_proj")(out.reshape(batch, length, width))


class _Mlp(nn.Module):
    spec: LayerSpec
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        hidden = activation(self.spec.act)(nn.Dense(self.spec.intermediate, dtype=self.dtype, name="fc1")(x))
        return nn.Dense(x.shape[-1], dtype=self.dtype, name="fc2")(hidden)


class EncoderLayer(nn.Module):
    """One CLIP encoder layer (text or vision); the scan's body: ((residual stream, the
    previous layer's input), _) -> ((its output, its input), None), so that the scan ends
    holding the last two hidden states."""
    spec: LayerSpec
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, carry, _=None):
        x = given = carry[0]
        eps = self.spec.eps
        x = x + _Attention(self.spec, self.dtype, name="self_attn")(LayerNorm(eps, self.dtype, name="layer_norm1")(x))
        x = x + _Mlp(self.spec, self.dtype, name="mlp")(LayerNorm(eps, self.dtype, name="layer_norm2")(x))
        return (x, given), None


def encoder(spec: LayerSpec, count: int, x, dtype, unroll: int = 1):
    """transformers' ``CLIPEncoder`` on ``x``, called from inside a compact module (its child
    ``encoder``): ``count`` layers of ``spec`` scanned over weights stacked on a leading axis
    (``encoder/layers``). Gives (the last layer's output, its input)."""
    def layers():
        return stacked(EncoderLayer, count, 1, unroll)(spec, dtype, name="layers")

    states, _ = Numbered(name="encoder")(layers, (x, x), None)
    return states


def embeddings(config: ClipTextConfig, ids, dtype):
    """transformers' ``CLIPTextEmbeddings`` on ``ids``, called from inside a compact module (its
    child ``embeddings``): the token embedding plus the learned position embedding."""
    embed = Numbered(name="embeddings")
    tokens = embed(lambda: nn.Embed(config.vocab_size, config.hidden_size, dtype=dtype, name="token_embedding"), ids)
    positions = embed(lambda: nn.Embed(config.max_position_embeddings, config.hidden_size, dtype=dtype,
                                       name="position_embedding"), jnp.arange(ids.shape[1])[None])
    return (tokens + positions).astype(dtype)


class TextModel(nn.Module):
    """transformers' ``CLIPTextTransformer`` (``text_model``): embeddings, the first ``count`` layers,
    with ``final`` the final norm and the pooled output (``Output``)."""
    config: ClipTextConfig
    count: int
    final: bool
    dtype: Any = jnp.float32
    unroll: int = 1

    @nn.compact
    def __call__(self, ids):
        cfg = self.config
        hidden, previous = encoder(LayerSpec.of(cfg, True, "text_encoder"), self.count,
                                   embeddings(cfg, ids, self.dtype), self.dtype, self.unroll)
        if not self.final:
            return Output(hidden, previous)
        last = LayerNorm(cfg.layer_norm_eps, self.dtype, name="final_layer_norm")(hidden)
        if cfg.eos_token_id == LEGACY_EOS:
            ends = jnp.argmax(ids, axis=-1)
        else:
            ends = jnp.argmax((ids == cfg.eos_token_id).astype(jnp.int32), axis=-1)
        return Output(hidden, previous, last, last[jnp.arange(ids.shape[0]), ends])


class ClipText(nn.Module):
    """``ClipText(config, dtype, layers=N, final=True, projection=False)(input_ids [B, L]
    int) -> Output``: the first N encoder layers (None: all); ``final`` (all layers only):
    the final norm and the pooled output; ``projection``: ``text_projection`` too
    (``CLIPTextModelWithProjection``'s ``text_embeds``). ``unroll``: layers per loop step."""
    config: ClipTextConfig
    dtype: Any = jnp.float32
    layers: int | None = None
    final: bool = True
    projection: bool = False
    unroll: int = 1

    @nn.compact
    def __call__(self, input_ids):
        cfg = self.config
        count = run_layers(cfg, self.layers, self.final)
        out = TextModel(cfg, count, self.final, self.dtype, self.unroll, name="text_model")(
            jnp.asarray(input_ids, jnp.int32))
        if self.projection:
            embeds = nn.Dense(cfg.projection_dim, use_bias=False, dtype=self.dtype, name="text_projection")(out.pooled)
            out = out._replace(embeds=embeds)
        return out


def run_layers(config: ClipTextConfig, layers: int | None, final: bool = True) -> int:
    """How many encoder layers ``layers`` means (None: all); ValueError outside 1..all, or
    for the final norm without every layer."""
    count = config.num_hidden_layers if layers is None else layers
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= config.num_hidden_layers:
        raise ValueError(f"CLIP: layers={layers!r} must be 1..{config.num_hidden_layers} (or None: all)")
    if final and count != config.num_hidden_layers:
        raise ValueError("CLIP: the final norm and the pooled output follow the last layer: run every layer")
    return count


def penultimate(config: ClipTextConfig) -> int:
    """The layers whose last output is the penultimate hidden state (SDXL's): all but one."""
    if config.num_hidden_layers < 2:
        raise ValueError("CLIP: a penultimate hidden state needs at least 2 layers")
    return config.num_hidden_layers - 1


# transformers' names: the position ids some files hold are a buffer, not a weight
TORCH_NAMES = convert.TorchNames(stacks=("text_model/encoder/layers",),
                                 ignored=("text_model.embeddings.position_ids",))
_LAYER = re.compile(r"text_model\.encoder\.layers\.(\d+)\.")


# ``network(layers=..., final=..., projection=...)``: the ``convert.Network`` of ``ClipText`` so run
network = convert.variants(ClipText, convert.token_ids_example, TORCH_NAMES)


def param_shapes(config: ClipTextConfig, layers: int | None = None, final: bool = True,
                 projection: bool = False) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{flat param path: shape}, from the config alone."""
    return network(layers=run_layers(config, layers, final), final=final, projection=projection).param_shapes(config)


def _unread(name: str, config: ClipTextConfig, count: int, final: bool, projection: bool) -> bool:
    """Whether the encoder of ``count`` layers never reads the weight ``name`` (PyTorch's,
    dotted): a deeper layer's, the final norm's without ``final``, the projection's
    without ``projection``, or a whole CLIP's vision half."""
    found = _LAYER.match(name)
    return bool((found and count <= int(found.group(1)) < config.num_hidden_layers)
                or (name.startswith("text_model.final_layer_norm.") and not final)
                or (name.startswith("text_projection.") and not projection)
                or name.startswith(("vision_model.", "visual_projection.", "logit_scale")))


def from_torch(state: Mapping[str, np.ndarray], config: ClipTextConfig, where: str = "text_encoder",
               layers: int | None = None, final: bool = True, projection: bool = False) -> dict:
    """Params from a ``CLIPTextModel``, ``CLIPTextModelWithProjection`` or ``CLIPModel`` state
    dict by the naming rule (layers stacked), each array in its stored dtype, for the
    encoder ``ClipText(config, layers=..., final=..., projection=...)``: what it does not
    run is skipped unread (memory-mapped arrays stay unread). WeightsError naming any
    missing, misshapen or unknown weight."""
    count = run_layers(config, layers, final)
    kept = {name: value for name, value in state.items() if not _unread(name, config, count, final, projection)}
    return network(layers=count, final=final, projection=projection).from_torch(kept, config, where)


def from_flax(flat: Mapping[tuple[str, ...], np.ndarray], config: ClipTextConfig, where: str = "text_encoder",
              layers: int | None = None, final: bool = True, projection: bool = False) -> dict:
    """Params from the flat params of transformers' ``FlaxCLIPTextModel`` (or
    ``...WithProjection``; a ``flax_model.msgpack``: ``text_model/encoder/layers/0/...``), as
    ``from_torch`` reads a state dict."""
    count = run_layers(config, layers, final)
    kept = {key: value for key, value in flat.items()
            if not _unread(".".join(key), config, count, final, projection)}
    return convert.from_flax(kept, param_shapes(config, count, final, projection), TORCH_NAMES, where, joined=False)


def to_torch(params: Mapping) -> dict[str, np.ndarray]:
    """The state dict of ``params``: ``from_torch``'s inverse."""
    return convert.to_torch(params, TORCH_NAMES)
