"""The networks of an SD 1.x/2.x or SDXL checkpoint, ours, from its configs, and their weights.

- ``read_nets``: the CLIP text encoder(s) (``pipeline.model.layers.text.clip``), the UNet
  (``unet``) and the VAE decoder (``pipeline.model.layers.vae``) from the checkpoint's
  configs, each refused by key where it asks for what the network does not do. SD 1.x/2.x
  read their text encoder's last hidden state; SDXL the penultimate state of both encoders
  (its first one's last layer and final norm are neither loaded nor run) and the second's
  projected pooled output.
- ``read_params``: each network's weights from PyTorch safetensors (single or sharded) or
  the libraries' Flax msgpack, by the networks' naming rules, each array in its stored
  dtype, converted once per machine (``weights.converted_components``); ``--unet``'s file
  in place of the UNet's own.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from pipeline.model.loading import weights
from pipeline.model.loading.checkpoint import ModelError, read_json_file

LIBRARIES = {"text_encoder": "transformers", "text_encoder_2": "transformers", "unet": "diffusers",
             "vae": "diffusers"}


@dataclasses.dataclass(frozen=True)
class TextEncoder:
    """A CLIP text encoder as a family reads it: its config and what it runs (``clip.ClipText``'s
    ``layers``, ``final``, ``projection``)."""
    config: Any  # clip.ClipTextConfig
    layers: int
    final: bool
    projection: bool

    def module(self, dtype):
        from pipeline.model.layers.text import clip

        return clip.ClipText(self.config, dtype, layers=self.layers, final=self.final, projection=self.projection)

    @property
    def variant(self) -> str:
        """What of the encoder is read: part of its converted weights' name."""
        return f"clip layers={self.layers} final={self.final} projection={self.projection}"

    def shapes(self) -> dict:
        from pipeline.model.layers.text import clip

        return clip.param_shapes(self.config, self.layers, self.final, self.projection)

    def whole_shapes(self) -> dict:
        """Every layer's shapes, the final norm's and the projection's: what a LoRA may name."""
        from pipeline.model.layers.text import clip

        return clip.param_shapes(self.config, None, True, self.projection)

    def from_torch(self, state, where):
        from pipeline.model.layers.text import clip

        return clip.from_torch(state, self.config, where, self.layers, self.final, self.projection)

    def from_flax(self, flat, where):
        from pipeline.model.layers.text import clip

        return clip.from_flax(flat, self.config, where, self.layers, self.final, self.projection)


