"""Z-Image's single-stream transformer (diffusers' ``ZImageTransformer2DModel``, basic mode:
one image per prompt) as our own Flax Linen modules, in a fixed-shape program.

The forward pass, as diffusers 0.39 computes it (checked against its PyTorch module with
fixtures: tests/families/test_zimage.py):
- ``t_embedder``: the model's timestep t (1 - sigma) times ``t_scale`` as a 256-channel
  sinusoid through ``mlp.0`` (1024), SiLU, ``mlp.2`` (min(dim, 256)): the conditioning;
- image tokens: the latents' 2x2 patches (``patching.pack_latents(order="yxc")``: dy,
  dx, channel, channel fastest) through ``all_x_embedder.2-1``, padded to a multiple of
  32 tokens with the learned ``x_pad_token``, then ``noise_refiner`` (modulated blocks);
- caption tokens: the text encoder's states of each prompt's own L tokens through
  ``cap_embedder`` (RMSNorm, Linear), padded to its own P = L rounded up to 32 with the
  learned ``cap_pad_token``, then ``context_refiner`` (blocks without modulation);
- ``layers`` over [image tokens; caption tokens], then ``all_final_layer.2-1``
  (LayerNorm, scale 1 + linear(silu(c)), linear) on the image tokens.
A block: RMSNorm before and after both its attention and its SwiGLU feed-forward
(``w2(silu(w1 x) * w3 x)``); attention over all heads (diffusers builds k and v with
``n_heads`` whatever ``n_kv_heads`` says, and so does this), RMSNorm (eps 1e-5) on q and
k, no biases; a modulated block scales the norms' inputs by 1 + scale and gates its two
branches by tanh(gate) (``adaLN_modulation.0``, no shift).

Positions, 3 axes, rotated as interleaved pairs with frequencies looked up in tables of
``axes_lens`` entries (computed as diffusers does: float64 angles made float32): a caption
slot j of an item is (1 + j, 0, 0), pads included; its image tokens (P + 1, row, column),
P its own padded caption length, and the image's pad tokens (0, 0, 0). So an image's
positions depend on its own prompt's length, and only on it.

Fixed shapes: every item of a batch has the same image tokens; captions have up to Lmax
tokens (the run's ``--max-sequence-length``) and each item's caption segment is padded to
Pmax = Lmax rounded up to 32. The slots past an item's own P are batch padding: hidden
from every attention as keys (``attention.compute``'s ``key_lengths``: P in the context
refiner, image tokens + P in the main layers), exactly what the reference's attention
mask hides, and their outputs are never read. Each attention call goes through the seam
(site "zimage"). The three block stacks are ``nn.scan``-ned over stacked weights.

Parameter names are diffusers' PyTorch names split at the dots (``convert``); the pad
tokens are moved names (``TORCH_NAMES.moved``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from pipeline.model.layers import attention
from pipeline.model.layers.embeddings import timestep_embedding
from pipeline.model.layers.mlp import Indexed, SwiGLU
from pipeline.model.layers.norms import RMSNorm, layer_norm
from pipeline.model.layers.resnet import Numbered
from pipeline.model.layers.rotary import apply_rotary
from pipeline.model.layers.scan import stacked
from pipeline.model.loading import convert
from pipeline.model.loading.config_values import ConfigValues, is_int

CLASS_NAME = "ZImageTransformer2DModel"
ATTENTION_SITE = "zimage"
SEQ_MULTIPLE = 32  # each segment (image, caption) is padded to a multiple of it
ADALN_DIM = 256  # the conditioning's width is min(dim, this)
TIME_MID = 1024  # t_embedder's hidden width
QK_NORM_EPS = 1e-5  # diffusers' Attention(qk_norm="rms_norm", eps=1e-5)
PATCH = "2-1"  # the patching ZImagePipeline runs: 2x2 spatial, 1 frame
_DEFAULTS = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                 n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                 siglip_feat_dim=None, rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48),
                 axes_lens=(1024, 512, 512))


def round_up(n, multiple: int = SEQ_MULTIPLE):
    """``n`` rounded up to a multiple (ints or int arrays)."""
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ZImageConfig:
    """What the transformer's output depends on; ``from_dict`` reads its config.json (the
    defaults, ``ZImageTransformer2DModel``'s, are ``_DEFAULTS``)."""
    in_channels: int
    dim: int
    n_layers: int
    n_refiner_layers: int
    n_heads: int
    norm_eps: float
    qk_norm: bool
    cap_feat_dim: int
    rope_theta: float
    t_scale: float
    axes_dims: tuple[int, ...]
    axes_lens: tuple[int, ...]
    patch_size: int = 2  # the one patching ZImagePipeline samples with (``PATCH``)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_DIM)

    @property
    def hidden_dim(self) -> int:
        """The feed-forward's width, ``int(dim / 3 * 8)`` as diffusers computes it."""
        return int(self.dim / 3 * 8)

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.in_channels

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ZImageConfig:
        """The config of a diffusers ``transformer/config.json`` (missing keys at
        ``ZImageTransformer2DModel``'s defaults). ValueError naming the key and value for
        anything this module does not do (the Omni variant's SigLIP features, patchings
        other than the pipeline's 2x2)."""
        values = ConfigValues("transformer config", config, _DEFAULTS)
        values.class_name(CLASS_NAME)
        patches, frames = values["all_patch_size"], values["all_f_patch_size"]
        if list(patches or ()) != [2] or list(frames or ()) != [1]:
            values.refuse("all_patch_size", f"with all_f_patch_size={frames!r}: promptmill runs the one patching "
                                            f"ZImagePipeline samples with, 2x2 and 1 frame ([2] and [1])")
        if values["siglip_feat_dim"] is not None:
            values.refuse("siglip_feat_dim", "is set: that is Z-Image Omni's image conditioning, which promptmill "
                                             "does not run")
        values.ints(("in_channels", "dim", "n_heads", "cap_feat_dim"))
        values.ints(("n_layers", "n_refiner_layers"), least=0)
        values.positive_numbers(("norm_eps", "rope_theta", "t_scale"))
        values.boolean("qk_norm")
        dim, heads = values["dim"], values["n_heads"]
        if dim % heads:
            values.refuse("n_heads", f"does not divide dim {dim}")
        axes, lens = values["axes_dims"], values["axes_lens"]
        if (not isinstance(axes, (list, tuple)) or len(axes) != 3
                or not all(is_int(a) and a > 0 and a % 2 == 0 for a in axes)):
            values.refuse("axes_dims", "must be three positive even integers")
        if sum(axes) != dim // heads:
            values.refuse("axes_dims", f"sums to {sum(axes)}, not the head width dim / n_heads = {dim // heads}")
        if not isinstance(lens, (list, tuple)) or len(lens) != 3 or not all(is_int(n) and n > 1 for n in lens):
            values.refuse("axes_lens", "must be three integers above 1 (the rotary tables' lengths)")
        return cls(in_channels=values["in_channels"], dim=dim, n_layers=values["n_layers"],
                   n_refiner_layers=values["n_refiner_layers"], n_heads=heads, norm_eps=float(values["norm_eps"]),
                   qk_norm=values["qk_norm"], cap_feat_dim=values["cap_feat_dim"],
                   rope_theta=float(values["rope_theta"]), t_scale=float(values["t_scale"]), axes_dims=tuple(axes),
                   axes_lens=tuple(lens))

    def check_sizes(self, image_rows: int, image_cols: int, caption_tokens: int) -> None:
        """ValueError when an image of ``image_rows`` x ``image_cols`` tokens or a caption of
        ``caption_tokens`` would need positions beyond the rotary tables (torch raises on
        them; an index past a jnp table would be clamped in silence)."""
        padded = round_up(caption_tokens)
        if padded + 1 >= self.axes_lens[0]:
            raise ValueError(f"a caption of {caption_tokens} tokens (padded to {padded}) needs position {padded + 1} "
                             f"on the first axis, beyond its {self.axes_lens[0]}-entry rotary table (axes_lens)")
        for tokens, length, what in ((image_rows, self.axes_lens[1], "rows"), (image_cols, self.axes_lens[2],
                                                                                 "columns")):
            if tokens > length:
                raise ValueError(f"an image of {tokens} token {what} (2x2 latent patches) needs more positions than "
                                 f"the {length}-entry rotary table (axes_lens) holds: at most "
                                 f"{length} {what}")


