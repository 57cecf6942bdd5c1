"""The sampling function: prompts and per-image keys in, uint8 images out.

A pure function of (params, batch), traced once per run for its fixed shapes, for
SD 1.x/2.x and SDXL alike. It draws every image's initial latents from that image's own
key (``keys.fold_keys``), runs classifier-free guidance as one UNet call on
[negative; positive] (or, in a guidance-free run, the UNet on the prompts alone), loops
over the sampler's steps with ``lax.fori_loop`` (diffusers' Flax scheduler, or
promptmill's own steps: ``pipeline.model.scheduler``), decodes with the VAE and rounds
to uint8 the way ``diffusers``' ``numpy_to_pil`` does.

With ``latents=True`` it also returns each image's final latents: float32
[C, H/f, W/f], the scheduler's output after the last step, i.e. what the VAE decodes
once divided by ``vae.config.scaling_factor`` (they are stored *before* that division).
"""
from __future__ import annotations

from pipeline.core import keys


def tokenize(model, texts):
    """Token ids, int32: [N, L] for SD, [N, 2, L] (one row per tokenizer) for SDXL.

    Both SDXL tokenizers pad to the first tokenizer's length, as diffusers does.
    """
    import numpy as np

    length = model.tokenizer.model_max_length
    tokenizers = [model.tokenizer] + ([model.tokenizer_2] if model.family == "sdxl" else [])
    ids = [t(list(texts), padding="max_length", max_length=length, truncation=True, return_tensors="np").input_ids
           for t in tokenizers]
    return (ids[0] if len(ids) == 1 else np.stack(ids, axis=1)).astype(np.int32)


def truncated(model, texts) -> list[bool]:
    """Whether each text has more tokens (with the start and end tokens) than the text
    encoder takes, so that ``tokenize`` cuts it short."""
    limit = model.tokenizer.model_max_length
    ids = model.tokenizer(list(texts), truncation=False, verbose=False).input_ids
    return [len(row) > limit for row in ids]


def make_sample_fn(model, width: int, height: int, steps: int, latents: bool = False,
                   guidance_rule: str = "diffusers", guided: bool = True, attention: str = "auto",
                   platform: str | None = None):
    """``sample(params, prompt_ids, negative_ids, guidance, seed_hi, seed_lo, image_index)``.

    Shapes (B = batch): ids int32 [B, L]; guidance float32 [B]; seed words and image
    indices uint32 [B]. Returns uint8 [B, height, width, 3]; with ``latents``, the pair
    (images, final latents float32 [B, C, height/f, width/f]), the latents taken after
    the last scheduler step and before the division by the VAE's scaling factor.
    Without ``latents`` the program is exactly the images-only one. ``guided``: see
    ``make_denoise_fn`` (a guidance-free program never reads ``negative_ids``).
    ``attention`` and ``platform``: see ``make_denoise_fn``.
    """
    import jax

    latent_shape = model.latent_shape(width, height)
    denoise = make_denoise_fn(model, steps, empty_negative_ids=tokenize(model, [""])[0], return_latents=latents,
                              guidance_rule=guidance_rule, guided=guided, attention=attention, platform=platform)

    def sample(params, prompt_ids, negative_ids, guidance, seed_hi, seed_lo, image_index):
        image_keys = keys.fold_keys(seed_hi, seed_lo, image_index)
        initial = jax.vmap(lambda k: keys.initial_latents(k, latent_shape))(image_keys)
        if not latents:
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
    """float32 images in [0, 1], [B, H, W, 3], from final latents as the sampler returns
    them (before the division by the VAE's scaling factor)."""
    import jax.numpy as jnp

    vae = model.vae
    images = vae.apply({"params": vae_params}, latents / vae.config.scaling_factor, method=vae.decode).sample
    return jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)