@dataclasses.dataclass(frozen=True)
class SdNets:
    """An SD or SDXL checkpoint's networks (``Model.nets``), in one dtype: the text
    encoders (the second SDXL's), the UNet, the VAE decoder; the tokenizers once the family
    loads them."""
    text_encoders: tuple[TextEncoder, ...]
    unet: Any  # unet.UNet
    vae: Any  # vae.VaeDecoder
    tokenizer: Any = None
    tokenizer_2: Any = None

    @property
    def text_components(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2")[:len(self.text_encoders)]

    def encoder(self, component: str) -> TextEncoder:
        return self.text_encoders[self.text_components.index(component)]

    def flat_shapes(self) -> dict:
        """{component: {flat param path: shape}} of every network, from the configs alone."""
        from pipeline.model.families.sd import unet as unet_net
        from pipeline.model.layers import vae as vae_net

        shapes = {name: encoder.shapes() for name, encoder in zip(self.text_components, self.text_encoders)}
        return {**shapes, "unet": unet_net.param_shapes(self.unet.config),
                "vae": vae_net.NETWORK.param_shapes(self.vae.config)}


def _config(directory: str, component: str) -> dict:
    return read_json_file(os.path.join(directory, component, "config.json"))


def read_nets(directory: str, sdxl: bool, dtype=None) -> SdNets:
    """The networks of the SD (``sdxl`` False) or SDXL checkpoint in ``directory``, computing in
    ``dtype`` (default float32), from its configs alone. ModelError naming the component, key
    and value of any config they would not honour."""
    import jax.numpy as jnp

    from pipeline.model.families.sd import unet as unet_net, unet_config
    from pipeline.model.layers import vae as vae_net
    from pipeline.model.layers.text import clip

    dtype = jnp.float32 if dtype is None else dtype
    try:
        first = clip.ClipTextConfig.from_dict(_config(directory, "text_encoder"))
        if sdxl:
            second = clip.ClipTextConfig.from_dict(_config(directory, "text_encoder_2"))
            encoders = (TextEncoder(first, clip.penultimate(first), False, False),
                        TextEncoder(second, second.num_hidden_layers, True, True))
        else:
            encoders = (TextEncoder(first, first.num_hidden_layers, True, False),)
        unet_cfg = unet_config.UNetConfig.from_dict(_config(directory, "unet"))
        vae_raw = _config(directory, "vae")
        vae_cfg = vae_net.VaeConfig.from_dict(vae_raw, shifted=False)
    except ValueError as e:
        raise ModelError(f"{directory}: {e}") from None
    if sdxl and any(vae_raw.get(key) is not None for key in ("latents_mean", "latents_std")):
        raise ModelError(f"{directory}: vae/config.json sets latents_mean/latents_std, which SDXL's pipeline "
                         f"decodes with and promptmill's SDXL decode does not")
    context = sum(encoder.config.hidden_size for encoder in encoders)
    if any(block.cross and block.cross_attention_dim != context for block in (*unet_cfg.down, *unet_cfg.up)):
        raise ModelError(f"{directory}: unet/config.json's cross_attention_dim ({unet_cfg.cross_attention_dim}) is "
                         f"not the text encoders' width ({context})")
    if sdxl and unet_cfg.pooled_dim != encoders[1].config.projection_dim:
        raise ModelError(f"{directory}: the UNet's added conditioning takes {unet_cfg.pooled_dim}-wide pooled text "
                         f"(projection_class_embeddings_input_dim), text_encoder_2 projects to "
                         f"{encoders[1].config.projection_dim}")
    if not sdxl and unet_cfg.addition_embed_type is not None:
        raise ModelError(f"{directory}: unet/config.json has SDXL's added conditioning (addition_embed_type "
                         f"{unet_cfg.addition_embed_type!r}); the checkpoint's pipeline is not SDXL's")
    return SdNets(encoders, unet_net.UNet(unet_cfg, dtype), vae_net.VaeDecoder(vae_cfg, dtype))


def read_params(directory: str, nets: SdNets, unet_file: str | None = None) -> dict:
    """{component: params} of the networks' weights (see the module's docstring); with
    ``unet_file`` (a UNet-only safetensors file), its weights for the UNet's. WeightsError
    (ModelError for a Flax-only file where none is read) naming any missing, misshapen or
    unknown weight."""
    from pipeline.model.families.sd import unet as unet_net
    from pipeline.model.layers import vae as vae_net

    unet_cfg, vae_cfg = nets.unet.config, nets.vae.config
    rules = {"unet": lambda state, where: unet_net.from_torch(state, unet_cfg, where),
             "vae": lambda state, where: vae_net.NETWORK.from_torch(state, vae_cfg, where)}
    flax_rules = {"unet": lambda flat, where: unet_net.from_flax(flat, unet_cfg, where),
                  "vae": lambda flat, where: vae_net.from_flax(flat, vae_cfg, where)}
    variants = {}
    for name, encoder in zip(nets.text_components, nets.text_encoders):
        rules[name], flax_rules[name], variants[name] = encoder.from_torch, encoder.from_flax, encoder.variant
    if unet_file is not None:
        rules.pop("unet")
    params = weights.converted_components(directory, rules, LIBRARIES, "SD", flax_rules, variants)
    if unet_file is not None:
        params["unet"] = weights.converted(unet_file, os.path.join(directory, "unet"), lambda: unet_net.from_torch(
            weights.read_mapped(unet_file), unet_cfg, f"--unet {unet_file}"))
    return params