# ---- rotary tables, as diffusers' RopeEmbedder.precompute_freqs_cis

def rotary_table(dim: int, length: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float32 [length, dim / 2] of positions 0..length-1: angles position *
    theta^(-2j/dim) in float64, made float32, then their cos and sin."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = np.outer(np.arange(length, dtype=np.float64), freqs).astype(np.float32)
    return np.cos(angles.astype(np.float64)).astype(np.float32), np.sin(angles.astype(np.float64)).astype(np.float32)


def _pairs(half):
    """[..., d/2] -> [..., d]: each angle's value for the two channels of its pair."""
    return jnp.repeat(half, 2, axis=-1)


def caption_rotation(config: ZImageConfig, slots: int):
    """(cos, sin) float32 [slots, head_dim] of caption slots j: positions (1 + j, 0, 0)."""
    cos, sin = [], []
    for axis, (dim, length) in enumerate(zip(config.axes_dims, config.axes_lens)):
        c, s = rotary_table(dim, length, config.rope_theta)
        rows = np.arange(1, slots + 1) if axis == 0 else np.zeros(slots, np.int64)
        cos.append(c[np.minimum(rows, length - 1)])
        sin.append(s[np.minimum(rows, length - 1)])
    return _pairs(jnp.asarray(np.concatenate(cos, -1))), _pairs(jnp.asarray(np.concatenate(sin, -1)))


def image_rotation(config: ZImageConfig, rows: int, cols: int, padded: int, caption_padded):
    """(cos, sin) float32 [B, padded, head_dim] of an image's tokens: (P + 1, row,
    column) for the rows x cols real ones, row-major, P each item's padded caption length
    (int [B]); (0, 0, 0) for the pad tokens up to ``padded``."""
    tokens = rows * cols
    grid_rows = np.repeat(np.arange(rows), cols)
    grid_cols = np.tile(np.arange(cols), rows)
    real = np.arange(padded) < tokens
    cos, sin = [], []
    for axis, (dim, length) in enumerate(zip(config.axes_dims, config.axes_lens)):
        c, s = (jnp.asarray(t) for t in rotary_table(dim, length, config.rope_theta))
        if axis == 0:
            first = jnp.asarray(caption_padded) + 1  # [B]
            index = jnp.where(jnp.asarray(real)[None, :], first[:, None], 0)  # [B, padded]
        else:
            grid = grid_rows if axis == 1 else grid_cols
            index = jnp.asarray(np.where(real, np.pad(grid, (0, padded - tokens)), 0))[None, :]
            index = jnp.broadcast_to(index, (jnp.shape(caption_padded)[0], padded))
        cos.append(c[index])
        sin.append(s[index])
    return _pairs(jnp.concatenate(cos, -1)), _pairs(jnp.concatenate(sin, -1))


# ---- modules

class Attention(nn.Module):
    """diffusers' ``Attention`` with ``ZSingleStreamAttnProcessor``: q, k, v (no biases),
    RMS-normed q and k, rotated, attended through the seam, ``to_out.0``."""
    config: ZImageConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, key_lengths):
        cfg = self.config
        shape = (*x.shape[:2], cfg.n_heads, cfg.head_dim)
        q, k, v = (nn.Dense(cfg.dim, use_bias=False, dtype=self.dtype, name=n)(x).reshape(shape)
                   for n in ("to_q", "to_k", "to_v"))
        if cfg.qk_norm:
            q, k = RMSNorm(QK_NORM_EPS, name="norm_q")(q), RMSNorm(QK_NORM_EPS, name="norm_k")(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention.compute(ATTENTION_SITE, q, k, v, cfg.head_dim ** -0.5, key_lengths=key_lengths)
        out = out.reshape(*x.shape[:2], cfg.dim).astype(x.dtype)
        return Indexed(cfg.dim, "0", self.dtype, use_bias=False, name="to_out")(out)


class Block(nn.Module):
    """diffusers' ``ZImageTransformerBlock``; the scan body: (tokens, conditioning, cos,
    sin, key lengths) -> (tokens, None). ``modulation``: the noise refiner's and the main
    layers' (the context refiner's blocks have none, and read no conditioning)."""
    config: ZImageConfig
    modulation: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, adaln, cos, sin, key_lengths):
        cfg = self.config

        def norm(name):
            return RMSNorm(cfg.norm_eps, name=name)

        attend = Attention(cfg, self.dtype, name="attention")
        ff = SwiGLU(cfg.hidden_dim, cfg.dim, ("w1", "w3", "w2"), self.dtype, name="feed_forward")  # w2(silu(w1) * w3)
        if self.modulation:
            mod = Indexed(4 * cfg.dim, "0", self.dtype, name="adaLN_modulation")(adaln)[:, None, :]
            scale_msa, gate_msa, scale_mlp, gate_mlp = jnp.split(mod, 4, axis=-1)
            gate_msa, gate_mlp = jnp.tanh(gate_msa), jnp.tanh(gate_mlp)
            out = attend(norm("attention_norm1")(x) * (1.0 + scale_msa), cos, sin, key_lengths)
            x = x + gate_msa * norm("attention_norm2")(out)
            return x + gate_mlp * norm("ffn_norm2")(ff(norm("ffn_norm1")(x) * (1.0 + scale_mlp))), None
        x = x + norm("attention_norm2")(attend(norm("attention_norm1")(x), cos, sin, key_lengths))
        return x + norm("ffn_norm2")(ff(norm("ffn_norm1")(x))), None


