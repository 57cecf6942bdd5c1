"""Qwen3 (transformers' ``Qwen3Model``, the decoder of ``Qwen3ForCausalLM``) as our own Flax
Linen module, to serve as a text encoder: diffusers' FLUX.2 [klein] and Z-Image pipelines
condition on the hidden states of some of its layers.

What it computes, as transformers 4.57's PyTorch ``Qwen3Model`` with its eager attention
does (checked against it with fixtures: tests/model/test_qwen3.py):
- the token embedding (``embed_tokens``), unscaled;
- ``num_hidden_layers`` decoder layers, each: an RMS norm (``input_layernorm``) then
  self-attention, added back; an RMS norm (``post_attention_layernorm``) then the SwiGLU
  MLP ``down_proj(silu(gate_proj x) * up_proj x)``, added back. The attention is
  grouped-query (``num_key_value_heads`` key/value heads, each shared by
  ``num_attention_heads / num_key_value_heads`` query heads), of ``head_dim`` per head (its
  own config key: not ``hidden_size / num_attention_heads``), its queries and keys RMS-normed
  per head over ``head_dim`` (``q_norm``, ``k_norm``) and then rotated by RoPE
  (``rope_theta``; rotating *halves*, transformers' ``rotate_half``, at positions
  0..L-1 whatever the padding: not FLUX's interleaved pairs), scores scaled by
  ``head_dim ** -0.5``. Biases on the four projections only when ``attention_bias``;
- a final RMS norm (``norm``).

Hidden states, numbered as transformers' ``output_hidden_states``: entry 0 is the
embeddings, entry k (1 <= k < num_hidden_layers) decoder layer k's output, and entry
num_hidden_layers the *final-normed* output of the last layer (transformers replaces the
last layer's raw output with ``last_hidden_state``). ``Qwen3Encoder(config, dtype,
layers=N)`` runs only the first N layers and returns entries 0..N: the final norm belongs
to entry num_hidden_layers only, so it is applied (and its weight exists) only when N is
all the layers. The layers beyond N have no parameters here: ``from_torch(..., layers=N)``
neither creates nor loads them (their weights in the file are skipped, unread).

Attention mask, as transformers' eager attention has it: query i sees key j when j <= i and
``attention_mask[b, j]`` is nonzero; the others get ``finfo(dtype).min`` added to their
(scaled, compute-dtype) scores, and the softmax is in float32. Padded positions are queries
like any other and have outputs (klein reads hidden states at padded positions too): with
right padding, each padded position sees the unpadded keys before it. A query
that sees no key at all (only with left padding: the padded positions before the first
token) gets equal weights over *every* key, future and padded ones included, as eager
attention's finfo.min arithmetic gives; transformers' default SDPA attention (torch >= 2.5)
gives such rows zero attention output instead, so there the two differ (and only there:
the fixtures record both). The attention core is here, not behind
``pipeline.model.layers.attention.compute``: that seam takes no key mask.

Precision, as transformers has it: everything in the module's dtype (fp32 or bf16, the
residual stream included), the norms' mean square and the softmax in float32, RoPE's
cos/sin computed in float32 and cast to the dtype.

Weights load from transformers' state dict names by rule (``convert``; the layers
stacked: ``layers.{i}.…``), from a ``Qwen3Model`` file (no prefix) or a
``Qwen3ForCausalLM`` one (everything under ``model.``; its ``lm_head.weight`` is not the
encoder's and is skipped).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pipeline.model.layers.mlp import SwiGLU
from pipeline.model.loading import convert

# transformers' activation names (ACT2FN) for SiLU, the only activation this module has
_SILU = ("silu", "swish")
# Qwen3Config's defaults (transformers 4.57): a key missing from config.json means these
_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                 rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """What a Qwen3 decoder's hidden states depend on; ``from_dict`` reads a checkpoint's
    config.json."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen3Config:
        """The config of transformers' Qwen3Config keys (a ``text_encoder/config.json``).
        ValueError naming the key and value for anything the hidden states would depend on
        that this module does not do: RoPE scaling, sliding-window attention, an activation
        other than SiLU, partial rotary embeddings. The other keys (dropout, cache,
        generation, token ids, ``max_position_embeddings``, which default RoPE does not
        read, metadata) do not change the hidden states."""
        def refuse(key, why):
            raise ValueError(f"Qwen3 config: {key}={config.get(key)!r} {why}")

        if config.get("model_type", "qwen3") != "qwen3":
            refuse("model_type", "is not qwen3")
        if config.get("rope_scaling") is not None:
            refuse("rope_scaling", "scales RoPE, which this module does not do (only default RoPE)")
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            refuse("partial_rotary_factor", "rotates part of each head, which this module does not do")
        if config.get("use_sliding_window", False):
            refuse("use_sliding_window", "turns on sliding-window attention, which this module does not do")
        layer_types = config.get("layer_types")
        if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
            refuse("layer_types", "has layers other than full_attention (sliding windows), which this module "
                   "does not do")
        if config.get("pruned_heads"):
            refuse("pruned_heads", "prunes attention heads, which this module does not do")
        values = {key: config.get(key, default) for key, default in _DEFAULTS.items()}
        if values["num_key_value_heads"] is None:  # Qwen3Config: as many as the query heads
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values["head_dim"] is None and "head_dim" in config:  # transformers: hidden_size // heads then
            heads, hidden = values["num_attention_heads"], values["hidden_size"]
            if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
                values["head_dim"] = hidden // heads
        for key in _POSITIVE_INTS:
            value = values[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                refuse(key, "must be a positive integer")
        if values["num_attention_heads"] % values["num_key_value_heads"]:
            refuse("num_key_value_heads", f"does not divide num_attention_heads={values['num_attention_heads']}")
        if values["head_dim"] % 2:
            refuse("head_dim", "must be even (RoPE rotates halves)")
        if values["hidden_act"] not in _SILU:
            refuse("hidden_act", "is not silu, the only activation this module has")
        for key in ("rms_norm_eps", "rope_theta"):
            value = values[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                refuse(key, "must be a positive number")
        if not isinstance(values["attention_bias"], bool):
            refuse("attention_bias", "must be true or false")
        return cls(**{key: values[key] for key in _POSITIVE_INTS}, rms_norm_eps=float(values["rms_norm_eps"]),
                   rope_theta=float(values["rope_theta"]), attention_bias=values["attention_bias"])


def hf_config(**values) -> dict:
    """A ``text_encoder/config.json`` as transformers' ``Qwen3Config.save_pretrained`` writes
    one: its defaults (a key missing from a checkpoint's file means these), ``values`` over
    them (the built-in models' configs)."""
    return {"model_type": "qwen3", **_DEFAULTS, "max_position_embeddings": 40960, "use_sliding_window": False,
            "sliding_window": None, "rope_scaling": None, "tie_word_embeddings": False, "attention_dropout": 0.0,
            **values}


def rope_cos_sin(length: int, head_dim: int, theta: float):
    """(cos, sin), float32 [length, head_dim]: transformers' default RoPE at positions
    0..length-1, each frequency repeated over the two halves (``cat((freqs, freqs))``),
    computed in float32 as its ``Qwen3RotaryEmbedding`` does."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.int32).astype(jnp.float32) / jnp.float32(head_dim)
    inv_freq = jnp.float32(1.0) / (jnp.float32(theta) ** exponents)
    freqs = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate_half(x):
    """[-x2, x1] of x = [x1, x2] split in halves on the last axis (transformers')."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
    """x [..., L, heads, head_dim] rotated: x * cos + rotate_half(x) * sin, cos and sin
    [L, head_dim] (cast to x's dtype, as transformers does)."""
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotate_half(x) * sin


def additive_mask(attention_mask, length: int, dtype):
    """[B, 1, 1, L, L] in ``dtype``: 0 where query i may see key j (j <= i and key j not
    padding), ``finfo(dtype).min`` elsewhere: transformers' eager causal mask."""
    causal = jnp.tril(jnp.ones((length, length), bool))
    allowed = causal[None] & (attention_mask[:, None, :] != 0)
    mask = jnp.where(allowed, 0.0, jnp.finfo(dtype).min).astype(dtype)
    return mask[:, None, None]


class Qwen3RMSNorm(nn.Module):
    """scale * x / sqrt(mean(x^2) + eps), the mean in float32; the result in the module's
    dtype (on the last axis: hidden_size, or head_dim for q_norm and k_norm)."""
    epsilon: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return scale.astype(self.dtype) * normed.astype(self.dtype)


class Qwen3Attention(nn.Module):
    """Grouped-query self-attention with per-head q/k RMS norms and RoPE; an explicit
    additive mask and a float32 softmax, as transformers' ``eager_attention_forward``."""
    config: Qwen3Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask, cos, sin):  # x [B, L, hidden]; mask [B, 1, 1, L, L]; cos, sin [L, head_dim]
        cfg = self.config
        batch, length, _ = x.shape
        groups, per_group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads

        def project(name, heads):
            out = nn.Dense(heads * cfg.head_dim, use_bias=cfg.attention_bias, dtype=self.dtype, name=name)(x)
            return out.reshape(batch, length, heads, cfg.head_dim)

        q = Qwen3RMSNorm(cfg.rms_norm_eps, self.dtype, name="q_norm")(project("q_proj", cfg.num_attention_heads))
        k = Qwen3RMSNorm(cfg.rms_norm_eps, self.dtype, name="k_norm")(project("k_proj", groups))
        v = project("v_proj", groups)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # query head h uses key/value head h // per_group (transformers' repeat_kv)
        q = q.reshape(batch, length, groups, per_group, cfg.head_dim)
        scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k) * jnp.asarray(cfg.head_dim ** -0.5, self.dtype)
        scores = scores + mask.astype(scores.dtype)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = jnp.einsum("bgrqk,bkgd->bqgrd", weights, v.astype(self.dtype))
        out = out.reshape(batch, length, cfg.num_attention_heads * cfg.head_dim)
        return nn.Dense(cfg.hidden_size, use_bias=cfg.attention_bias, dtype=self.dtype, name="o_proj")(out)


class Qwen3DecoderLayer(nn.Module):
    """One decoder layer; the scan's body: (residual stream, (mask, cos, sin)) -> (its
    output, its output): the second is what the scan stacks, the hidden states."""
    config: Qwen3Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, context):
        mask, cos, sin = context
        eps = self.config.rms_norm_eps
        normed = Qwen3RMSNorm(eps, self.dtype, name="input_layernorm")(x)
        x = x + Qwen3Attention(self.config, self.dtype, name="self_attn")(normed, mask, cos, sin).astype(x.dtype)
        normed = Qwen3RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x)
        mlp = SwiGLU(self.config.intermediate_size, self.config.hidden_size, dtype=self.dtype, name="mlp")
        x = x + mlp(normed).astype(x.dtype)
        return x, x


