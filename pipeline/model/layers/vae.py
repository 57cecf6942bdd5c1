"""The VAE decode of every family: latents to images, with our own decoder.

One decoder, diffusers' ``AutoencoderKL.decode`` (its ``Decoder``: ``conv_in``, a mid
block of two ResNet blocks around a one-head self-attention, ``UpDecoderBlock2D`` blocks
of ``layers_per_block + 1`` ResNet blocks and a 2x upsampler each but the last,
``conv_norm_out``, SiLU, ``conv_out``), its variants config-driven: the quant convs,
latent channels, scaling and shift (``AutoencoderKL``: SD 1.x/2.x and SDXL decode
``z / scaling_factor``, FLUX.1 and Z-Image ``z / scaling_factor + shift_factor``), and
``AutoencoderKLFlux2``'s: its latents come 2x2-patched ([B, 4C, h, w], channel
``c*4 + 2*dy + dx``) and normalised by a batch norm's running statistics, so the decode
first un-normalises them (``z * sqrt(var + eps) + mean``, the 4C statistics
``bn.running_mean``/``bn.running_var`` of its state dict, in float32), unpatches them and
decodes them with no scaling or shift, as diffusers' FLUX.2 pipelines do;
``decoder_block_out_channels`` gives the decoder channels of its own.

The parameter names are the PyTorch module's (``decoder.up_blocks.0.resnets.1.conv1``...;
``convert``'s rule), so a checkpoint's safetensors load by rule, as do the older names of
the mid block's attention (``query``/``key``/``value``/``proj_attn``, which diffusers still
reads) and diffusers' Flax msgpack (``from_flax``); the encoder's weights are not read
(decoding never uses them). Its attention goes through the attention seam
(``pipeline.model.layers.attention.compute``, site "vae").

``VaeConfig.from_dict`` reads the whole ``vae/config.json`` and refuses what the decoder
would silently do otherwise: another ``act_fn`` or block type is refused by name. Keys the
pipelines' decode never reads (the encoder's, ``force_upcast``, ``sample_size``: tiling is
off) do not change its images, here as there.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from pipeline.model.layers import attention
from pipeline.model.layers.norms import GroupNorm
from pipeline.model.layers.resnet import Numbered, ResnetBlock2D, Upsample2D, conv
from pipeline.model.loading import convert

CLASS_NAME = "AutoencoderKL"
FLUX2_CLASS_NAME = "AutoencoderKLFlux2"  # the batch-norm, 2x2-patch variant
_DEFAULTS = dict(out_channels=3, up_block_types=("UpDecoderBlock2D",), block_out_channels=(64,), layers_per_block=1,
                 act_fn="silu", latent_channels=4, norm_num_groups=32, scaling_factor=0.18215, shift_factor=None,
                 use_quant_conv=True, use_post_quant_conv=True, mid_block_add_attention=True,
                 decoder_block_out_channels=None)
# AutoencoderKLFlux2's own defaults (diffusers 0.39), where they differ
_FLUX2_DEFAULTS = dict(_DEFAULTS, latent_channels=32, block_out_channels=(128, 256, 512, 512),
                       up_block_types=("UpDecoderBlock2D",) * 4, batch_norm_eps=1e-4, patch_size=(2, 2))


@dataclasses.dataclass(frozen=True)
class VaeConfig:
    """What FluxPipeline's decode depends on."""
    latent_channels: int = 16
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    scaling_factor: float = 0.3611
    shift_factor: float = 0.1159
    use_post_quant_conv: bool = False
    use_quant_conv: bool = False  # the encoder's: never used by a decode, read to write checkpoints
    mid_block_add_attention: bool = True
    decoder_block_out_channels: tuple[int, ...] | None = None  # None: block_out_channels
    # the FLUX.2 variant: latents normalised by a batch norm of this eps, in 2x2 patches (None, 1: neither)
    batch_norm_eps: float | None = None
    patch_size: int = 1

    @property
    def decoder_channels(self) -> tuple[int, ...]:
        return self.decoder_block_out_channels or self.block_out_channels

    @property
    def latent_input_channels(self) -> int:
        """The channels of the latents the decode takes: patched ones hold patch_size**2 each."""
        return self.latent_channels * self.patch_size ** 2

    @property
    def scale_factor(self) -> int:
        """Image pixels per latent, each way (FluxPipeline's ``vae_scale_factor``)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], shifted: bool = True) -> VaeConfig:
        """The config of a diffusers ``vae/config.json`` (missing keys at ``AutoencoderKL``'s
        defaults); ValueError naming the key and value that the decode would not honour.
        ``shifted``: the family's pipeline decodes ``z / scaling_factor + shift_factor``
        (FLUX.1, Z-Image), so the shift must be given; else (SD 1.x/2.x, SDXL) it decodes
        ``z / scaling_factor`` and the shift is 0 whatever the config says, as there."""
        def refuse(key, why):
            raise ValueError(f"vae config: {key}={config.get(key)!r} {why}")

        class_name = config.get("_class_name", CLASS_NAME)
        if class_name not in (CLASS_NAME, FLUX2_CLASS_NAME):
            refuse("_class_name", f"is neither {CLASS_NAME} nor {FLUX2_CLASS_NAME}")
        flux2 = class_name == FLUX2_CLASS_NAME
        values = {key: config.get(key, default) for key, default in (_FLUX2_DEFAULTS if flux2 else _DEFAULTS).items()}
        if values["act_fn"] not in ("silu", "swish"):
            refuse("act_fn", "is not silu, the only activation promptmill's decoder has")
        if not isinstance(values["mid_block_add_attention"], bool):
            refuse("mid_block_add_attention", "must be true or false")
        blocks = values["block_out_channels"]
        if not isinstance(blocks, (list, tuple)) or not blocks or not all(
                isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in blocks):
            refuse("block_out_channels", "must be a list of positive integers")
        decoder = values["decoder_block_out_channels"]
        if decoder is not None and (not isinstance(decoder, (list, tuple)) or not decoder or not all(
                isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in decoder)):
            refuse("decoder_block_out_channels", "must be a list of positive integers")
        decoder = tuple(decoder) if decoder else None
        types = values["up_block_types"]
        if not isinstance(types, (list, tuple)) or list(types) != ["UpDecoderBlock2D"] * len(decoder or blocks):
            refuse("up_block_types", f"is not {len(decoder or blocks)} x UpDecoderBlock2D, the only decoder block "
                                     f"promptmill's decoder has (one per decoder channel entry)")
        for key in ("latent_channels", "out_channels", "layers_per_block", "norm_num_groups"):
            if isinstance(values[key], bool) or not isinstance(values[key], int) or values[key] < 1:
                refuse(key, "must be a positive integer")
        if any(c % values["norm_num_groups"] for c in (*blocks, *(decoder or ()))):
            refuse("norm_num_groups", f"does not divide every block's channels {list(blocks)}")
        patch, eps = 1, None
        if flux2:  # scaling and shift play no part: the batch norm's statistics normalise the latents
            if tuple(values["patch_size"]) != (2, 2):
                refuse("patch_size", "is not (2, 2), the only patching FLUX.2's pipelines unpatch")
            eps = values["batch_norm_eps"]
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
                refuse("batch_norm_eps", "must be a positive number")
            patch, eps = 2, float(eps)
            values["scaling_factor"], values["shift_factor"] = 1.0, 0.0
        if not shifted:
            values["shift_factor"] = 0.0
        for key in ("scaling_factor", "shift_factor"):
            value = values[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                refuse(key, "must be a number (FluxPipeline decodes latents / scaling_factor + shift_factor)")
        if values["scaling_factor"] == 0:
            refuse("scaling_factor", "must not be 0")
        for key in ("use_quant_conv", "use_post_quant_conv"):
            if not isinstance(values[key], bool):
                refuse(key, "must be true or false")
        return cls(latent_channels=values["latent_channels"], out_channels=values["out_channels"],
                   block_out_channels=tuple(blocks), layers_per_block=values["layers_per_block"],
                   norm_num_groups=values["norm_num_groups"], scaling_factor=float(values["scaling_factor"]),
                   shift_factor=float(values["shift_factor"]), use_post_quant_conv=values["use_post_quant_conv"],
                   use_quant_conv=values["use_quant_conv"], decoder_block_out_channels=decoder, batch_norm_eps=eps,
                   patch_size=patch, mid_block_add_attention=values["mid_block_add_attention"])


def unpatch(latents, patch: int):
    """[B, C*p*p, h, w] patched latents (channel ``c*p*p + p*dy + dx``) -> [B, C, h*p, w*p],
    as diffusers' FLUX.2 pipelines' ``_unpatchify_latents``. numpy or jax."""
    batch, channels, height, width = latents.shape
    grid = latents.reshape(batch, channels // (patch * patch), patch, patch, height, width)
    return grid.transpose(0, 1, 4, 2, 5, 3).reshape(batch, channels // (patch * patch), height * patch,
                                                    width * patch)


class BatchNormStatistics(nn.Module):
    """A batch norm's running statistics (PyTorch's ``bn.running_mean``/``bn.running_var``),
    undone: ``x * sqrt(var + eps) + mean`` over the channel axis, in float32."""
    channels: int
    eps: float

    @nn.compact
    def __call__(self, x):
        mean = self.param("running_mean", nn.initializers.zeros, (self.channels,)).astype(jnp.float32)
        var = self.param("running_var", nn.initializers.ones, (self.channels,)).astype(jnp.float32)
        std = jnp.sqrt(var + jnp.float32(self.eps))
        return x.astype(jnp.float32) * std[None, :, None, None] + mean[None, :, None, None]


class VaeAttention(nn.Module):
    """The mid block's self-attention over every pixel, one head of all the channels:
    ``group_norm``, then ``to_q``/``to_k``/``to_v`` (with biases), softmax(q k^T / sqrt(C)) v
    through the seam, ``to_out.0``, added back (diffusers' ``Attention`` with
    ``residual_connection``)."""
    groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        batch, height, width, channels = x.shape
        flat = GroupNorm(self.groups, 1e-6, self.dtype, name="group_norm")(x).reshape(batch, height * width, channels)

        def project(name):
            return nn.Dense(channels, dtype=self.dtype, name=name)(flat).reshape(batch, height * width, 1, channels)

        out = attention.compute("vae", project("to_q"), project("to_k"), project("to_v"), channels ** -0.5)
        out = Numbered(name="to_out")(lambda: nn.Dense(channels, dtype=self.dtype, name="0"),
                                      out.reshape(batch, height * width, channels))
        return out.reshape(x.shape) + x


class _MidBlock(nn.Module):
    """diffusers' ``UNetMidBlock2D`` of the decoder: ``resnets.0``, ``attentions.0`` (when
    the config has it), ``resnets.1``; no time embedding."""
    channels: int
    groups: int
    with_attention: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        resnets = Numbered(name="resnets")
        x = resnets(lambda: ResnetBlock2D(self.channels, self.groups, 1e-6, dtype=self.dtype, name="0"), x)
        if self.with_attention:
            x = Numbered(name="attentions")(lambda: VaeAttention(self.groups, self.dtype, name="0"), x)
        return resnets(lambda: ResnetBlock2D(self.channels, self.groups, 1e-6, dtype=self.dtype, name="1"), x)


class _UpDecoderBlock(nn.Module):
    """diffusers' ``UpDecoderBlock2D``: ``resnets.0..layers-1``, then ``upsamplers.0`` unless last."""
    channels: int
    layers: int
    groups: int
    upsample: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        resnets = Numbered(name="resnets")
        for i in range(self.layers):
            x = resnets(lambda i=i: ResnetBlock2D(self.channels, self.groups, 1e-6, dtype=self.dtype, name=str(i)), x)
        if self.upsample:
            x = Numbered(name="upsamplers")(lambda: Upsample2D(self.channels, self.dtype, name="0"), x)
        return x


