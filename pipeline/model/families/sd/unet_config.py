"""A UNet's ``unet/config.json`` read into what ``unet.UNet`` builds: SD 1.x/2.x's and SDXL's
``UNet2DConditionModel``, block by block, as diffusers' PyTorch class reads the same keys.

diffusers' naming quirk is kept: ``attention_head_dim`` is the number of heads when
``num_attention_heads`` is not given (SD 1.x's 8, SD 2.x's [5, 10, 20, 20], SDXL's
[5, 10, 20]), each head ``channels / heads`` wide. Per-block keys (heads, cross-attention
width, layers, transformer depth, only-cross-attention) are lists or one value for every
block; the up blocks read them reversed (the transformer depth from
``reverse_transformer_layers_per_block`` when given). ``from_dict`` refuses, by key and
value, every key that would change the UNet's output in diffusers and that ``unet.UNet``
does not do; keys diffusers ignores at inference (dropout, ``sample_size``, metadata) pass.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

CLASS_NAME = "UNet2DConditionModel"
DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D", None)
ADDITION_EMBEDS = (None, "text_time")  # SDXL's; the others (Kandinsky's) are refused
TIME_IDS = 6  # SDXL's micro-conditioning: original size, crop top-left, target size
# keys at these values change nothing this UNet does not do: any other value is refused
_DEFAULTS_REQUIRED = dict(
    class_embed_type=None, num_class_embeds=None, encoder_hid_dim=None, encoder_hid_dim_type=None,
    time_cond_proj_dim=None, dual_cross_attention=False, time_embedding_type="positional",
    resnet_time_scale_shift="default", resnet_skip_time_act=False, resnet_out_scale_factor=1.0,
    attention_type="default", class_embeddings_concat=False, cross_attention_norm=None, timestep_post_act=None,
    time_embedding_act_fn=None)
_WHY = dict(
    class_embed_type="class-conditions the time embedding", num_class_embeds="class-conditions the time embedding",
    encoder_hid_dim="projects the text states first", encoder_hid_dim_type="projects the text states first",
    time_cond_proj_dim="embeds the guidance scale (an LCM-distilled UNet's w embedding)",
    dual_cross_attention="runs two cross-attentions", time_embedding_type="is not the positional time embedding",
    resnet_time_scale_shift="scales and shifts by the time embedding", resnet_skip_time_act="skips the time's SiLU",
    resnet_out_scale_factor="rescales the ResNet outputs", attention_type="gates the attention (GLIGEN)",
    class_embeddings_concat="concatenates class embeddings", cross_attention_norm="normalises the text states",
    timestep_post_act="adds an activation to the time embedding",
    time_embedding_act_fn="adds an activation to the time embedding")


@dataclasses.dataclass(frozen=True)
class Block:
    """One down or up block: its kind, channels, and per ResNet layer the depth of the
    transformer after it (0: a block without cross-attention)."""
    cross: bool
    channels: int
    depths: tuple[int, ...]  # one per ResNet layer
    heads: int
    cross_attention_dim: int
    only_cross_attention: bool
    resample: bool  # a downsampler after it (down), an upsampler (up)


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """What a ``UNet2DConditionModel``'s output depends on, resolved per block."""
    in_channels: int
    out_channels: int
    sample_size: int
    block_out_channels: tuple[int, ...]
    down: tuple[Block, ...]
    up: tuple[Block, ...]
    mid: Block | None  # None: no mid block
    mid_cross: bool
    # the rest as ``from_dict`` reads them (diffusers' defaults for missing keys live there, once)
    norm_num_groups: int
    norm_eps: float
    flip_sin_to_cos: bool
    freq_shift: float
    center_input_sample: bool
    use_linear_projection: bool
    upcast_attention: bool
    time_embed_dim: int
    downsample_padding: int
    mid_block_scale_factor: float
    conv_in_kernel: int
    conv_out_kernel: int
    addition_embed_type: str | None  # SDXL's "text_time", with the two below; else None
    cross_attention_dim: int  # the text states' width the first cross-attention takes
    addition_time_embed_dim: int | None = None
    projection_class_embeddings_input_dim: int | None = None

    @property
    def pooled_dim(self) -> int | None:
        """The width of the pooled text embedding SDXL's added conditioning takes: the
        projection's input less its ``TIME_IDS`` embedded time ids."""
        if self.addition_embed_type != "text_time":
            return None
        return self.projection_class_embeddings_input_dim - TIME_IDS * self.addition_time_embed_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> UNetConfig:
        """The UNet of a ``unet/config.json`` (missing keys at diffusers' defaults);
        ValueError naming the key and value of anything this UNet does not do."""
        def refuse(key, why):
            raise ValueError(f"unet config: {key}={config.get(key)!r} {why}")

        name = config.get("_class_name", CLASS_NAME)
        if name not in (CLASS_NAME, f"Flax{CLASS_NAME}"):
            refuse("_class_name", f"is not {CLASS_NAME}")
        for key, default in _DEFAULTS_REQUIRED.items():
            if config.get(key, default) != default:
                refuse(key, f"{_WHY[key]}, which promptmill's UNet does not do")
        if config.get("act_fn", "silu") not in ("silu", "swish"):
            refuse("act_fn", "is not silu, the only activation promptmill's UNet has")
        down_types = _strings(config, "down_block_types",
                              ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",), DOWN_BLOCKS, refuse)
        up_types = _strings(config, "up_block_types", ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, UP_BLOCKS, refuse)
        n = len(down_types)
        channels = _ints(config, "block_out_channels", (320, 640, 1280, 1280), refuse)
        if len(channels) != n or len(up_types) != n:
            refuse("block_out_channels", f"must have one entry per down block and per up block ({n})")
        mid_type = config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
        if mid_type not in MID_BLOCKS:
            refuse("mid_block_type", f"is not one of {', '.join(map(str, MID_BLOCKS))}")
        groups = config.get("norm_num_groups", 32)
        if not _positive(groups) or any(c % groups for c in channels):
            refuse("norm_num_groups", f"must be a positive integer that divides every block's channels {channels}")
        heads = config.get("num_attention_heads") or config.get("attention_head_dim", 8)  # diffusers' quirk
        heads = _per_block(config, "num_attention_heads" if config.get("num_attention_heads") else
                           "attention_head_dim", heads, n, refuse)
        cross_dims = _per_block(config, "cross_attention_dim", config.get("cross_attention_dim", 1280), n, refuse)
        layers = _per_block(config, "layers_per_block", config.get("layers_per_block", 2), n, refuse)
        only_cross = config.get("only_cross_attention", False)
        mid_only_cross = config.get("mid_block_only_cross_attention")
        if isinstance(only_cross, bool):
            mid_only_cross = only_cross if mid_only_cross is None else mid_only_cross
            only_cross = (only_cross,) * n
        elif not (isinstance(only_cross, (list, tuple)) and len(only_cross) == n
                  and all(isinstance(v, bool) for v in only_cross)):
            refuse("only_cross_attention", f"must be true, false or {n} of them")
        depths = config.get("transformer_layers_per_block", 1)
        if isinstance(depths, int) and not isinstance(depths, bool):
            depths = (depths,) * n
        if not (isinstance(depths, (list, tuple)) and len(depths) == n):
            refuse("transformer_layers_per_block", f"must be a number or {n} of them")
        reverse = config.get("reverse_transformer_layers_per_block")
        if reverse is None:
            if any(isinstance(d, (list, tuple)) for d in depths):
                refuse("reverse_transformer_layers_per_block", "must be given with per-layer transformer depths")
            reverse = tuple(reversed(depths))
        elif not (isinstance(reverse, (list, tuple)) and len(reverse) == n):
            refuse("reverse_transformer_layers_per_block", f"must hold {n} entries")

        def depth_list(value, count, key):
            value = (value,) * count if isinstance(value, int) and not isinstance(value, bool) else value
            if not (isinstance(value, (list, tuple)) and len(value) == count and all(_positive(v) for v in value)):
                refuse(key, f"must give each of a block's {count} layers a positive depth")
            return tuple(value)

        down = tuple(Block(kind == "CrossAttnDownBlock2D", channels[i],
                           depth_list(depths[i], layers[i], "transformer_layers_per_block"), heads[i], cross_dims[i],
                           bool(only_cross[i]), i < n - 1) for i, kind in enumerate(down_types))
        up = tuple(Block(kind == "CrossAttnUpBlock2D", channels[n - 1 - i],
                         depth_list(reverse[i], layers[n - 1 - i] + 1, "reverse_transformer_layers_per_block"),
                         heads[n - 1 - i], cross_dims[n - 1 - i], bool(only_cross[n - 1 - i]), i < n - 1)
                   for i, kind in enumerate(up_types))
        mid = None
        if mid_type is not None:
            mid = Block(mid_type == "UNetMidBlock2DCrossAttn", channels[-1],
                        depth_list(depths[-1], 1, "transformer_layers_per_block"), heads[-1], cross_dims[-1],
                        bool(mid_only_cross), False)
        if any(block.cross and block.channels % block.heads for block in (*down, *up, *([mid] if mid else []))):
            refuse("attention_head_dim", f"does not divide the blocks' channels {channels} into whole heads")
        addition = config.get("addition_embed_type")
        if addition not in ADDITION_EMBEDS:
            refuse("addition_embed_type", "is not text_time (SDXL's), the only added conditioning promptmill's UNet has")
        time_dim = config.get("time_embedding_dim") or channels[0] * 4
        values = dict(
            in_channels=config.get("in_channels", 4), out_channels=config.get("out_channels", 4),
            sample_size=config.get("sample_size") or 64, block_out_channels=channels, down=down, up=up, mid=mid,
            mid_cross=mid_type == "UNetMidBlock2DCrossAttn", norm_num_groups=groups,
            norm_eps=float(config.get("norm_eps", 1e-5)), flip_sin_to_cos=bool(config.get("flip_sin_to_cos", True)),
            freq_shift=float(config.get("freq_shift", 0)),
            center_input_sample=bool(config.get("center_input_sample", False)),
            use_linear_projection=bool(config.get("use_linear_projection", False)),
            upcast_attention=bool(config.get("upcast_attention", False)), time_embed_dim=time_dim,
            downsample_padding=config.get("downsample_padding", 1),
            mid_block_scale_factor=float(config.get("mid_block_scale_factor", 1)),
            conv_in_kernel=config.get("conv_in_kernel", 3), conv_out_kernel=config.get("conv_out_kernel", 3),
            addition_embed_type=addition, cross_attention_dim=cross_dims[0])
        for key in ("in_channels", "out_channels", "time_embed_dim", "conv_in_kernel", "conv_out_kernel"):
            if not _positive(values[key]):
                refuse(key, "must be a positive integer")
        if values["conv_in_kernel"] % 2 == 0 or values["conv_out_kernel"] % 2 == 0:
            refuse("conv_in_kernel", "and conv_out_kernel must be odd (a same-size convolution)")
        if addition == "text_time":
            time_ids, projection = config.get("addition_time_embed_dim"), config.get(
                "projection_class_embeddings_input_dim")
            if not _positive(time_ids) or not _positive(projection) or projection <= TIME_IDS * time_ids:
                refuse("projection_class_embeddings_input_dim", "must be the pooled text's width plus 6 time ids x "
                       "addition_time_embed_dim (SDXL's added conditioning)")
            values.update(addition_time_embed_dim=time_ids, projection_class_embeddings_input_dim=projection)
        return cls(**values)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _strings(config, key, default, allowed, refuse) -> tuple[str, ...]:
    value = config.get(key, default)
    if not isinstance(value, (list, tuple)) or not value or any(v not in allowed for v in value):
        refuse(key, f"must list blocks of {', '.join(allowed)}, the blocks promptmill's UNet has")
    return tuple(value)


def _ints(config, key, default, refuse) -> tuple[int, ...]:
    value = config.get(key, default)
    if not isinstance(value, (list, tuple)) or not value or not all(_positive(v) for v in value):
        refuse(key, "must be a list of positive integers")
    return tuple(value)


def _per_block(config, key, value, n: int, refuse) -> tuple:
    """A per-block key: one positive integer for every block, or one each."""
    if _positive(value):
        return (value,) * n
    if isinstance(value, (list, tuple)) and len(value) == n and all(_positive(v) for v in value):
        return tuple(value)
    refuse(key, f"must be a positive integer or {n} of them (one per block)")