class Qwen3Encoder(nn.Module):
    """``Qwen3Encoder(config, dtype, layers=N)(input_ids [B, L] int, attention_mask [B, L]
    (nonzero: a token; None: no padding)) -> hidden states [N + 1, B, L, hidden_size]`` in
    ``dtype``, entry k as transformers' ``output_hidden_states[k]`` (see the module's
    docstring: the last entry is final-normed only when N is ``num_hidden_layers``).
    ``layers``: how many decoder layers run and have parameters (None: all).
    ``unroll``: layers per loop iteration (``nn.scan``'s)."""
    config: Qwen3Config
    dtype: Any = jnp.float32
    layers: int | None = None
    unroll: int = 1

    @nn.compact
    def __call__(self, input_ids, attention_mask=None):
        cfg = self.config
        count = run_layers(cfg, self.layers)
        batch, length = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((batch, length), jnp.int32)
        x = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, name="embed_tokens")(input_ids)
        x = x.astype(self.dtype)
        cos, sin = rope_cos_sin(length, cfg.head_dim, cfg.rope_theta)
        context = (additive_mask(attention_mask, length, self.dtype), cos, sin)
        stack = nn.scan(Qwen3DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=nn.broadcast, length=count, unroll=self.unroll)
        last, outputs = stack(cfg, self.dtype, name="layers")(x, context)
        if count == cfg.num_hidden_layers:  # transformers' last entry is last_hidden_state
            last = Qwen3RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(last)
        return jnp.concatenate([x[None], outputs[:-1], last[None]], axis=0)


