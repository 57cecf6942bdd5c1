"""Device memory of compiled programs, from XLA's own buffer assignment.

``compiled.memory_analysis()`` reports what XLA assigned to a program before it runs:
its arguments (weights and inputs), outputs, the bytes outputs share with arguments
(aliases), and temporaries (every intermediate buffer, at the most that are alive at
once). Temporaries are what attention's [queries x keys] matrices inflate, and what
decides whether a resolution or a batch fits on a device next to its weights.

``part_memory`` measures the two parts where attention lives, one UNet call and one VAE
decode, each as its own program at the sampler's per-device shapes (the UNet at 2B
when guided), lowered from shapes alone: no weights are needed, so the largest sizes
can be measured on any machine.
"""
from __future__ import annotations

import numpy as np

GIB = 2 ** 30


def program_memory(compiled) -> dict:
    """Bytes of a compiled program, from XLA's ``memory_analysis()``: ``temp``,
    ``argument``, ``output``, ``alias`` (output bytes that reuse argument buffers),
    ``generated_code`` and ``total`` (argument + output - alias + temp: what the program
    needs on the device while it runs). Backends that report nothing give {}."""
    stats = compiled.memory_analysis()
    if isinstance(stats, (list, tuple)):  # one entry per program on some backends
        stats = stats[0] if stats else None
    if stats is None:
        return {}
    memory = {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in
              ("temp", "argument", "output", "alias", "generated_code")}
    memory["total"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    return memory


def in_gib(memory: dict, digits: int = 3) -> dict:
    """The same figures in GiB, rounded, for reports."""
    return {name: round(value / GIB, digits) for name, value in memory.items()}


def _struct(tree):
    """Shapes and dtypes only: lowering needs no real weights."""
    import jax

    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def part_memory(model, width: int, height: int, per_device_batch: int, guided: bool = True,
                attention: str | None = "auto", platform: str | None = None, **seam) -> dict:
    """``program_memory`` of one UNet call (at 2B when ``guided``, else B) and of one VAE
    decode (at B), for B = ``per_device_batch``: {"unet_call": {...}, "vae_decode": {...}}.

    ``attention``: the seam's implementation (``pipeline.model.attention.use``), or None
    for diffusers' own attention; ``platform`` and ``seam`` (``budget_bytes``,
    ``block_tokens``) are passed to ``use``. ``model`` needs ``unet``, ``vae``, ``params``
    (arrays or ShapeDtypeStructs), ``dtype``, ``latent_shape`` and ``tokenizer``, as
    ``load.Model`` has.
    """
    import contextlib

    import jax
    import jax.numpy as jnp

    from pipeline.model import attention as attention_lib

    def seam_block():
        if attention is None:
            return contextlib.nullcontext()
        return attention_lib.use(attention, platform=platform, **seam)

    b = per_device_batch * (2 if guided else 1)
    channels, h, w = model.latent_shape(width, height)
    unet, config = model.unet, model.unet.config
    added = None
    if getattr(config, "addition_embed_type", None) == "text_time":  # SDXL: pooled text and 6 size/crop ids
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        added = {"text_embeds": jax.ShapeDtypeStruct((b, pooled), model.dtype),
                 "time_ids": jax.ShapeDtypeStruct((b, 6), model.dtype)}
    length = model.tokenizer.model_max_length

    def unet_call(p, x, t, context, added):
        with seam_block():
            return unet.apply({"params": p}, x, t, encoder_hidden_states=context, added_cond_kwargs=added).sample

    unet_memory = program_memory(jax.jit(unet_call).lower(
        _struct(model.params["unet"]), jax.ShapeDtypeStruct((b, channels, h, w), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, length, config.cross_attention_dim), model.dtype), added).compile())

    vae = model.vae

    def vae_decode(p, z):
        with seam_block():
            return vae.apply({"params": p}, z, method=vae.decode).sample

    vae_memory = program_memory(jax.jit(vae_decode).lower(
        _struct(model.params["vae"]), jax.ShapeDtypeStruct((per_device_batch, channels, h, w), jnp.float32)).compile())
    return {"unet_call": unet_memory, "vae_decode": vae_memory}