def make_encode_fn(model):
    """``encode(params, ids) -> (context, added_cond)`` for the model's family.

    SD 1.x/2.x: the text encoder's last hidden state, no added conditioning.
    SDXL: the penultimate hidden states of both encoders side by side, and the second
    encoder's projected pooled output as ``text_embeds``; ids are [B, 2, L].
    """
    import jax.numpy as jnp

    if model.family == "sd":
        def encode(params, ids):
            return model.text_encoder(ids, params=params["text_encoder"])[0], None
        return encode

    def encode(params, ids):
        first = model.text_encoder(ids[:, 0], params=params["text_encoder"], output_hidden_states=True)
        second = model.text_encoder_2(ids[:, 1], params=params["text_encoder_2"], output_hidden_states=True)
        context = jnp.concatenate([first.hidden_states[-2], second.hidden_states[-2]], axis=-1)
        return context, {"text_embeds": second.text_embeds}
    return encode


class _FlaxSteps:
    """The loop of a ``flax``-engine sampler: diffusers' Flax scheduler and its state."""

    def __init__(self, model, steps: int):
        self.scheduler, self.steps = model.scheduler, steps

    def start(self, params, latents):
        state = self.scheduler.set_timesteps(params["scheduler"], num_inference_steps=self.steps, shape=latents.shape)
        return latents * state.init_noise_sigma, state

    def timestep(self, state, i):
        # not cast to int: Euler's timesteps are fractional and it finds its step by value
        return state.timesteps[i]

    def scale(self, state, i, t, sample):
        return self.scheduler.scale_model_input(state, sample, t)

    def update(self, state, i, t, prediction, sample, noise):
        return self.scheduler.step(state, prediction, t, sample).to_tuple()


class _OwnSteps:
    """The loop of a ``steps``-engine sampler: ``pipeline.model.steps`` over a schedule
    computed once, on the host, when the program is traced (no state)."""

    def __init__(self, model, steps: int):
        from pipeline.model import steps as steps_lib

        self.lib = steps_lib
        self.schedule = steps_lib.make_schedule(model.sampler.config, model.sampler.choice, steps)

    def start(self, params, latents):
        return latents * self.schedule.init_noise_sigma, ()

    def timestep(self, state, i):
        import jax.numpy as jnp

        return jnp.asarray(self.schedule.timesteps)[i]

    def scale(self, state, i, t, sample):
        return self.lib.scale_input(self.schedule, i, sample)

    def update(self, state, i, t, prediction, sample, noise):
        return self.lib.step(self.schedule, i, prediction, sample, noise), state


