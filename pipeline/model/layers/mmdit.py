"""What FLUX.1's and FLUX.2's transformers share (diffusers' ``FluxTransformer2DModel`` and
``Flux2Transformer2DModel``): double-stream blocks, then single-stream blocks, over packed
latent tokens and text states, conditioned on a timestep and, with ``guidance_embeds``, an
embedded guidance scale. Here once: the config keys both take and how a ``config.json`` is
read (``MMDiTConfig``), and the check of a call's guidance against the config
(``check_guidance``). Each family's transformer module builds its own blocks."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipeline.model.loading.config_values import ConfigValues


@dataclasses.dataclass(frozen=True)
class MMDiTConfig:
    """The keys of both transformers' configs, at diffusers' names. A family's config adds its
    own fields, names its diffusers class (``diffusers_class``), that class's defaults (every
    key it takes: ``defaults``) and the family (``title``), and reads its own keys (``own``)."""
    in_channels: int
    out_channels: int
    num_layers: int
    num_single_layers: int
    attention_head_dim: int
    num_attention_heads: int
    joint_attention_dim: int
    axes_dims_rope: tuple[int, ...]
    guidance_embeds: bool

    diffusers_class, title, defaults = "", "", {}  # a family's config sets them (class attributes, no fields)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]):
        """The config of a diffusers ``transformer/config.json`` (missing keys at the class's
        ``defaults``). ValueError naming the key and value for anything the module does not
        do; keys diffusers' class does not take are ignored, as ``from_config`` ignores them."""
        values = ConfigValues("transformer config", config, cls.defaults)
        values.class_name(cls.diffusers_class)
        return cls(**cls.shared(values), **cls.own(values))

    @classmethod
    def own(cls, values: ConfigValues) -> dict:
        """The family's own keys of ``values``, checked, as keyword arguments of the config."""
        return {}

    @classmethod
    def shared(cls, values: ConfigValues) -> dict:
        """The shared keys of ``values``, checked (ValueError naming the key and value), as
        keyword arguments of the config: ``patch_size`` 1 (the family packs 2x2 latents outside
        the transformer), ``out_channels`` defaulting to ``in_channels``."""
        if values["patch_size"] != 1:
            values.refuse("patch_size",
                          f"is not 1 ({cls.title}'s; packing 2x2 latents is done outside the transformer)")
        values.ints(("in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim"))
        values.ints(("num_layers", "num_single_layers"), least=0)
        values.optional_int("out_channels")
        values.boolean("guidance_embeds")
        keys = ("in_channels", "num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
                "joint_attention_dim", "guidance_embeds")
        return dict({key: values[key] for key in keys}, out_channels=values["out_channels"] or values["in_channels"],
                    axes_dims_rope=values.rope_axes("axes_dims_rope", "attention_head_dim"))


def check_guidance(config: MMDiTConfig, guidance) -> None:
    """ValueError unless a call gives a guidance scale exactly when the transformer embeds one
    (``guidance_embeds``): diffusers' FLUX.1 fails on either mismatch; its FLUX.2 ignores a
    guidance the model does not embed and, given none, leaves the guidance term out. Both
    are mistakes of the caller that would go unnoticed, so they are errors here."""
    if config.guidance_embeds and guidance is None:
        raise ValueError("this transformer embeds guidance (guidance_embeds): it needs a guidance scale per image")
    if not config.guidance_embeds and guidance is not None:
        raise ValueError("this transformer has no guidance embedding (guidance_embeds is false): it takes no guidance")
