"""The parts of a sampler step as programs lowered from shapes alone (no weights needed):
the text encoders, one UNet call and one VAE decode, at the step's per-device shapes.

``flops`` costs a lowered part (XLA's cost analysis); ``pipeline.bench`` measures their
memory and speed, and the TPU check (``pipeline.generate.tpu_check``) compiles them for a
TPU chip to learn how the program's memory grows with the batch. ``seam`` is a context
manager factory entered while a part is traced (the attention seam of
``pipeline.model.attention``); by default nothing is entered. ``sharding``: where the
part's inputs live (e.g. one chip of a TPU topology, ``jax.sharding.SingleDeviceSharding``),
default JAX's default device.
"""
from __future__ import annotations

import contextlib

from pipeline.generate.fit import struct


def _on(sharding):
    """A ``jax.ShapeDtypeStruct`` maker for inputs placed by ``sharding`` (None: unplaced)."""
    import jax

    def make(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return make


def _params(tree, sharding):
    import jax

    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), struct(tree))


def text_encoders(model, rows: int, sharding=None) -> list:
    """One lowered program per text encoder (SDXL has two), on ``rows`` prompt ids."""
    import jax
    import jax.numpy as jnp

    ids = _on(sharding)((rows, model.tokenizer.model_max_length), jnp.int32)
    return [jax.jit(lambda p, i, e=getattr(model, name): e(i, params=p)[0]).lower(_params(model.params[name], sharding),
                                                                                   ids)
            for name in sorted(n for n in model.params if n.startswith("text_encoder"))]


def unet_call(model, width: int, height: int, rows: int, seam=contextlib.nullcontext, sharding=None):
    """One UNet call on ``rows`` latents (2B with guidance, B without), lowered."""
    import jax
    import jax.numpy as jnp

    make = _on(sharding)
    unet, config = model.unet, model.unet.config
    channels, h, w = model.latent_shape(width, height)
    added = None
    if getattr(config, "addition_embed_type", None) == "text_time":  # SDXL: pooled text and 6 size/crop ids
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        added = {"text_embeds": make((rows, pooled), model.dtype), "time_ids": make((rows, 6), model.dtype)}

    def call(p, x, t, context, added):
        with seam():
            return unet.apply({"params": p}, x, t, encoder_hidden_states=context, added_cond_kwargs=added).sample

    length = model.tokenizer.model_max_length
    return jax.jit(call).lower(_params(model.params["unet"], sharding), make((rows, channels, h, w), jnp.float32),
                               make((rows,), jnp.int32), make((rows, length, config.cross_attention_dim), model.dtype),
                               added)


def vae_decode(model, width: int, height: int, batch: int, seam=contextlib.nullcontext, sharding=None):
    """One VAE decode of ``batch`` latents, lowered."""
    import jax
    import jax.numpy as jnp

    vae = model.vae

    def decode(p, z):
        with seam():
            return vae.apply({"params": p}, z, method=vae.decode).sample

    return jax.jit(decode).lower(_params(model.params["vae"], sharding),
                                 _on(sharding)((batch, *model.latent_shape(width, height)), jnp.float32))


def flops(lowered) -> float:
    """XLA's flop count of a lowered program.

    The count of the lowered (unoptimised) module is within 0.01% of the compiled one
    for the UNet of SD 1.5 and costs no compilation (0.3 s instead of 6 s on a CPU).
    Backends that cannot cost a lowered module get it compiled first.
    """
    cost = lowered.cost_analysis()
    if not cost or "flops" not in cost:
        cost = lowered.compile().cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0]
    return float(cost["flops"])


def part_flops(model, width: int, height: int, per_device_batch: int, guided: bool = True) -> dict:
    """Flops of each part of one sampler step, on one device, for B = ``per_device_batch``
    (the text encoders and the UNet at 2B when ``guided``, else at B). The parts are
    costed with diffusers' own attention: every implementation computes the same exact
    attention, so the work per image is the same (see ``pipeline.bench.flops``)."""
    rows = per_device_batch * (2 if guided else 1)  # through the text encoders and the UNet
    return {"text_encoder": sum(flops(lowered) for lowered in text_encoders(model, rows)),
            "unet_call": flops(unet_call(model, width, height, rows)),
            "vae_decode": flops(vae_decode(model, width, height, per_device_batch))}


def image_flops(model, width: int, height: int, steps: int, per_device_batch: int = 1, guided: bool = True) -> float:
    """Flops of one image: (text encoders + ``steps`` UNet calls + VAE decode) / batch."""
    counted = part_flops(model, width, height, per_device_batch, guided)
    return (counted["text_encoder"] + steps * counted["unet_call"] + counted["vae_decode"]) / per_device_batch