class TimeMLP(nn.Module):
    """``mlp``: ``0`` (1024), SiLU, ``2`` (min(dim, 256))."""
    config: ZImageConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        hidden = nn.Dense(TIME_MID, dtype=self.dtype, name="0")(x)
        return nn.Dense(self.config.adaln_dim, dtype=self.dtype, name="2")(nn.silu(hidden))


class TimestepEmbedder(nn.Module):
    """``t_embedder``: the 256-channel sinusoid of t through ``mlp``."""
    config: ZImageConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, t):
        return TimeMLP(self.config, self.dtype, name="mlp")(timestep_embedding(t).astype(self.dtype))


class FinalLayer(nn.Module):
    """LayerNorm (no affine, eps 1e-6) times 1 + ``adaLN_modulation.1``(silu(c)), then
    ``linear``."""
    config: ZImageConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, adaln):
        scale = 1.0 + Indexed(self.config.dim, "1", self.dtype, name="adaLN_modulation")(nn.silu(adaln))
        x = layer_norm(x, 1e-6) * scale[:, None, :]
        return nn.Dense(self.config.patch_dim, dtype=self.dtype, name="linear")(x)


class PatchEmbedder(nn.Module):
    """``all_x_embedder``: the ``2-1`` patching's Linear (patches -> width)."""
    config: ZImageConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(self.config.dim, dtype=self.dtype, name=PATCH)(tokens.astype(self.dtype))