def run_layers(config: Qwen3Config, layers: int | None) -> int:
    """How many decoder layers ``layers`` means (None: all); ValueError outside 1..all."""
    count = config.num_hidden_layers if layers is None else layers
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= config.num_hidden_layers:
        raise ValueError(f"Qwen3: layers={layers!r} must be 1..{config.num_hidden_layers} (or None: all)")
    return count


def layers_for(config: Qwen3Config, indices: Sequence[int]) -> int:
    """The decoder layers that hidden-state entries ``indices`` need: the deepest asked
    for (at least 1)."""
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= config.num_hidden_layers:
            raise ValueError(f"Qwen3: hidden state {index!r} is not one of 0..{config.num_hidden_layers}")
    return max(max(indices, default=0), 1)


def truncate(params: Mapping, config: Qwen3Config, layers: int | None) -> dict:
    """Params for ``Qwen3Encoder(config, layers=layers)`` from params of at least that many
    layers (the stacked leaves sliced; the final norm dropped unless all layers run)."""
    count = run_layers(config, layers)
    out = {key: value for key, value in params.items() if key not in ("layers", "norm")}
    out["layers"] = jax.tree_util.tree_map(lambda a: a[:count], params["layers"])
    if count == config.num_hidden_layers:
        out["norm"] = params["norm"]
    return out


