"""The sampling function: prompts and per-image keys in, uint8 images out.

A pure function of (params, batch), traced once per run for its fixed shapes, for every
model family. It draws every image's initial latents from that image's own key
(``keys.fold_keys``, ``keys.initial_latents``: normal(key, (C, H/f, W/f)), the draw
diffusers makes), runs the family's denoising function (``Family.make_denoise``: the
text conditioning, the denoiser's loop over the sampler's steps, the VAE decode) with
the attention seam entered while it is traced, and rounds to uint8 the way diffusers'
``numpy_to_pil`` does.

With ``latents=True`` it also returns each image's final latents: float32
[C, H/f, W/f], as the family's decode takes them (``Family.latents_note``).
"""
from __future__ import annotations

from pipeline.core import keys
from pipeline.generate.spec import ProgramSpec


def _seam(attention: str, platform: str | None, mesh=None):
    """The attention seam's context factory, entered while the program is traced."""
    from pipeline.model.layers import attention as attention_lib

    return lambda: attention_lib.use(attention, platform=platform, mesh=mesh)


def make_sample_fn(model, spec: ProgramSpec, platform: str | None = None, mesh=None):
    """``sample(params, prompt_ids, negative_ids, guidance, seed_hi, seed_lo, image_index)``:
    the program ``spec`` describes (its size, steps, guidance, latents, attention and decode
    batch; the batch is whatever the arrays hold).

    Shapes (B = batch): ids int32 [B, ...] (``tokenize``); guidance float32 [B]; seed words
    and image indices uint32 [B]. Returns uint8 [B, height, width, 3]; with ``spec.latents``,
    the pair (images, final latents float32 [B, C, height/f, width/f]). Without latents the
    program is exactly the images-only one. ``platform``: see ``make_denoise_fn``;
    ``mesh``: the mesh an FSDP program is partitioned over (None: the program of one device).
    """
    import jax

    latent_shape = model.latent_shape(spec.width, spec.height)
    denoise = make_denoise_fn(model, spec.steps, empty_negative_ids=model.family.tokenize(model, [""])[0],
                              return_latents=spec.latents, guidance_rule=spec.guidance_rule, guided=spec.guided,
                              attention=spec.attention, platform=platform, mesh=mesh, decode_batch=spec.decode_batch)

    def sample(params, *batch):  # the arrays of ``generator.Batch``, in its order
        prompt_ids, negative_ids, guidance, seed_hi, seed_lo, image_index = batch
        image_keys = keys.fold_keys(seed_hi, seed_lo, image_index)
        initial = jax.vmap(lambda k: keys.initial_latents(k, latent_shape))(image_keys)
        if not spec.latents:
            images = denoise(params, prompt_ids, negative_ids, guidance, initial, image_keys)
            return to_uint8(images)
        images, final = denoise(params, prompt_ids, negative_ids, guidance, initial, image_keys)
        return to_uint8(images), final

    return sample


def to_uint8(images):
    """float images in [0, 1] -> uint8, rounded as ``diffusers``' ``numpy_to_pil`` does."""
    import jax.numpy as jnp

    return jnp.round(images * 255).astype(jnp.uint8)


def decode_latents(model, vae_params, latents):
    """float32 images in [0, 1], [B, H, W, 3], from final latents as the sampler returns them."""
    return model.family.decode_latents(model, vae_params, latents)


def make_denoise_fn(model, steps: int, empty_negative_ids=None, *, return_latents: bool = False,
                    guidance_rule: str = "diffusers", guided: bool = True, attention: str = "auto",
                    platform: str | None = None, mesh=None, decode_batch: int | None = None):
    """``denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None)``:
    float32 images in [0, 1], [B, H, W, 3], from given initial latents (float32
    [B, C, H/f, W/f]); the family's (``Family.make_denoise``: see it for ``guided``,
    ``guidance_rule``, ``empty_negative_ids`` and ``return_latents``).

    ``attention``: how the networks' attention runs (``pipeline.model.layers.attention``; ``auto``
    picks per call from ``platform``, default JAX's, and the shapes).

    ``decode_batch``: the VAE decodes that many images at a time, per device of ``mesh``
    when given (``decoding.decode_in_micro_batches``); None: the whole batch at once.
    """
    from pipeline.model.sampling import decoding

    return model.family.make_denoise(model, steps, empty_negative_ids=empty_negative_ids,
                                     return_latents=return_latents, guidance_rule=guidance_rule, guided=guided,
                                     seam=_seam(attention, platform, mesh),
                                     decode=decoding.micro_batches(decode_batch, mesh))