def make_denoise_fn(model, steps: int, empty_negative_ids=None, return_latents: bool = False,
                    guidance_rule: str = "diffusers", guided: bool = True, attention: str = "auto",
                    platform: str | None = None):
    """``denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None)``:
    float32 images in [0, 1], [B, H, W, 3], from given initial latents (float32
    [B, C, H/f, W/f]). ``image_keys`` (B typed keys) are needed by the stochastic
    samplers only: step ``i`` adds ``keys.step_noise(image key, i, ...)``.

    With ``return_latents``: (images, final latents), the final latents float32
    [B, C, H/f, W/f] after the last scheduler step, before the division by
    ``vae.config.scaling_factor`` that precedes decoding (see ``decode_latents``).

    ``guided`` (chosen per run): True runs classifier-free guidance as one UNet call on
    [negative; positive] (batch 2B). Under ``guidance_rule="diffusers"`` (diffusers' rule)
    an image whose guidance is > 1 gets ``uncond + g * (cond - uncond)`` and one at
    guidance <= 1 the conditional prediction alone; each image's own guidance decides,
    never its neighbours'. ``"always"`` guides every image (runs planned before the rule).
    False is the guidance-free program: the UNet runs on the prompts alone (batch B), no
    negative prompt is encoded, and ``negative_ids`` and ``guidance`` are not read.

    ``attention``: how the UNet's and the VAE's attention run (``pipeline.model.attention``;
    ``auto`` picks per call from ``platform``, default JAX's, and the shapes);
    ``"diffusers"``: diffusers' own attention, untouched (runs planned before the seam).

    For SDXL, a row whose negative ids equal ``empty_negative_ids`` (the tokenised empty
    prompt) is conditioned on zeros instead, as SDXL was trained
    (``force_zeros_for_empty_prompt``).
    """
    import contextlib

    import jax
    import jax.numpy as jnp

    from pipeline.core.choices import LEGACY_ATTENTION
    from pipeline.model import attention as attention_lib

    def seam():
        """Entered while the program is traced: the seam acts on what is traced inside it."""
        if attention == LEGACY_ATTENTION:
            return contextlib.nullcontext()
        return attention_lib.use(attention, platform=platform)

    if guidance_rule not in ("diffusers", "always"):
        raise ValueError(f"guidance_rule must be diffusers or always, got {guidance_rule!r}")
    if guidance_rule == "always" and not guided:
        raise ValueError("the 'always' guidance rule guides every image; it has no guidance-free program")
    unet = model.unet
    loop = _FlaxSteps(model, steps) if model.sampler.engine == "flax" else _OwnSteps(model, steps)
    stochastic = model.sampler.stochastic
    encode = make_encode_fn(model)
    factor = model.vae_scale_factor

    def conditioning(params, prompt_ids, negative_ids, latents):
        """(context, added) for the UNet batch: [negative; positive] when guided."""
        batch = prompt_ids.shape[0]
        context, added = encode(params, prompt_ids)
        if guided:
            negative_context, negative_added = encode(params, negative_ids)
        if added is not None:
            height, width = latents.shape[2] * factor, latents.shape[3] * factor
            # SDXL's micro-conditioning: original size, crop top-left, target size
            time_ids = jnp.broadcast_to(jnp.array([height, width, 0, 0, height, width], context.dtype), (batch, 6))
            if not guided:
                return context, {"text_embeds": added["text_embeds"], "time_ids": time_ids}
            if empty_negative_ids is not None:
                empty = jnp.all(negative_ids == jnp.asarray(empty_negative_ids),
                                axis=tuple(range(1, negative_ids.ndim)))
                negative_context = jnp.where(empty[:, None, None], 0, negative_context)
                negative_added = {"text_embeds": jnp.where(empty[:, None], 0, negative_added["text_embeds"])}
            added = {"text_embeds": jnp.concatenate([negative_added["text_embeds"], added["text_embeds"]]),
                     "time_ids": jnp.concatenate([time_ids, time_ids])}
        if not guided:
            return context, added
        return jnp.concatenate([negative_context, context]), added

    def denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None):
        with seam():
            return traced(params, prompt_ids, negative_ids, guidance, latents, image_keys)

    def traced(params, prompt_ids, negative_ids, guidance, latents, image_keys):
        batch = prompt_ids.shape[0]
        if stochastic and image_keys is None:
            raise ValueError(f"the {model.sampler.choice} sampler draws noise at each step: it needs the image keys")
        context, added = conditioning(params, prompt_ids, negative_ids, latents)
        scale = guidance.astype(jnp.float32).reshape(batch, 1, 1, 1)
        latents, state = loop.start(params, latents)
        noise_shape = latents.shape[1:]

        def step(i, carry):
            latents, state = carry
            t = loop.timestep(state, i)
            model_input = loop.scale(state, i, t, jnp.concatenate([latents, latents]) if guided else latents)
            prediction = unet.apply({"params": params["unet"]}, model_input,
                                    jnp.broadcast_to(t, (model_input.shape[0],)),
                                    encoder_hidden_states=context, added_cond_kwargs=added).sample
            # guidance and the scheduler run in float32 whatever the network dtype
            prediction = prediction.astype(jnp.float32)
            if guided:
                uncond, cond = jnp.split(prediction, 2)
                guided_prediction = uncond + scale * (cond - uncond)
                prediction = guided_prediction if guidance_rule == "always" else jnp.where(scale > 1,
                                                                                           guided_prediction, cond)
            noise = jax.vmap(lambda k: keys.step_noise(k, i, noise_shape))(image_keys) if stochastic else None
            return loop.update(state, i, t, prediction, latents, noise)

        latents, _ = jax.lax.fori_loop(0, steps, step, (latents, state))
        images = decode_latents(model, params["vae"], latents)
        return (images, latents.astype(jnp.float32)) if return_latents else images

    return denoise
