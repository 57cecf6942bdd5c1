"""The sampling function: prompts and per-image keys in, uint8 images out.

A pure function of (params, batch), traced once per run for its fixed shapes. It
draws every image's initial latents from that image's own key (``keys.fold_keys``),
runs classifier-free guidance as one UNet call on [negative; positive], loops over the
scheduler's steps with ``lax.fori_loop``, decodes with the VAE and rounds to uint8 the
way ``diffusers``' ``numpy_to_pil`` does.
"""
from __future__ import annotations

from pipeline import keys


def make_sample_fn(model, width: int, height: int, steps: int):
    """``sample(params, prompt_ids, negative_ids, guidance, seed_hi, seed_lo, image_index)``.

    Shapes (B = batch): ids int32 [B, L]; guidance float32 [B]; seed words and image
    indices uint32 [B]. Returns uint8 [B, height, width, 3].
    """
    import jax
    import jax.numpy as jnp

    latent_shape = model.latent_shape(width, height)
    denoise = make_denoise_fn(model, steps)

    def sample(params, prompt_ids, negative_ids, guidance, seed_hi, seed_lo, image_index):
        image_keys = keys.fold_keys(seed_hi, seed_lo, image_index)
        latents = jax.vmap(lambda k: keys.initial_latents(k, latent_shape))(image_keys)
        images = denoise(params, prompt_ids, negative_ids, guidance, latents)
        return jnp.round(images * 255).astype(jnp.uint8)

    return sample


def make_denoise_fn(model, steps: int):
    """``denoise(params, prompt_ids, negative_ids, guidance, latents)``: float32 images in
    [0, 1], [B, H, W, 3], from given initial latents (float32 [B, C, H/f, W/f])."""
    import jax
    import jax.numpy as jnp

    text_encoder, unet, vae, scheduler = model.text_encoder, model.unet, model.vae, model.scheduler

    def denoise(params, prompt_ids, negative_ids, guidance, latents):
        batch = prompt_ids.shape[0]
        ids = jnp.concatenate([negative_ids, prompt_ids])
        context = text_encoder(ids, params=params["text_encoder"])[0]
        scale = guidance.astype(jnp.float32).reshape(batch, 1, 1, 1)

        state = scheduler.set_timesteps(params["scheduler"], num_inference_steps=steps, shape=latents.shape)
        latents = latents * state.init_noise_sigma

        def step(i, carry):
            latents, state = carry
            # not cast to int: Euler's timesteps are fractional and it finds its step by value
            t = state.timesteps[i]
            model_input = scheduler.scale_model_input(state, jnp.concatenate([latents, latents]), t)
            noise = unet.apply({"params": params["unet"]}, model_input,
                               jnp.broadcast_to(t, (2 * batch,)), encoder_hidden_states=context).sample
            # guidance and the scheduler run in float32 whatever the network dtype
            uncond, cond = jnp.split(noise.astype(jnp.float32), 2)
            noise = uncond + scale * (cond - uncond)
            latents, state = scheduler.step(state, noise, t, latents).to_tuple()
            return latents, state

        latents, _ = jax.lax.fori_loop(0, steps, step, (latents, state))
        images = vae.apply({"params": params["vae"]}, latents / vae.config.scaling_factor, method=vae.decode).sample
        return jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)

    return denoise
