"""SD 1.x/2.x and SDXL, in promptmill's own Flax networks: the UNet (``unet``), CLIP
(``pipeline.model.layers.text.clip``) and the VAE decoder (``pipeline.model.layers.vae``),
read by ``nets``.

SD runs one CLIP text encoder (its last hidden state); SDXL runs two side by side (their
penultimate hidden states, the second's projected pooled output) and conditions the
UNet on size ids. Classifier-free guidance runs the UNet on [negative; positive] (twice
the rows), or not at all in a guidance-free run; the loop is promptmill's own steps
(``pipeline.model.sampling.samplers``, ``schedules``, ``stepping``), the schedule made on the host; the VAE
decodes ``latents / scaling_factor``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

from pipeline.core import keys
from pipeline.model.loading import fetch, lora
from pipeline.model.families.base import Described, Family, Model
from pipeline.model.families.sd import nets as sd_nets, presets
from pipeline.model.sampling import decoding, guidance as guidance_rules
from pipeline.model.sampling.samplers import resolve_sampler, step_range
from pipeline.model.loading.checkpoint import ModelError, read_json_file

COMPONENTS = ("tokenizer", "text_encoder", "unet", "vae", "scheduler")
SDXL_COMPONENTS = ("tokenizer_2", "text_encoder_2")  # SDXL's second text encoder
DEFAULT_GUIDANCE = 7.5  # diffusers' StableDiffusionPipeline and StableDiffusionXLPipeline
SIZE_MULTIPLE = 8  # the VAE's scale factor


def check_unet_file(directory: str, unet_file: str) -> None:
    """ModelError unless ``unet_file`` is a safetensors file of a UNet shaped like the
    checkpoint's (its first and last convolutions, read from the header alone; every
    weight's shape is checked when a host loads it)."""
    from safetensors import safe_open

    config = read_json_file(os.path.join(directory, "unet", "config.json"))
    try:
        with safe_open(unet_file, "np") as tensors:
            names = set(tensors.keys())
            shapes = {name: tuple(tensors.get_slice(name).get_shape()) for name in ("conv_in.weight", "conv_out.weight")
                      if name in names}
    except Exception as e:  # not safetensors at all: name the file
        raise ModelError(f"--unet {unet_file}: not a readable safetensors file ({e})") from None
    first = config.get("block_out_channels", [320])[0]
    expected = {"conv_in.weight": (first, config.get("in_channels", 4), 3, 3),
                "conv_out.weight": (config.get("out_channels", 4), first, 3, 3)}
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            found = shapes.get(name, "missing")
            raise ModelError(f"--unet {unet_file}: {name} is {found}, the checkpoint's UNet needs {shape} (a UNet "
                             f"for another architecture, or not a diffusers-format UNet)")


