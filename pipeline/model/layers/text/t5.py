"""The T5 v1.1 encoder (FLUX.1's ``text_encoder_2``, transformers' ``T5EncoderModel``) as
our own Flax Linen module.

Our own because transformers 4.57's ``FlaxT5EncoderModel`` calls ``jnp.clip(a_min=...,
a_max=...)``, which jax 0.10 no longer has, and promptmill never patches site-packages;
Linen, like the diffusers and transformers modules promptmill runs (see
``pipeline.model.layers``).

What it computes, as transformers' PyTorch ``T5EncoderModel`` does (checked against it
with fixtures: tests/families/test_flux_nets.py):
- the token embedding (``shared``), unscaled;
- ``num_layers`` blocks, each: an RMS layer norm (no mean subtraction, no bias) then
  self-attention, whose scores are not scaled by 1/sqrt(d_kv) and get a learnt bias by
  relative position (bidirectional buckets: the first layer's table, computed once and
  shared by every layer, as T5 does), added back; an RMS layer norm then the
  feed-forward (gated: ``act(wi_0 x) * wi_1 x``, then ``wo``; or ``act(wi x)``, then
  ``wo``), added back;
- a final RMS layer norm: the last hidden state, what FluxPipeline conditions on.
No attention mask: FluxPipeline calls T5 without one, so padding tokens are attended to,
here as there.

Precision, as transformers has it: the module computes in its dtype (fp32 or bf16),
the norms' variance and the attention softmax in float32, and ``wo`` in float32
(transformers keeps ``wo`` in float32 in half precision, ``_keep_in_fp32_modules``; its
weights stay in their stored dtype here and are upcast when used). The residual stream
is float32 (in transformers' bf16 T5 it is float32 from the first feed-forward on, the
sum with ``wo``'s output promoting it; only its very first residual sum is in bf16).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pipeline.model.layers.scan import stacked
from pipeline.model.loading import convert

# transformers' activation names (ACT2FN) that T5 configs use, as functions
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # erf
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # tanh: T5 v1.1's ("gated-gelu")
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}
# T5Config's defaults (transformers 4.57): a key missing from config.json means these
_DEFAULTS = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                 relative_attention_num_buckets=32, relative_attention_max_distance=128,
                 layer_norm_epsilon=1e-6, feed_forward_proj="relu")
_POSITIVE_INTS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                  "relative_attention_num_buckets", "relative_attention_max_distance")


@dataclasses.dataclass(frozen=True)
class T5Config:
    """What a T5 encoder's output depends on; ``from_dict`` reads a checkpoint's config.json."""
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dense_act_fn: str = "gelu_new"
    is_gated_act: bool = True

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> T5Config:
        """The config of transformers' T5Config keys (a ``text_encoder_2/config.json``).
        ValueError naming the key and value for anything the encoder's output would depend
        on that this module does not do. The other keys (dropout, decoder, cache,
        generation, metadata) are not read by transformers' ``T5EncoderModel`` either."""
        def refuse(key, why):
            raise ValueError(f"T5 config: {key}={config.get(key)!r} {why}")

        if config.get("model_type", "t5") != "t5":
            refuse("model_type", "is not T5 (only T5 v1.0/v1.1 encoders are supported)")
        if config.get("pruned_heads"):
            refuse("pruned_heads", "prunes attention heads, which this encoder does not do")
        values = {key: config.get(key, default) for key, default in _DEFAULTS.items()}
        for key in _POSITIVE_INTS:
            value = values[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                refuse(key, "must be a positive integer")
        epsilon = values["layer_norm_epsilon"]
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
            refuse("layer_norm_epsilon", "must be a positive number")
        # T5Config derives both from feed_forward_proj ("gated-gelu" means the tanh GELU),
        # but saved values of dense_act_fn and is_gated_act override what it derives
        proj = values["feed_forward_proj"]
        parts = proj.split("-") if isinstance(proj, str) else []
        if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            refuse("feed_forward_proj", "is not ACT or gated-ACT")
        activation = config.get("dense_act_fn", "gelu_new" if proj == "gated-gelu" else parts[-1])
        gated = config.get("is_gated_act", parts[0] == "gated")
        if activation not in ACTIVATIONS:
            key = "dense_act_fn" if "dense_act_fn" in config else "feed_forward_proj"
            refuse(key, f"names an activation this encoder does not have (it has {', '.join(ACTIVATIONS)})")
        if not isinstance(gated, bool):
            refuse("is_gated_act", "must be true or false")
        return cls(vocab_size=values["vocab_size"], d_model=values["d_model"], d_kv=values["d_kv"],
                   d_ff=values["d_ff"], num_layers=values["num_layers"], num_heads=values["num_heads"],
                   relative_attention_num_buckets=values["relative_attention_num_buckets"],
                   relative_attention_max_distance=values["relative_attention_max_distance"],
                   layer_norm_epsilon=float(epsilon), dense_act_fn=activation, is_gated_act=gated)


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """int32 [length, length]: the bucket of each (query, key) pair's relative position
    (key - query) in a bidirectional T5 encoder, on the host.

    Half the buckets are for keys after the query. Within a half, distances below half of
    its buckets each have their own; longer ones share log-spaced buckets up to
    ``max_distance`` and the last bucket beyond. Computed in float32 as transformers'
    ``_relative_position_bucket`` does (a float64 log could round a distance into the
    next bucket on the boundaries)."""
    relative = np.arange(length)[None, :] - np.arange(length)[:, None]
    half = num_buckets // 2
    buckets = (relative > 0).astype(np.int64) * half
    distance = np.abs(relative)
    exact = half // 2
    scaled = (np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(exact))
              / np.float32(math.log(max_distance / exact)) * np.float32(half - exact))
    large = np.minimum(exact + scaled.astype(np.int64), half - 1)
    return (buckets + np.where(distance < exact, distance, large)).astype(np.int32)