def hidden_states(params: Mapping, config: Qwen3Config, input_ids, attention_mask=None, *,
                  indices: Sequence[int] = (9, 18, 27), dtype=jnp.float32, unroll: int = 1) -> tuple:
    """The hidden states ``indices`` (transformers' ``output_hidden_states`` numbering; by
    default klein's, of Qwen3-4B's 36 layers), each [B, L, hidden_size], running only the
    layers the deepest one needs. ``params``: of that many layers or more (``from_torch``
    with ``layers=layers_for(config, indices)`` loads no more)."""
    count = layers_for(config, indices)
    module = Qwen3Encoder(config, dtype, layers=count, unroll=unroll)
    states = module.apply({"params": truncate(params, config, count)}, input_ids, attention_mask)
    return tuple(states[index] for index in indices)


# The naming rule's exceptions (``convert``): a Qwen3ForCausalLM file's head is not the
# encoder's. (Its ``model.`` prefix is taken off by ``from_torch`` before the rule.)
TORCH_NAMES = convert.TorchNames(stacks=("layers",), ignored=("lm_head.",))
_LAYER = re.compile(r"layers\.(\d+)\.")


# ``network(layers=N)``: the ``convert.Network`` of ``Qwen3Encoder`` run to its first N layers
network = convert.variants(Qwen3Encoder, convert.token_ids_example, TORCH_NAMES)


def param_shapes(config: Qwen3Config, layers: int | None = None) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{flat param path: shape} of the encoder of its first ``layers`` layers (None: all),
    from its config alone."""
    return network(layers=run_layers(config, layers)).param_shapes(config)


def from_torch(state: Mapping[str, np.ndarray], config: Qwen3Config, where: str = "text_encoder",
               layers: int | None = None) -> dict:
    """Params from a ``Qwen3Model`` or ``Qwen3ForCausalLM`` state dict (``convert``), for the
    encoder of the first ``layers`` decoder layers (None: all). The weights of the layers
    beyond them (and the final norm's, unless all run) are skipped, never read; a
    ForCausalLM's ``lm_head.weight`` too. WeightsError naming any missing, misshapen or
    unknown weight."""
    count = run_layers(config, layers)
    prefixed = any(name.startswith("model.") for name in state)
    kept = {}
    for name in state:
        short = name[len("model."):] if prefixed and name.startswith("model.") else name
        found = _LAYER.match(short)
        if (found and int(found.group(1)) >= count and int(found.group(1)) < config.num_hidden_layers) or (
                short == "norm.weight" and count < config.num_hidden_layers):
            continue
        kept[short] = state[name]  # a view: memory-mapped arrays stay unread
    return network(layers=count).from_torch(kept, config, where)


def to_torch(params: Mapping, config: Qwen3Config) -> dict[str, np.ndarray]:
    """The ``Qwen3Model`` state dict of ``params`` (no prefix): ``from_torch``'s inverse."""
    return convert.to_torch(params, TORCH_NAMES)
