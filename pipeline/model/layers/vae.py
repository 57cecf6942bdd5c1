"""FLUX.1's VAE decode: latents to images, with diffusers' Flax decoder.

FLUX.1's ``AutoencoderKL`` has 16 latent channels and no quant convs
(``use_quant_conv`` and ``use_post_quant_conv`` false), and FluxPipeline decodes
``z / scaling_factor + shift_factor``. diffusers' ``FlaxAutoencoderKL`` (0.39) always
builds both quant convs and knows no shift, so ``VaeDecoder`` runs its ``FlaxDecoder``
submodule directly, with ``post_quant_conv`` only where the config has one. The
parameter names are those of ``FlaxAutoencoderKL`` (``decoder/...``,
``post_quant_conv/...``), converted from PyTorch safetensors by diffusers' own renaming
rules; the encoder's weights are not read (decoding never uses them).

One decoder, its variants config-driven: quant convs, latent channels, scaling and shift
(``AutoencoderKL``), and ``AutoencoderKLFlux2``'s: its latents come 2x2-patched
([B, 4C, h, w], channel ``c*4 + 2*dy + dx``) and normalised by a batch norm's running
statistics, so the decode first un-normalises them (``z * sqrt(var + eps) + mean``, the
4C statistics ``bn.running_mean``/``bn.running_var`` of its state dict, in float32),
unpatches them and decodes them with no scaling or shift, as diffusers' FLUX.2
pipelines do; ``decoder_block_out_channels`` gives the decoder channels of its own.

``VaeConfig.from_dict`` reads the whole ``vae/config.json`` and refuses what the Flax
decoder would silently do otherwise: it hard-codes SiLU, the ``UpDecoderBlock2D`` blocks
and the mid-block attention, so another ``act_fn``, block type or
``mid_block_add_attention: false`` is refused by name. Keys FluxPipeline's decode never
reads (the encoder's, ``force_upcast``, ``latents_mean``/``latents_std``, ``sample_size``:
tiling is off) do not change its images, here as there.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from pipeline.model.loading import convert
from pipeline.model.loading.weights import WeightsError

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
    def from_dict(cls, config: Mapping[str, Any]) -> VaeConfig:
        """The config of a diffusers ``vae/config.json`` (missing keys at ``AutoencoderKL``'s
        defaults); ValueError naming the key and value that the decode would not honour."""
        def refuse(key, why):
            raise ValueError(f"vae config: {key}={config.get(key)!r} {why}")

        class_name = config.get("_class_name", CLASS_NAME)
        if class_name not in (CLASS_NAME, FLUX2_CLASS_NAME):
            refuse("_class_name", f"is neither {CLASS_NAME} nor {FLUX2_CLASS_NAME}")
        flux2 = class_name == FLUX2_CLASS_NAME
        values = {key: config.get(key, default) for key, default in (_FLUX2_DEFAULTS if flux2 else _DEFAULTS).items()}
        if values["act_fn"] != "silu":
            refuse("act_fn", "is not silu, the only activation diffusers' Flax decoder has")
        if not values["mid_block_add_attention"]:
            refuse("mid_block_add_attention", "drops the mid-block attention, which diffusers' Flax decoder always has")
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
                                     f"diffusers' Flax decoder has (one per decoder channel entry)")
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
                   patch_size=patch)


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
        from diffusers.models.vae_flax import FlaxDecoder

        cfg = self.config
        if cfg.batch_norm_eps is not None:
            latents = BatchNormStatistics(cfg.latent_input_channels, cfg.batch_norm_eps, name="bn")(latents)
            latents = unpatch(latents, cfg.patch_size).astype(self.dtype)
        z = latents.transpose(0, 2, 3, 1)  # the Flax decoder is NHWC
        if cfg.use_post_quant_conv:
            z = nn.Conv(cfg.latent_channels, kernel_size=(1, 1), padding="VALID", dtype=self.dtype,
                        name="post_quant_conv")(z)
        images = FlaxDecoder(in_channels=cfg.latent_channels, out_channels=cfg.out_channels,
                             up_block_types=("UpDecoderBlock2D",) * len(cfg.decoder_channels),
                             block_out_channels=cfg.decoder_channels, layers_per_block=cfg.layers_per_block,
                             norm_num_groups=cfg.norm_num_groups, dtype=self.dtype, name="decoder")(z)
        return images.transpose(0, 3, 1, 2)


def vae_decode(module: VaeDecoder, params, latents, config: VaeConfig):
    """float32 images [B, H, W, 3] in [0, 1] from FluxPipeline's final latents, unpacked,
    [B, C, H/f, W/f]: ``latents / scaling_factor + shift_factor`` (in float32, then the
    module's dtype), decoded, then ``x / 2 + 0.5`` clamped to [0, 1], as diffusers'
    ``VaeImageProcessor.postprocess`` does."""
    z = latents.astype(jnp.float32) / config.scaling_factor + config.shift_factor
    images = module.apply({"params": params}, z.astype(module.dtype))
    return jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)


# the decoder's shapes; its weights come by diffusers' own renaming rules (``from_torch``)
NETWORK = convert.Network(VaeDecoder, lambda config: ((jnp.zeros((1, config.latent_input_channels, 1, 1)),), {}))


def param_shapes(config: VaeConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{flat param path: shape} of the decoder, from its config alone."""
    return NETWORK.param_shapes(config)


# the PyTorch weights a decode never reads
_UNUSED = ("encoder.", "quant_conv.", "bn.num_batches_tracked")
_STATISTICS = ("bn.running_mean", "bn.running_var")  # the FLUX.2 variant's, as they are (1-D)


def from_torch(state: Mapping[str, np.ndarray], config: VaeConfig, where: str = "vae") -> dict:
    """Decoder params from an ``AutoencoderKL`` state dict ({name: array}) by diffusers'
    PyTorch-to-Flax renaming rules, each array in its stored dtype (convolutions
    transposed to HWIO, as views); WeightsError naming any missing, misshapen or unknown
    weight. The encoder's and ``quant_conv``'s weights are skipped."""
    from diffusers.models.modeling_flax_pytorch_utils import rename_key, rename_key_and_reshape_tensor

    shapes = {path: _Spec(shape) for path, shape in param_shapes(config).items()}
    flat, odd, unknown = {}, [], []
    for name, tensor in state.items():
        if name.startswith(_UNUSED) or (name.startswith("post_quant_conv.") and not config.use_post_quant_conv):
            continue
        if name in _STATISTICS:
            key, array = tuple(name.split(".")), tensor
        else:
            key, array = rename_key_and_reshape_tensor(tuple(rename_key(name).split(".")), tensor, shapes)
        if key not in shapes:
            unknown.append(name)
        elif tuple(array.shape) != shapes[key].shape:
            odd.append(f"{name} has shape {tuple(tensor.shape)}, the decoder expects {shapes[key].shape} (Flax layout)")
        else:
            flat[key] = array
    if odd:
        raise WeightsError(f"{where}: {'; '.join(odd[:5])}")
    missing = sorted("/".join(key) for key in shapes if key not in flat)
    if missing:
        raise WeightsError(f"{where}: {len(missing)} weight(s) missing, e.g. {', '.join(missing[:5])}")
    if unknown:
        raise WeightsError(f"{where}: {len(unknown)} weight(s) the decoder does not have, e.g. "
                           f"{', '.join(sorted(unknown)[:5])}")
    return convert.unflatten(flat)


# diffusers' Flax names of the attention projections -> PyTorch's
_ATTENTION_NAMES = {"query": ("to_q",), "key": ("to_k",), "value": ("to_v",), "proj_attn": ("to_out", "0")}


def to_torch(params: Mapping, config: VaeConfig) -> dict[str, np.ndarray]:
    """An ``AutoencoderKL`` state dict ({PyTorch name: array in its param's dtype}) from
    the params of diffusers' ``FlaxAutoencoderKL`` (encoder included), inverting
    diffusers' renaming rules (``from_torch``): ``name_0`` -> ``name.0``, attention's
    query/key/value/proj_attn -> to_q/to_k/to_v/to_out.0, kernels back to PyTorch's layouts
    (convolutions OIHW, linears [out, in]), norms' ``scale`` -> ``weight``. The quant
    convs the config says the autoencoder lacks are left out, as its PyTorch module has
    none."""
    import re

    state = {}
    for path, value in convert.flatten(params).items():
        if (path[0] == "quant_conv" and not config.use_quant_conv) or (
                path[0] == "post_quant_conv" and not config.use_post_quant_conv):
            continue
        array = np.asarray(value)
        if path[0] == "bn":  # the batch norm's statistics keep their PyTorch names, and its count
            state[".".join(path)] = array
            state["bn.num_batches_tracked"] = np.zeros((), np.int64)
            continue
        names = []
        for part in path[:-1]:
            names += _ATTENTION_NAMES.get(part, (re.sub(r"_(\d+)$", r".\1", part),))
        leaf = path[-1]
        if leaf == "kernel":
            array = array.transpose(3, 2, 0, 1) if array.ndim == 4 else array.T
        state[".".join(names + ["bias" if leaf == "bias" else "weight"])] = array
    return state


@dataclasses.dataclass(frozen=True)
class _Spec:  # the shape diffusers' renaming rules look up (they read ``.shape`` only)
    shape: tuple[int, ...]