class OutputLayer(nn.Module):
    """``all_final_layer``: the ``2-1`` patching's ``FinalLayer``."""
    config: ZImageConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, adaln):
        return FinalLayer(self.config, self.dtype, name=PATCH)(x, adaln)


class ZImageTransformer(nn.Module):
    """``ZImageTransformer(config, dtype)(image_tokens, caption_states, caption_lengths, t)
    -> [B, X, 4C]``:

    - image_tokens [B, X, 4C]: the latents' 2x2 patches (``pack_latents(order="yxc")``),
      rows x cols = X tokens, ``rows`` given as the ``image_rows`` keyword;
    - caption_states [B, Lmax, cap_feat_dim]: the text encoder's states, each item's first
      caption_lengths[i] rows its own (the rest are never read);
    - t [B]: the model's timestep, 1 - sigma (times ``t_scale`` inside, as diffusers).
    Returns the model's output for the image tokens (the pipeline negates it), in the
    module's dtype. ``unroll``: blocks per loop iteration of each scanned stack."""
    config: ZImageConfig
    dtype: Any = jnp.float32
    unroll: int = 1

    @nn.compact
    def __call__(self, image_tokens, caption_states, caption_lengths, t, *, image_rows: int):
        cfg = self.config
        batch, tokens, _ = image_tokens.shape
        cols = tokens // image_rows
        padded_image, padded_caption = round_up(tokens), round_up(caption_states.shape[1])
        lengths = jnp.asarray(caption_lengths, jnp.int32)
        caption_padded = round_up(lengths)  # each item's own P
        adaln = TimestepEmbedder(cfg, self.dtype, name="t_embedder")(t.astype(jnp.float32) * cfg.t_scale)

        def stack(name, count, modulation):
            return stacked(Block, count, 4, max(1, min(self.unroll, count)))(cfg, modulation, self.dtype, name=name)

        x = PatchEmbedder(cfg, self.dtype, name="all_x_embedder")(image_tokens)
        x_pad = self.param("x_pad_token", nn.initializers.zeros, (1, cfg.dim)).astype(self.dtype)
        x = jnp.concatenate([x, jnp.broadcast_to(x_pad[None], (batch, padded_image - tokens, cfg.dim))], axis=1)
        img_cos, img_sin = image_rotation(cfg, image_rows, cols, padded_image, caption_padded)
        if cfg.n_refiner_layers:
            x, _ = stack("noise_refiner", cfg.n_refiner_layers, True)(x, adaln, img_cos, img_sin, None)

        embed = Numbered(name="cap_embedder")  # diffusers' Sequential(RMSNorm, Linear)
        cap = embed(lambda: RMSNorm(cfg.norm_eps, name="0"), caption_states.astype(self.dtype))
        cap = embed(lambda: nn.Dense(cfg.dim, dtype=self.dtype, name="1"), cap)
        cap = jnp.pad(cap, ((0, 0), (0, padded_caption - cap.shape[1]), (0, 0)))
        cap_pad = self.param("cap_pad_token", nn.initializers.zeros, (1, cfg.dim)).astype(self.dtype)
        own = jnp.arange(padded_caption)[None, :, None] < lengths[:, None, None]
        cap = jnp.where(own, cap, cap_pad[None])
        cap_cos, cap_sin = caption_rotation(cfg, padded_caption)
        if cfg.n_refiner_layers:
            cap, _ = stack("context_refiner", cfg.n_refiner_layers, False)(cap, adaln, cap_cos, cap_sin,
                                                                           caption_padded)

        unified = jnp.concatenate([x, cap], axis=1)
        cos = jnp.concatenate([img_cos, jnp.broadcast_to(cap_cos[None], (batch, *cap_cos.shape))], axis=1)
        sin = jnp.concatenate([img_sin, jnp.broadcast_to(cap_sin[None], (batch, *cap_sin.shape))], axis=1)
        if cfg.n_layers:
            unified, _ = stack("layers", cfg.n_layers, True)(unified, adaln, cos, sin, padded_image + caption_padded)
        return OutputLayer(cfg, self.dtype, name="all_final_layer")(unified[:, :tokens], adaln)


STACKS = ("noise_refiner", "context_refiner", "layers")
TORCH_NAMES = convert.TorchNames(stacks=STACKS,
                                 moved={"x_pad_token": "x_pad_token", "cap_pad_token": "cap_pad_token"})


def _example(config: ZImageConfig):
    return ((jnp.zeros((1, 4, config.patch_dim)), jnp.zeros((1, 2, config.cap_feat_dim)), jnp.ones((1,), jnp.int32),
             jnp.zeros((1,))), {"image_rows": 2})


NETWORK = convert.Network(ZImageTransformer, _example, TORCH_NAMES)