class T5LayerNorm(nn.Module):
    """RMS layer norm: scale * x / sqrt(mean(x^2) + eps), the mean in float32; the result
    in the module's dtype."""
    epsilon: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        normed = x.astype(jnp.float32) * jax.lax.rsqrt(variance + self.epsilon)
        return scale.astype(self.dtype) * normed.astype(self.dtype)


class T5SelfAttention(nn.Module):
    """Multi-head self-attention with an additive position bias and unscaled scores.

    Its core stays here, not in ``pipeline.model.layers.attention``: the seam's kernels take no
    additive bias, and T5 runs once per prompt (not once per denoising step) on at most
    512 tokens, so its scores matrix is small. The softmax is in float32, as transformers
    computes it."""
    config: T5Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, bias):  # x [B, L, d_model]; bias [heads, L, L]
        cfg = self.config
        batch, length, _ = x.shape
        inner = cfg.num_heads * cfg.d_kv

        def project(name):
            out = nn.Dense(inner, use_bias=False, dtype=self.dtype, name=name)(x)
            return out.reshape(batch, length, cfg.num_heads, cfg.d_kv)

        q, k, v = project("q"), project("k"), project("v")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias[None].astype(q.dtype)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, inner)
        return nn.Dense(cfg.d_model, use_bias=False, dtype=self.dtype, name="o")(out)