class Decoder(nn.Module):
    """diffusers' ``Decoder`` (see the module's docstring) on NHWC latents."""
    config: VaeConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, z):
        cfg = self.config
        channels = cfg.decoder_channels[::-1]
        groups = cfg.norm_num_groups
        x = conv(channels[0], 3, self.dtype, "conv_in")(z)
        x = _MidBlock(channels[0], groups, cfg.mid_block_add_attention, self.dtype, name="mid_block")(x)
        blocks = Numbered(name="up_blocks")
        for i, out in enumerate(channels):
            x = blocks(lambda i=i, out=out: _UpDecoderBlock(out, cfg.layers_per_block + 1, groups,
                                                            i < len(channels) - 1, self.dtype, name=str(i)), x)
        x = nn.silu(GroupNorm(groups, 1e-6, self.dtype, name="conv_norm_out")(x))
        return conv(cfg.out_channels, 3, self.dtype, "conv_out")(x)


class VaeDecoder(nn.Module):
    """``VaeDecoder(config, dtype)(latents [B, C, h, w]) -> [B, 3, h*f, w*f]``: the
    autoencoder's ``decode`` (its post-quant conv where the config has one, then the
    decoder), in ``dtype``, on latents already unscaled and shifted; the FLUX.2 variant's
    latents ([B, 4C, h/2, w/2]) are un-normalised by its batch norm's statistics and
    unpatched first."""
    config: VaeConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, latents):
        cfg = self.config
        if cfg.batch_norm_eps is not None:
            latents = BatchNormStatistics(cfg.latent_input_channels, cfg.batch_norm_eps, name="bn")(latents)
            latents = unpatch(latents, cfg.patch_size).astype(self.dtype)
        z = latents.transpose(0, 2, 3, 1).astype(self.dtype)  # the decoder is NHWC
        if cfg.use_post_quant_conv:
            z = conv(cfg.latent_channels, 1, self.dtype, "post_quant_conv")(z)
        return Decoder(cfg, self.dtype, name="decoder")(z).transpose(0, 3, 1, 2)


