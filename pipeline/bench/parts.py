"""The parts of a sampler step as programs lowered from shapes alone (no weights needed):
the text encoders, one UNet call and one VAE decode, at the step's per-device shapes.

``pipeline.bench.flops`` costs them and ``pipeline.bench.memory`` measures their memory.
``seam`` is a context manager factory entered while a part is traced (the attention
seam of ``pipeline.model.attention``); by default nothing is entered.
"""
from __future__ import annotations

import contextlib

from pipeline.generate.fit import struct


def text_encoders(model, rows: int) -> list:
    """One lowered program per text encoder (SDXL has two), on ``rows`` prompt ids."""
    import jax
    import jax.numpy as jnp

    ids = jax.ShapeDtypeStruct((rows, model.tokenizer.model_max_length), jnp.int32)
    return [jax.jit(lambda p, i, e=getattr(model, name): e(i, params=p)[0]).lower(struct(model.params[name]), ids)
            for name in sorted(n for n in model.params if n.startswith("text_encoder"))]


def unet_call(model, width: int, height: int, rows: int, seam=contextlib.nullcontext):
    """One UNet call on ``rows`` latents (2B with guidance, B without), lowered."""
    import jax
    import jax.numpy as jnp

    unet, config = model.unet, model.unet.config
    channels, h, w = model.latent_shape(width, height)
    added = None
    if getattr(config, "addition_embed_type", None) == "text_time":  # SDXL: pooled text and 6 size/crop ids
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        added = {"text_embeds": jax.ShapeDtypeStruct((rows, pooled), model.dtype),
                 "time_ids": jax.ShapeDtypeStruct((rows, 6), model.dtype)}

    def call(p, x, t, context, added):
        with seam():
            return unet.apply({"params": p}, x, t, encoder_hidden_states=context, added_cond_kwargs=added).sample

    length = model.tokenizer.model_max_length
    return jax.jit(call).lower(
        struct(model.params["unet"]), jax.ShapeDtypeStruct((rows, channels, h, w), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
        jax.ShapeDtypeStruct((rows, length, config.cross_attention_dim), model.dtype), added)


def vae_decode(model, width: int, height: int, batch: int, seam=contextlib.nullcontext):
    """One VAE decode of ``batch`` latents, lowered."""
    import jax
    import jax.numpy as jnp

    vae = model.vae

    def decode(p, z):
        with seam():
            return vae.apply({"params": p}, z, method=vae.decode).sample

    return jax.jit(decode).lower(struct(model.params["vae"]),
                                 jax.ShapeDtypeStruct((batch, *model.latent_shape(width, height)), jnp.float32))