class StableDiffusion(Family):
    """SD 1.x/2.x (``sdxl=False``) or SDXL."""
    presets = presets  # both families' built-in models (``builtins`` keeps each its own)

    def __init__(self, sdxl: bool):
        self.sdxl = sdxl
        self.name, self.title = ("sdxl", "SDXL") if sdxl else ("sd", "SD 1.x/2.x")
        self.notebook_baseline = not sdxl
        self.size_rule = str(SIZE_MULTIPLE)
        self.steps_help = str(Described.default_steps)
        self.guidance_help = (f"classifier-free guidance, above 1 (default {DEFAULT_GUIDANCE:g}): twice the "
                              f"denoiser's rows")
        self.pipeline_classes = ("StableDiffusionXLPipeline",) if sdxl else (
            "StableDiffusionPipeline", "LatentConsistencyModelPipeline")

    def with_sampler(self, model: Model, directory: str, scheduler: str | None,
                     timestep_spacing: str | None) -> Model:
        return dataclasses.replace(model, sampler=resolve_sampler(directory, scheduler, timestep_spacing))

    def builtins(self) -> dict:
        return {name: preset for name, preset in presets.PRESETS.items() if preset["family"] == self.name}

    def components(self, index: dict) -> tuple[str, ...]:
        return COMPONENTS + (SDXL_COMPONENTS if self.sdxl else ())

    def weight_libraries(self, index: dict) -> dict[str, str]:
        own = {"text_encoder": "transformers", "unet": "diffusers", "vae": "diffusers"}
        return {**own, "text_encoder_2": "transformers"} if self.sdxl else own

    def unet_file(self, directory: str, unet: str) -> str:
        unet_file = fetch.resolve_unet(unet)
        check_unet_file(directory, unet_file)
        return unet_file

    def read_nets(self, directory: str, dtype=None) -> sd_nets.SdNets:
        return sd_nets.read_nets(directory, self.sdxl, dtype)

    def nets_of(self, directory: str, dtype=None) -> sd_nets.SdNets:
        return self.read_nets(directory, dtype)  # its configs' errors are ModelErrors already

    def describe(self, directory, request, unet_file) -> Described:
        scheduler, timestep_spacing = request.scheduler, request.timestep_spacing
        steps, max_sequence_length = request.steps, request.max_sequence_length
        nets = self.nets_of(directory)
        if max_sequence_length is not None:
            raise ModelError(f"--max-sequence-length {max_sequence_length}: {self.title}'s CLIP text encoders take "
                             f"{nets.text_encoders[0].config.max_position_embeddings} tokens, always; the length is "
                             f"a setting of the families whose text encoder takes one (see --help)")
        sampler = resolve_sampler(directory, scheduler, timestep_spacing, steps)
        low, high, why = step_range(sampler)
        native = nets.unet.config.sample_size * nets.vae.config.scale_factor
        return Described(family=self.name, native_size=native, scheduler=sampler.choice,
                         size_multiple=SIZE_MULTIPLE, default_guidance=DEFAULT_GUIDANCE, guidance_rule="diffusers",
                         cfg=True, min_steps=low, max_steps=high, steps_bound=why)

    def load(self, directory, request, unet_file, loras, abstract) -> Model:
        import jax.numpy as jnp

        from pipeline.model.loading import convert, tokenizer as tokenizer_lib

        sampler = resolve_sampler(directory, request.scheduler, request.timestep_spacing)
        jdtype = getattr(jnp, request.jax_dtype)
        nets = self.nets_of(directory, jdtype)
        if abstract:  # the networks' shapes, in the run's dtype: what the devices hold
            params = convert.abstract_params(nets.flat_shapes(), jdtype)
        else:
            params = sd_nets.read_params(directory, nets, unet_file)
            if loras:
                try:  # on the host, in float32, each merged kernel then in the run's dtype
                    params = lora.merge(params, loras, self.lora_torch_names(), self._lora_shapes(nets), jdtype)
                except lora.LoraError as e:
                    raise ModelError(str(e)) from None
        length = nets.text_encoders[0].config.max_position_embeddings
        try:
            tokenizers = [tokenizer_lib.clip(os.path.join(directory, folder), length)
                          for folder in ("tokenizer", "tokenizer_2")[:len(nets.text_encoders)]]
        except tokenizer_lib.TokenizerError as e:
            raise ModelError(str(e)) from None
        nets = dataclasses.replace(nets, tokenizer=tokenizers[0], tokenizer_2=tokenizers[1] if self.sdxl else None)
        f = nets.vae.config.scale_factor
        unet = nets.unet.config
        return Model(path=request.model, fingerprint=None, family=self, nets=nets, sampler=sampler, params=params,
                     dtype=jdtype, latent_channels=unet.in_channels, vae_scale_factor=f,
                     native_size=unet.sample_size * f, param_dtype=jdtype)

    def lora_torch_names(self) -> dict:
        from pipeline.model.families.sd import unet as unet_net
        from pipeline.model.layers.text import clip

        return {"unet": unet_net.TORCH_NAMES, "text_encoder": clip.TORCH_NAMES, "text_encoder_2": clip.TORCH_NAMES}

    @staticmethod
    def _lora_shapes(nets: sd_nets.SdNets) -> dict:
        """The UNet's and every text encoder layer's shapes, the layers a run does not compute
        included (a LoRA for SDXL's first encoder adapts its last layer too)."""
        shapes = {name: encoder.whole_shapes() for name, encoder in zip(nets.text_components, nets.text_encoders)}
        return {**shapes, "unet": nets.flat_shapes()["unet"]}

    def lora_shapes(self, directory: str) -> dict:
        return self._lora_shapes(self.nets_of(directory))

    # ---- prompts

    def tokenize(self, model: Model, texts):
        """[N, L] for SD, [N, 2, L] (one row per tokenizer) for SDXL; both SDXL tokenizers
        pad to the first tokenizer's length, as diffusers does."""
        import numpy as np

        length = model.nets.tokenizer.model_max_length
        tokenizers = [model.nets.tokenizer] + ([model.nets.tokenizer_2] if self.sdxl else [])
        ids = [t.ids(list(texts), length) for t in tokenizers]
        return (ids[0] if len(ids) == 1 else np.stack(ids, axis=1)).astype(np.int32)

    def truncated(self, model: Model, texts) -> list[bool]:
        limit = model.nets.tokenizer.model_max_length
        return [count > limit for count in model.nets.tokenizer.counts(list(texts))]

    # ---- sampling

    def make_encode_fn(self, model: Model):
        """``encode(params, ids) -> (context, text_embeds)``.

        SD 1.x/2.x: the text encoder's last hidden state, no pooled embedding.
        SDXL: the penultimate hidden states of both encoders side by side, and the second
        encoder's projected pooled output; ids are [B, 2, L].
        """
        import jax.numpy as jnp

        nets = model.nets
        modules = [encoder.module(model.dtype) for encoder in nets.text_encoders]

        def run(params, index, ids):
            return modules[index].apply({"params": params[nets.text_components[index]]}, ids)

        if not self.sdxl:
            return lambda params, ids: (run(params, 0, ids).last, None)

        def encode(params, ids):
            first, second = run(params, 0, ids[:, 0]), run(params, 1, ids[:, 1])
            return jnp.concatenate([first.hidden, second.previous], axis=-1), second.embeds
        return encode

    def latents_note(self, model: Model) -> dict:
        return {"latents": ("final latents of each image: the scheduler's output after the last step, before the "
                            "division by the VAE's scaling_factor; decode(latents / scaling_factor) gives the image. "
                            "Row = position, as in zarr/images."),
                "vae_scaling_factor": float(model.nets.vae.config.scaling_factor)}

    def denoiser_calls(self, model: Model, steps: int) -> int:
        """The UNet calls of ``steps`` steps: one each, but for PNDM (one more, or 9 more
        with its Runge-Kutta start, as diffusers' pipelines run it)."""
        from pipeline.model.sampling import schedules

        return schedules.make_schedule(model.sampler.config, model.sampler.choice, steps).num_steps

    def make_denoise(self, model: Model, steps: int, empty_negative_ids=None, *,
                     return_latents: bool = False, guidance_rule: str = "diffusers", guided: bool = True,
                     seam=contextlib.nullcontext, decode=decoding.whole):
        """``denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None)``:
        float32 images in [0, 1], [B, H, W, 3], from given initial latents (float32
        [B, C, H/f, W/f]). ``image_keys`` (B typed keys) are needed by the stochastic
        samplers only: step ``i`` adds ``keys.step_noise(image key, i, ...)``. ``decode``
        runs ``decode_latents`` on the final latents (``Family.make_denoise``).

        With ``return_latents``: (images, final latents), the final latents float32
        [B, C, H/f, W/f] after the last scheduler step, before the division by
        ``vae.config.scaling_factor`` that precedes decoding (see ``decode_latents``).

        ``guided`` (chosen per run): True runs classifier-free guidance as one UNet call on
        [negative; positive] (batch 2B). Under ``guidance_rule="diffusers"`` (diffusers' rule)
        an image whose guidance is > 1 gets ``uncond + g * (cond - uncond)`` and one at
        guidance <= 1 the conditional prediction alone; each image's own guidance decides,
        never its neighbours'.
        False is the guidance-free program: the UNet runs on the prompts alone (batch B), no
        negative prompt is encoded, and ``negative_ids`` and ``guidance`` are not read.

        For SDXL, a row whose negative ids equal ``empty_negative_ids`` (the tokenised empty
        prompt) is conditioned on zeros instead, as SDXL was trained
        (``force_zeros_for_empty_prompt``).
        """
        import jax
        import jax.numpy as jnp

        from pipeline.model.sampling import schedules, stepping

        if guidance_rule != "diffusers":
            raise ValueError(f"guidance_rule must be diffusers, got {guidance_rule!r}")
        unet = model.nets.unet
        schedule = schedules.make_schedule(model.sampler.config, model.sampler.choice, steps)  # on the host, once
        stochastic = model.sampler.stochastic
        encode = self.make_encode_fn(model)
        factor = model.vae_scale_factor

        def conditioning(params, prompt_ids, negative_ids, latents):
            """(context, {text_embeds, time_ids} or None) for the UNet batch: [negative;
            positive] when guided."""
            batch = prompt_ids.shape[0]
            context, pooled = encode(params, prompt_ids)
            if guided:
                negative_context, negative_pooled = encode(params, negative_ids)
            if pooled is None:
                return (jnp.concatenate([negative_context, context]) if guided else context), None
            height, width = latents.shape[2] * factor, latents.shape[3] * factor
            # SDXL's micro-conditioning: original size, crop top-left, target size (float32, as exact as can be)
            time_ids = jnp.broadcast_to(jnp.array([height, width, 0, 0, height, width], jnp.float32), (batch, 6))
            if not guided:
                return context, {"text_embeds": pooled, "time_ids": time_ids}
            if empty_negative_ids is not None:
                empty = jnp.all(negative_ids == jnp.asarray(empty_negative_ids),
                                axis=tuple(range(1, negative_ids.ndim)))
                negative_context = jnp.where(empty[:, None, None], 0, negative_context)
                negative_pooled = jnp.where(empty[:, None], 0, negative_pooled)
            return jnp.concatenate([negative_context, context]), {
                "text_embeds": jnp.concatenate([negative_pooled, pooled]),
                "time_ids": jnp.concatenate([time_ids, time_ids])}

        def denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None):
            with seam():
                return traced(params, prompt_ids, negative_ids, guidance, latents, image_keys)

        def traced(params, prompt_ids, negative_ids, guidance, latents, image_keys):
            batch = prompt_ids.shape[0]
            if stochastic and image_keys is None:
                raise ValueError(f"the {model.sampler.choice} sampler draws noise at each step: it needs the image "
                                 f"keys")
            context, added = conditioning(params, prompt_ids, negative_ids, latents)
            scale = guidance.astype(jnp.float32).reshape(batch, 1, 1, 1)
            latents = latents * schedule.init_noise_sigma
            noise_shape = latents.shape[1:]
            timesteps = jnp.asarray(schedule.timesteps)

            def step(i, carry):
                latents, state = carry
                t = timesteps[i]
                model_input = stepping.scale_input(schedule, i, jnp.concatenate([latents, latents])
                                                   if guided else latents)
                prediction = unet.apply({"params": params["unet"]}, model_input,
                                        jnp.broadcast_to(t, (model_input.shape[0],)), context, **(added or {}))
                # guidance and the scheduler run in float32 whatever the network dtype
                if guided:
                    prediction = guidance_rules.rule(guidance_rule).combine(prediction, scale)
                noise = jax.vmap(lambda k: keys.step_noise(k, i, noise_shape))(image_keys) if stochastic else None
                return stepping.advance(schedule, i, prediction, latents, noise, state)

            carry = (latents, stepping.start(schedule, latents))
            latents, _ = jax.lax.fori_loop(0, schedule.num_steps, step, carry)
            images = decode(lambda z: self.decode_latents(model, params["vae"], z), latents)
            return (images, latents.astype(jnp.float32)) if return_latents else images

        return denoise

    # ---- parts

    def parts(self, model: Model, width: int, height: int, per_device_batch: int, guided: bool, *,
              seam=contextlib.nullcontext, sharding=None, count: bool = False
              ) -> list[tuple[str, tuple[str, ...], object]]:
        """The text encoders on the UNet's rows, one UNet call, the VAE decode. ``count``:
        the text encoders' scanned layers unrolled, so that XLA's cost analysis (which counts
        a loop's body once) counts every one of them."""
        import jax
        import jax.numpy as jnp

        from pipeline.model import shapes
        from pipeline.model.layers import vae as vae_net

        nets = model.nets
        rows = per_device_batch * (2 if guided else 1)  # through the text encoders and the UNet
        make = shapes.on(sharding)

        def placed(component):
            return shapes.params(model.params[component], sharding, model.param_dtype)

        found = []
        length = nets.text_encoders[0].config.max_position_embeddings
        for name, encoder in zip(nets.text_components, nets.text_encoders):
            module = encoder.module(model.dtype)
            if count:
                module = module.clone(unroll=encoder.layers)
            lowered = jax.jit(lambda p, i, m=module: m.apply({"params": p}, i)).lower(
                placed(name), make((rows, length), jnp.int32))
            found.append(("text_encoder", (name,), lowered))
        unet, config = nets.unet, nets.unet.config
        channels, h, w = model.latent_shape(width, height)
        added = {}
        if config.addition_embed_type == "text_time":  # SDXL: pooled text and 6 size/crop ids
            added = {"text_embeds": make((rows, config.pooled_dim), model.dtype),
                     "time_ids": make((rows, 6), jnp.float32)}
        context_width = sum(encoder.config.hidden_size for encoder in nets.text_encoders)

        def call(p, x, t, context, added):
            with seam():
                return unet.apply({"params": p}, x, t, context, **added)

        found.append(("denoiser", ("unet",), jax.jit(call).lower(
            placed("unet"), make((rows, channels, h, w), jnp.float32), make((rows,), jnp.int32),
            make((rows, length, context_width), model.dtype), added)))

        def decode(p, z):
            with seam():
                return vae_net.vae_decode(nets.vae, p, z, nets.vae.config)

        found.append(("vae_decode", ("vae",), jax.jit(decode).lower(
            placed("vae"), make((per_device_batch, *model.latent_shape(width, height)), jnp.float32))))
        return found


SD = StableDiffusion(sdxl=False)
SDXL = StableDiffusion(sdxl=True)