def vae_decode(module: VaeDecoder, params, latents, config: VaeConfig):
    """float32 images [B, H, W, 3] in [0, 1] from a pipeline's final latents, unpacked,
    [B, C, H/f, W/f]: ``latents / scaling_factor + shift_factor`` (in float32, then the
    module's dtype), decoded, then ``x / 2 + 0.5`` clamped to [0, 1], as diffusers'
    ``VaeImageProcessor.postprocess`` does."""
    z = latents.astype(jnp.float32) / config.scaling_factor + config.shift_factor
    images = module.apply({"params": params}, z.astype(module.dtype))
    return jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)


# the older names of the mid block's attention, which diffusers still reads (its
# ``_convert_deprecated_attention_blocks``); diffusers' Flax module keeps them too
_OLD_ATTENTION = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
_FLAX_RENAMES = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out_0": "proj_attn"}
# the PyTorch weights a decode never reads
_UNUSED = ("encoder.", "quant_conv.", "bn.num_batches_tracked")


def _torch_names(config: VaeConfig) -> convert.TorchNames:
    aliases = {}
    for path in NETWORK.param_shapes(config):
        name = convert.torch_name(path, _PLAIN_NAMES)
        for new, old in _OLD_ATTENTION.items():
            if f".attentions.0.{new}." in name:
                aliases[name] = (name.replace(f".attentions.0.{new}.", f".attentions.0.{old}."),)
    ignored = _UNUSED + (() if config.use_post_quant_conv else ("post_quant_conv.",))
    return convert.TorchNames(stacks=(), aliases=aliases, ignored=ignored)


