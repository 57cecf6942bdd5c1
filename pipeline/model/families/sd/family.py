"""SD 1.x/2.x and SDXL: diffusers' Flax UNet and VAE, transformers' Flax CLIP text encoders.

SD runs one CLIP text encoder (its last hidden state); SDXL runs two side by side (their
penultimate hidden states, the second's projected pooled output) and conditions the
UNet on size ids. Classifier-free guidance runs the UNet on [negative; positive] (twice
the rows), or not at all in a guidance-free run; the loop is diffusers' Flax scheduler
or promptmill's own steps (``pipeline.model.sampling.scheduler``); the VAE decodes
``latents / scaling_factor``. Their code and their images are those promptmill always
made: this module is where they live behind the family seam.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

from pipeline.core import keys
from pipeline.model.loading import fetch, lora, weights
from pipeline.model.families.base import Described, Family, Model
from pipeline.model.families.sd import presets
from pipeline.model.sampling import decoding, guidance as guidance_rules
from pipeline.model.sampling.scheduler import Sampler, make_flax_scheduler, resolve_sampler, step_range
from pipeline.model.loading.checkpoint import ModelError, read_json_file

COMPONENTS = ("tokenizer", "text_encoder", "unet", "vae", "scheduler")
SDXL_COMPONENTS = ("tokenizer_2", "text_encoder_2")  # SDXL's second text encoder
DEFAULT_GUIDANCE = 7.5  # diffusers' StableDiffusionPipeline and StableDiffusionXLPipeline
SIZE_MULTIPLE = 8  # the VAE's scale factor

# UNet config keys that the Flax UNet lacks and that would change its output: a
# checkpoint setting them is refused, not loaded without them
_UNET_KEYS_FLAX_LACKS = ("time_cond_proj_dim", "class_embed_type", "encoder_hid_dim")


def _config(directory: str, component: str, filename: str = "config.json") -> dict:
    return read_json_file(os.path.join(directory, component, filename))


def check_unet(directory: str) -> None:
    """ModelError naming each UNet config key the Flax UNet would drop (e.g. an LCM
    UNet's ``time_cond_proj_dim``, the guidance embedding)."""
    config = _config(directory, "unet")
    asked = [f"{key}={config[key]!r}" for key in _UNET_KEYS_FLAX_LACKS if config.get(key) is not None]
    if asked:
        raise ModelError(f"{directory}: unet/config.json asks for {', '.join(asked)}, which diffusers' Flax UNet "
                         f"does not have; promptmill cannot run this UNet as its config says")


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


def _to_bf16(tree):
    import jax
    import jax.numpy as jnp

    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
        return x.astype(jnp.bfloat16)

    return jax.tree_util.tree_map(cast, tree)


def with_sampler_state(sampler: Sampler, params: dict) -> tuple[object, dict]:
    """(the Flax scheduler or None, params with the Flax scheduler's state or without any)."""
    params = {name: tree for name, tree in params.items() if name != "scheduler"}
    if sampler.engine != "flax":
        return None, params
    flax_scheduler, params["scheduler"] = make_flax_scheduler(sampler)
    return flax_scheduler, params


@dataclasses.dataclass(frozen=True)
class SdNets:
    """An SD or SDXL checkpoint's networks (``Model.nets``): diffusers' Flax UNet and VAE,
    transformers' CLIP tokenizers and text encoders (the second ones SDXL's), and the
    diffusers Flax scheduler of a "flax"-engine sampler (else None)."""
    tokenizer: object
    text_encoder: object
    unet: object
    vae: object
    scheduler: object = None
    tokenizer_2: object = None
    text_encoder_2: object = None


class StableDiffusion(Family):
    """SD 1.x/2.x (``sdxl=False``) or SDXL."""

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
        sampler = resolve_sampler(directory, scheduler, timestep_spacing)
        flax_scheduler, params = with_sampler_state(sampler, model.params)
        nets = dataclasses.replace(model.nets, scheduler=flax_scheduler)
        return dataclasses.replace(model, sampler=sampler, nets=nets, params=params)

    def builtins(self) -> dict:
        return {name: preset for name, preset in presets.PRESETS.items() if preset["family"] == self.name}

    def ensure_builtin(self, name: str, shapes: bool = False) -> str:
        return presets.ensure(name, shapes)

    def components(self, index: dict) -> tuple[str, ...]:
        return COMPONENTS + (SDXL_COMPONENTS if self.sdxl else ())

    def weight_libraries(self, index: dict) -> dict[str, str]:
        own = {"text_encoder": "transformers", "unet": "diffusers", "vae": "diffusers"}
        return {**own, "text_encoder_2": "transformers"} if self.sdxl else own

    def unet_file(self, directory: str, unet: str) -> str:
        unet_file = fetch.resolve_unet(unet)
        check_unet_file(directory, unet_file)
        return unet_file

    def describe(self, directory, request, unet_file) -> Described:
        scheduler, timestep_spacing = request.scheduler, request.timestep_spacing
        steps, max_sequence_length = request.steps, request.max_sequence_length
        check_unet(directory)
        if max_sequence_length is not None:
            raise ModelError(f"--max-sequence-length {max_sequence_length}: {self.title}'s CLIP text encoders take "
                             f"{_config(directory, 'text_encoder').get('max_position_embeddings', 77)} tokens, always; "
                             f"the length is a setting of the families whose text encoder takes one (see --help)")
        vae_scale = 2 ** (len(_config(directory, "vae")["block_out_channels"]) - 1)
        sampler = resolve_sampler(directory, scheduler, timestep_spacing, steps)
        low, high, why = step_range(sampler)
        return Described(family=self.name, native_size=_config(directory, "unet")["sample_size"] * vae_scale,
                         scheduler=sampler.choice, size_multiple=SIZE_MULTIPLE, default_guidance=DEFAULT_GUIDANCE,
                         guidance_rule="diffusers", cfg=True, min_steps=low, max_steps=high, steps_bound=why)

    def load(self, directory, request, unet_file, loras, abstract) -> Model:
        import jax.numpy as jnp
        from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel
        from transformers import CLIPTokenizer, FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

        check_unet(directory)
        sampler = resolve_sampler(directory, request.scheduler, request.timestep_spacing)
        jdtype = getattr(jnp, request.jax_dtype)
        tokenizer = CLIPTokenizer.from_pretrained(os.path.join(directory, "tokenizer"))
        text_encoder, text_params = weights.load_transformers(
            FlaxCLIPTextModel, directory, "text_encoder", jdtype, abstract)
        unet, unet_params = weights.load_diffusers(
            FlaxUNet2DConditionModel, directory, "unet", jdtype, unet_file, abstract)
        vae, vae_params = weights.load_diffusers(FlaxAutoencoderKL, directory, "vae", jdtype, abstract=abstract)
        params = {"text_encoder": text_params, "unet": unet_params, "vae": vae_params}
        tokenizer_2 = text_encoder_2 = None
        if self.sdxl:
            tokenizer_2 = CLIPTokenizer.from_pretrained(os.path.join(directory, "tokenizer_2"))
            text_encoder_2, params["text_encoder_2"] = weights.load_transformers(
                FlaxCLIPTextModelWithProjection, directory, "text_encoder_2", jdtype, abstract)
        if not abstract:
            try:  # on the host, in float32: before the cast below and before any transfer to devices
                params = lora.merge(params, loras)
            except lora.LoraError as e:
                raise ModelError(str(e)) from None
        if jdtype == jnp.bfloat16:  # weights in bf16 too: half the memory and bandwidth
            params = {component: _to_bf16(tree) for component, tree in params.items()}
        flax_scheduler, params = with_sampler_state(sampler, params)
        f = 2 ** (len(vae.config.block_out_channels) - 1)
        nets = SdNets(tokenizer, text_encoder, unet, vae, flax_scheduler, tokenizer_2, text_encoder_2)
        return Model(path=request.model, fingerprint=None, family=self, nets=nets, sampler=sampler, params=params,
                     dtype=unet.dtype, latent_channels=unet.config.in_channels, vae_scale_factor=f,
                     native_size=unet.config.sample_size * f)

    def lora_shapes(self, directory: str) -> dict:
        components = ("unet", "text_encoder") + (("text_encoder_2",) if self.sdxl else ())
        return {component: weights.param_shapes(directory, component) for component in components}

    # ---- prompts

    def tokenize(self, model: Model, texts):
        """[N, L] for SD, [N, 2, L] (one row per tokenizer) for SDXL; both SDXL tokenizers
        pad to the first tokenizer's length, as diffusers does."""
        import numpy as np

        length = model.nets.tokenizer.model_max_length
        tokenizers = [model.nets.tokenizer] + ([model.nets.tokenizer_2] if self.sdxl else [])
        ids = [t(list(texts), padding="max_length", max_length=length, truncation=True,
                 return_tensors="np").input_ids for t in tokenizers]
        return (ids[0] if len(ids) == 1 else np.stack(ids, axis=1)).astype(np.int32)

    def truncated(self, model: Model, texts) -> list[bool]:
        limit = model.nets.tokenizer.model_max_length
        ids = model.nets.tokenizer(list(texts), truncation=False, verbose=False).input_ids
        return [len(row) > limit for row in ids]

    # ---- sampling

    def make_encode_fn(self, model: Model):
        """``encode(params, ids) -> (context, added_cond)``.

        SD 1.x/2.x: the text encoder's last hidden state, no added conditioning.
        SDXL: the penultimate hidden states of both encoders side by side, and the second
        encoder's projected pooled output as ``text_embeds``; ids are [B, 2, L].
        """
        import jax.numpy as jnp

        if not self.sdxl:
            def encode(params, ids):
                return model.nets.text_encoder(ids, params=params["text_encoder"])[0], None
            return encode

        def encode(params, ids):
            first = model.nets.text_encoder(ids[:, 0], params=params["text_encoder"], output_hidden_states=True)
            second = model.nets.text_encoder_2(ids[:, 1], params=params["text_encoder_2"], output_hidden_states=True)
            context = jnp.concatenate([first.hidden_states[-2], second.hidden_states[-2]], axis=-1)
            return context, {"text_embeds": second.text_embeds}
        return encode

    def decode_latents(self, model: Model, vae_params, latents):
        """Decoded ``latents / scaling_factor``, as float32 images in [0, 1]."""
        import jax.numpy as jnp

        vae = model.nets.vae
        images = vae.apply({"params": vae_params}, latents / vae.config.scaling_factor, method=vae.decode).sample
        return jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)

    def latents_note(self, model: Model) -> dict:
        return {"latents": ("final latents of each image: the scheduler's output after the last step, before the "
                            "division by the VAE's scaling_factor; decode(latents / scaling_factor) gives the image. "
                            "Row = position, as in zarr/images."),
                "vae_scaling_factor": float(model.nets.vae.config.scaling_factor)}

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
        never its neighbours'. ``"always"`` guides every image (runs planned before the rule).
        False is the guidance-free program: the UNet runs on the prompts alone (batch B), no
        negative prompt is encoded, and ``negative_ids`` and ``guidance`` are not read.

        For SDXL, a row whose negative ids equal ``empty_negative_ids`` (the tokenised empty
        prompt) is conditioned on zeros instead, as SDXL was trained
        (``force_zeros_for_empty_prompt``).
        """
        import jax
        import jax.numpy as jnp

        if guidance_rule not in ("diffusers", "always"):
            raise ValueError(f"guidance_rule must be diffusers or always, got {guidance_rule!r}")
        if guidance_rule == "always" and not guided:
            raise ValueError("the 'always' guidance rule guides every image; it has no guidance-free program")
        unet = model.nets.unet
        loop = _FlaxSteps(model, steps) if model.sampler.engine == "flax" else _OwnSteps(model, steps)
        stochastic = model.sampler.stochastic
        encode = self.make_encode_fn(model)
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
                raise ValueError(f"the {model.sampler.choice} sampler draws noise at each step: it needs the image "
                                 f"keys")
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
                    prediction = guidance_rules.combine(guidance_rule, prediction, scale)
                noise = jax.vmap(lambda k: keys.step_noise(k, i, noise_shape))(image_keys) if stochastic else None
                return loop.update(state, i, t, prediction, latents, noise)

            latents, _ = jax.lax.fori_loop(0, steps, step, (latents, state))
            images = decode(lambda z: self.decode_latents(model, params["vae"], z), latents)
            return (images, latents.astype(jnp.float32)) if return_latents else images

        return denoise

    # ---- parts

    def parts(self, model: Model, width: int, height: int, per_device_batch: int, guided: bool, *,
              seam=contextlib.nullcontext, sharding=None, count: bool = False
              ) -> list[tuple[str, tuple[str, ...], object]]:
        import jax
        import jax.numpy as jnp

        from pipeline.model.families import shapes

        rows = per_device_batch * (2 if guided else 1)  # through the text encoders and the UNet
        make = shapes.on(sharding)
        found = []
        ids = make((rows, model.nets.tokenizer.model_max_length), jnp.int32)
        for name in sorted(n for n in model.params if n.startswith("text_encoder")):
            lowered = jax.jit(lambda p, i, e=getattr(model.nets, name): e(i, params=p)[0]).lower(
                shapes.params(model.params[name], sharding), ids)
            found.append(("text_encoder", (name,), lowered))
        unet, config = model.nets.unet, model.nets.unet.config
        channels, h, w = model.latent_shape(width, height)
        added = None
        if getattr(config, "addition_embed_type", None) == "text_time":  # SDXL: pooled text and 6 size/crop ids
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            added = {"text_embeds": make((rows, pooled), model.dtype), "time_ids": make((rows, 6), model.dtype)}

        def call(p, x, t, context, added):
            with seam():
                return unet.apply({"params": p}, x, t, encoder_hidden_states=context, added_cond_kwargs=added).sample

        length = model.nets.tokenizer.model_max_length
        found.append(("denoiser", ("unet",), jax.jit(call).lower(
            shapes.params(model.params["unet"], sharding), make((rows, channels, h, w), jnp.float32),
            make((rows,), jnp.int32), make((rows, length, config.cross_attention_dim), model.dtype), added)))
        vae = model.nets.vae

        def decode(p, z):
            with seam():
                return vae.apply({"params": p}, z, method=vae.decode).sample

        found.append(("vae_decode", ("vae",), jax.jit(decode).lower(
            shapes.params(model.params["vae"], sharding),
            make((per_device_batch, *model.latent_shape(width, height)), jnp.float32))))
        return found


class _FlaxSteps:
    """The loop of a ``flax``-engine sampler: diffusers' Flax scheduler and its state."""

    def __init__(self, model, steps: int):
        self.scheduler, self.steps = model.nets.scheduler, steps

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
    """The loop of a ``steps``-engine sampler: ``pipeline.model.sampling.stepping`` over a schedule
    that ``pipeline.model.sampling.steps`` computed once, on the host, when the program is traced
    (no state)."""

    def __init__(self, model, steps: int):
        from pipeline.model.sampling import stepping, steps as steps_lib

        self.lib = stepping
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


SD = StableDiffusion(sdxl=False)
SDXL = StableDiffusion(sdxl=True)