class T5FeedForward(nn.Module):
    """T5's ``DenseReluDense``: gated (``wi_0``, ``wi_1``) or not (``wi``), then ``wo``,
    which runs in float32 as in transformers."""
    config: T5Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        act = ACTIVATIONS[cfg.dense_act_fn]
        dense = lambda name: nn.Dense(cfg.d_ff, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        hidden = act(dense("wi_0")(x)) * dense("wi_1")(x) if cfg.is_gated_act else act(dense("wi")(x))
        return nn.Dense(cfg.d_model, use_bias=False, dtype=jnp.float32, name="wo")(hidden.astype(jnp.float32))


class _SelfAttentionLayer(nn.Module):  # PyTorch's block.{i}.layer.0
    config: T5Config
    dtype: Any

    @nn.compact
    def __call__(self, x, bias):
        normed = T5LayerNorm(self.config.layer_norm_epsilon, self.dtype, name="layer_norm")(x)
        return x + T5SelfAttention(self.config, self.dtype, name="SelfAttention")(normed, bias).astype(x.dtype)


class _FeedForwardLayer(nn.Module):  # PyTorch's block.{i}.layer.1
    config: T5Config
    dtype: Any

    @nn.compact
    def __call__(self, x):
        normed = T5LayerNorm(self.config.layer_norm_epsilon, self.dtype, name="layer_norm")(x)
        return x + T5FeedForward(self.config, self.dtype, name="DenseReluDense")(normed).astype(x.dtype)


class _Layers(nn.Module):  # PyTorch's block.{i}.layer: its sub-layers are named 0 and 1 there
    config: T5Config
    dtype: Any

    @nn.compact
    def __call__(self, x, bias):
        x = _SelfAttentionLayer(self.config, self.dtype, name="0")(x, bias)
        return _FeedForwardLayer(self.config, self.dtype, name="1")(x)


class T5Block(nn.Module):
    """One encoder block; the scan's body: (residual stream, bias) -> (residual stream, None)."""
    config: T5Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, bias):
        return _Layers(self.config, self.dtype, name="layer")(x, bias), None


def position_bias(config: T5Config, length: int, dtype):
    """[heads, L, L]: the relative position bias every layer adds to its attention scores, of
    ``length`` tokens, from the bucket table (``relative_attention_bias``, a child of the
    compact module that calls this: PyTorch keeps it in the first layer)."""
    buckets = relative_position_buckets(length, config.relative_attention_num_buckets,
                                        config.relative_attention_max_distance)
    table = nn.Embed(config.relative_attention_num_buckets, config.num_heads, dtype=dtype,
                     name="relative_attention_bias")
    return table(jnp.asarray(buckets)).transpose(2, 0, 1)


class T5Stack(nn.Module):
    """PyTorch's ``encoder``: the position bias, the scanned blocks, the final norm.
    ``unroll``: layers per loop iteration (``nn.scan``'s): the same arithmetic, a loop
    XLA's cost analysis counts whole when it is all the layers."""
    config: T5Config
    dtype: Any = jnp.float32
    unroll: int = 1

    @nn.compact
    def __call__(self, embeds):
        bias = position_bias(self.config, embeds.shape[1], self.dtype)
        blocks = stacked(T5Block, self.config.num_layers, 1, self.unroll)(self.config, self.dtype, name="block")
        x, _ = blocks(embeds.astype(jnp.float32), bias)
        return T5LayerNorm(self.config.layer_norm_epsilon, self.dtype, name="final_layer_norm")(x)


class T5Encoder(nn.Module):
    """``T5Encoder(config, dtype)(input_ids [B, L] int) -> last hidden state [B, L, d_model]``
    in ``dtype``, as ``T5EncoderModel(input_ids)[0]`` without an attention mask.
    ``unroll``: see ``T5Stack``."""
    config: T5Config
    dtype: Any = jnp.float32
    unroll: int = 1

    @nn.compact
    def __call__(self, input_ids):
        embeds = nn.Embed(self.config.vocab_size, self.config.d_model, dtype=self.dtype, name="shared")(input_ids)
        return T5Stack(self.config, self.dtype, self.unroll, name="encoder")(embeds)


# The naming rule's exceptions (``convert``): the position bias every layer uses lives in
# the first layer in PyTorch; the token embedding is tied to encoder.embed_tokens (a file
# may hold either name or both); a T5ForConditionalGeneration file's decoder and head are
# not the encoder's.
TORCH_NAMES = convert.TorchNames(
    stacks=("encoder/block",),
    moved={"encoder/relative_attention_bias/embedding":
           "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"},
    aliases={"shared.weight": ("encoder.embed_tokens.weight",)},
    ignored=("decoder.", "lm_head."))


NETWORK = convert.Network(T5Encoder, convert.token_ids_example, TORCH_NAMES)