_PLAIN_NAMES = convert.TorchNames(stacks=())


@dataclasses.dataclass(frozen=True)
class DecoderNetwork(convert.Network):
    """The decoder's ``convert.Network``, whose PyTorch names depend on its config."""

    def from_torch(self, state: Mapping[str, np.ndarray], config: VaeConfig, where: str) -> dict:
        """Decoder params from an ``AutoencoderKL`` or ``AutoencoderKLFlux2`` state dict
        ({name: array}) by the naming rule (the mid block's attention under its new or its
        older names), each array in its stored dtype (convolutions' axes moved, as views);
        WeightsError naming any missing, misshapen or unknown weight. The encoder's,
        ``quant_conv``'s and the batch norm's counter are skipped."""
        return convert.from_torch(state, self.param_shapes(config), _torch_names(config), where)

    def to_torch(self, params: Mapping) -> dict[str, np.ndarray]:
        """The decoder's part of an autoencoder's state dict ({PyTorch name: array in its
        param's dtype}), ``from_torch``'s inverse; the FLUX.2 variant's batch norm with its
        counter, as PyTorch saves one."""
        state = convert.to_torch(params, _PLAIN_NAMES)
        if "bn" in params:
            state["bn.num_batches_tracked"] = np.zeros((), np.int64)
        return state


NETWORK = DecoderNetwork(VaeDecoder, lambda config: ((jnp.zeros((1, config.latent_input_channels, 1, 1)),), {}),
                         _PLAIN_NAMES)


def from_flax(flat: Mapping[tuple[str, ...], np.ndarray], config: VaeConfig, where: str = "vae") -> dict:
    """Decoder params from the flat params of diffusers' ``FlaxAutoencoderKL`` (a
    ``diffusion_flax_model.msgpack``): its ``decoder/up_blocks_0/...`` and attention's
    ``query``/``key``/``value``/``proj_attn``; the encoder's are skipped."""
    ignored = ("encoder/", "quant_conv/") + (() if config.use_post_quant_conv else ("post_quant_conv/",))
    return convert.from_flax(flat, NETWORK.param_shapes(config), _PLAIN_NAMES, where, joined=True,
                             renames=_FLAX_RENAMES, ignored=ignored)



def encoder_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """{PyTorch name: shape} of an ``AutoencoderKL``'s encoder and ``quant_conv`` (from its
    ``vae/config.json``, diffusers' defaults for missing keys): what a checkpoint holds
    besides the decoder, for the built-in models, whose files diffusers loads too."""
    blocks = list(config.get("block_out_channels", _DEFAULTS["block_out_channels"]))
    layers = config.get("layers_per_block", _DEFAULTS["layers_per_block"])
    latent = config.get("latent_channels", _DEFAULTS["latent_channels"])
    shapes: dict[str, tuple[int, ...]] = {}

    def conv_shape(name, out, fan_in, kernel=3):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (out, fan_in, kernel, kernel), (out,)

    def norm(name, channels):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (channels,), (channels,)

    def resnet(name, fan_in, out):
        norm(f"{name}.norm1", fan_in)
        conv_shape(f"{name}.conv1", out, fan_in)
        norm(f"{name}.norm2", out)
        conv_shape(f"{name}.conv2", out, out)
        if fan_in != out:
            conv_shape(f"{name}.conv_shortcut", out, fan_in, 1)

    conv_shape("encoder.conv_in", blocks[0], config.get("in_channels", 3))
    fan_in = blocks[0]
    for i, out in enumerate(blocks):
        for j in range(layers):
            resnet(f"encoder.down_blocks.{i}.resnets.{j}", fan_in if j == 0 else out, out)
        if i < len(blocks) - 1:
            conv_shape(f"encoder.down_blocks.{i}.downsamplers.0.conv", out, out)
        fan_in = out
    last = blocks[-1]
    resnet("encoder.mid_block.resnets.0", last, last)
    if config.get("mid_block_add_attention", True):
        norm("encoder.mid_block.attentions.0.group_norm", last)
        for name in ("to_q", "to_k", "to_v", "to_out.0"):
            shapes[f"encoder.mid_block.attentions.0.{name}.weight"] = (last, last)
            shapes[f"encoder.mid_block.attentions.0.{name}.bias"] = (last,)
    resnet("encoder.mid_block.resnets.1", last, last)
    norm("encoder.conv_norm_out", last)
    conv_shape("encoder.conv_out", 2 * latent, last)
    if config.get("use_quant_conv", True):
        conv_shape("quant_conv", 2 * latent, 2 * latent, 1)
    return shapes
