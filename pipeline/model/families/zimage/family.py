"""Z-Image (Turbo and base): a single-stream rectified-flow transformer on Qwen3, in
promptmill's own Flax networks.

A diffusers ``ZImagePipeline`` checkpoint: a Qwen3 ``Qwen3Model`` (``text_encoder``,
``pipeline.model.layers.qwen3``: its second-to-last hidden state, each prompt's own
tokens), its tokenizer (``tokenizer``, Qwen's chat template, thinking on),
``ZImageTransformer2DModel`` (``transformer``, ``pipeline.model.families.zimage.transformer``),
FLUX.1's ``AutoencoderKL`` (``vae``) and ``FlowMatchEulerDiscreteScheduler``
(``pipeline.model.families.zimage.sampling``).

Guidance is Z-Image's own rule ("zimage", ``zimage.guidance``), not SD's: an image whose
guidance g is above 0 gets classifier-free guidance, ``pos + g * (pos - neg)`` (g = 1
already guides), at 0 the prompt alone. The defaults are diffusers' (50 steps, guidance
5.0: the base model's settings); the Turbo recipe is 8 steps at guidance 0. A Turbo
checkpoint cannot be told from a base one by its files, so a run at the defaults is told
the Turbo recipe and what the defaults cost beside it (``steps_note``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

from pipeline.model.families.base import Described, Family, Model
from pipeline.model.families.zimage import guidance, presets, sampling as zimage_sampling
from pipeline.model.loading import convert, lora, weights
from pipeline.model.loading.checkpoint import ModelError, license_of
from pipeline.model.sampling import decoding
from pipeline.model.sampling.scheduler import Sampler

COMPONENTS = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")
LIBRARIES = {"text_encoder": "transformers", "transformer": "diffusers", "vae": "diffusers"}
GUIDANCE, STEPS = 5.0, 50  # ZImagePipeline's defaults (the base model's settings)
TURBO_STEPS, TURBO_GUIDANCE = 8, 0.0  # the Turbo recipe: 8 transformer calls in diffusers 0.39
SAMPLER = "flow_euler"
TURBO_NOTE = (f"ZImagePipeline's defaults ({STEPS} steps, guidance {GUIDANCE:g}: two transformer calls a step) are "
              f"the base model's; on Z-Image-Turbo use --steps {TURBO_STEPS} --guidance-scale {TURBO_GUIDANCE:g} "
              f"({TURBO_STEPS} calls an image, about 12 times fewer: {2 * STEPS} against {TURBO_STEPS}). "
              f"The model card's 9 steps predate diffusers' sigma fix: in diffusers 0.39, 8 steps are 8 calls")


class ZImage(Family):
    name, title = "zimage", "Z-Image"
    pipeline_classes = ("ZImagePipeline",)
    rules = (guidance.ZIMAGE,)
    size_rule = "twice the VAE's scale factor (2x2 patches): 16, or 4 for the built-in tiny models"
    steps_help = f"{STEPS} (Turbo's recipe: {TURBO_STEPS})"
    guidance_help = (f"classifier-free guidance above 0, prompt + g x (prompt - negative), not SD's scale "
                     f"(default {GUIDANCE:g}; Turbo: 0)")
    sequence_help = (f"Qwen3 tokens of the chat-formatted prompt, at most {zimage_sampling.MAX_SEQUENCE_LENGTH} "
                     f"(default {zimage_sampling.MAX_SEQUENCE_LENGTH}, as ZImagePipeline)")

    def builtins(self) -> dict:
        return dict(presets.PRESETS)

    def ensure_builtin(self, name: str, shapes: bool = False) -> str:
        return presets.ensure(name, shapes)

    def guidance_rule(self, model: Model) -> str:
        return guidance.ZIMAGE.name

    def components(self, index: dict) -> tuple[str, ...]:
        return COMPONENTS

    def weight_libraries(self, index: dict) -> dict[str, str]:
        return dict(LIBRARIES)

    def _nets(self, directory: str, dtype=None) -> zimage_sampling.ZImageNets:
        try:
            return zimage_sampling.read_nets(directory, dtype)
        except ValueError as e:
            raise ModelError(str(e)) from None

    def describe(self, directory, request, unet_file) -> Described:
        if unet_file is not None:
            raise ModelError("--unet replaces a UNet's weights; Z-Image has a transformer, not a UNet")
        if request.scheduler not in (None, SAMPLER):
            raise ModelError(f"--scheduler {request.scheduler}: Z-Image samples with flow-matching Euler "
                             f"(FlowMatchEulerDiscreteScheduler), --scheduler {SAMPLER}")
        if request.timestep_spacing is not None:
            raise ModelError(f"--timestep-spacing {request.timestep_spacing}: Z-Image's flow-matching sigmas are "
                             f"linspace(1, 1/N, N), shifted as its scheduler config says; there is no spacing to set")
        nets = self._nets(directory)
        maximum = zimage_sampling.MAX_SEQUENCE_LENGTH
        length = maximum if request.max_sequence_length is None else request.max_sequence_length
        if not 1 <= length <= maximum:
            raise ModelError(f"--max-sequence-length must be from 1 to {maximum} (Qwen3 tokens, as ZImagePipeline "
                             f"allows), got {request.max_sequence_length}")
        try:
            nets.transformer.config.check_sizes(1, 1, length)
        except ValueError as e:
            raise ModelError(f"{directory}: {e}") from None
        if request.steps is not None:
            try:
                zimage_sampling.make_schedule(nets.scheduler_config, request.steps, 1)
            except ValueError as e:
                raise ModelError(f"{directory}: {e}") from None
        config = nets.transformer.config
        f = 2 * nets.vae_scale_factor
        return Described(family=self.name, native_size=1024, scheduler=SAMPLER, size_multiple=f,
                         default_guidance=GUIDANCE, guidance_rule=guidance.ZIMAGE.name, cfg=True, max_sequence_length=length,
                         license=license_of(directory), default_steps=STEPS, defaults_note=TURBO_NOTE,
                         max_size=min(4096, f * min(config.axes_lens[1], config.axes_lens[2])))

    def load(self, directory, request, unet_file, loras, abstract) -> Model:
        import jax.numpy as jnp
        from pipeline.model.loading import qwen_tokenizer, tokenizer as tokenizer_lib

        described = self.describe(directory, dataclasses.replace(request, steps=None), unet_file)
        jdtype = getattr(jnp, request.jax_dtype)
        nets = self._nets(directory, jdtype)
        try:
            tokenizer = qwen_tokenizer.load(os.path.join(directory, "tokenizer"))
        except tokenizer_lib.TokenizerError as e:
            raise ModelError(str(e)) from None
        if abstract:
            params = convert.abstract_params(self._flat_shapes(nets), jdtype)
        else:
            params = self._params(directory, nets)
            if loras:
                try:  # a merged layer is the one copy made on the host, cast back to its stored dtype
                    params = lora.merge(params, loras, layouts=self.lora_layouts())
                except lora.LoraError as e:
                    raise ModelError(str(e)) from None
        nets = dataclasses.replace(nets, tokenizer=tokenizer, max_sequence_length=described.max_sequence_length)
        return Model(path=request.model, fingerprint=None, family=self, nets=nets,
                     sampler=Sampler(SAMPLER, nets.scheduler_config, "flow"), params=params, dtype=jdtype,
                     latent_channels=nets.latent_channels, vae_scale_factor=nets.vae_scale_factor,
                     native_size=described.native_size, param_dtype=jdtype, default_steps=described.default_steps)

    @staticmethod
    def _flat_shapes(nets: zimage_sampling.ZImageNets) -> dict:
        from pipeline.model.families.zimage import transformer as zimage_net
        from pipeline.model.layers import qwen3, vae as vae_net

        return {"text_encoder": qwen3.param_shapes(nets.qwen3, nets.text_layers),
                "transformer": zimage_net.param_shapes(nets.transformer.config),
                "vae": vae_net.param_shapes(nets.vae.config)}

    def _params(self, directory: str, nets: zimage_sampling.ZImageNets) -> dict:
        from pipeline.model.families.zimage import transformer as zimage_net
        from pipeline.model.layers import qwen3, vae as vae_net

        rules = {"text_encoder": lambda state, where: qwen3.from_torch(state, nets.qwen3, where, nets.text_layers),
                 "transformer": lambda state, where: zimage_net.from_torch(state, nets.transformer.config, where),
                 "vae": lambda state, where: vae_net.from_torch(state, nets.vae.config, where)}
        return weights.converted_components(directory, rules, LIBRARIES, "Z-Image")

    def lora_layouts(self) -> dict:
        from pipeline.model.families.zimage import transformer as zimage_net

        return {"transformer": zimage_net.LAYOUT}

    def lora_shapes(self, directory: str) -> dict:
        """The transformer's layers: diffusers' ZImageLoraLoaderMixin loads LoRAs into it alone."""
        return {"transformer": self._flat_shapes(self._nets(directory))["transformer"]}

    # ---- prompts

    def tokenize(self, model: Model, texts):
        """int32 [N, 2L]: each chat-formatted text's Qwen3 ids, then its attention mask."""
        import numpy as np

        ids, mask = zimage_sampling.tokenize(model.nets.tokenizer, list(texts), model.nets.max_sequence_length)
        return np.concatenate([ids, mask], axis=1).astype(np.int32)

    def truncated(self, model: Model, texts) -> list[bool]:
        return zimage_sampling.truncated(model.nets.tokenizer, list(texts), model.nets.max_sequence_length)

    # ---- sampling

    def make_denoise(self, model: Model, steps: int, empty_negative_ids=None, *,
                     return_latents: bool = False, guidance_rule: str = "zimage", guided: bool = True,
                     seam=contextlib.nullcontext, decode=decoding.whole):
        """``denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None)``:
        ``zimage_sampling.make_denoise`` on the ids and masks ``tokenize`` made; the guided
        program reads the negative ids and each image's guidance, the other neither. ``decode``:
        how the VAE decodes (``Family.make_denoise``)."""
        if guidance_rule != guidance.ZIMAGE.name:
            raise ValueError(f"guidance_rule {guidance_rule!r}: Z-Image guides by its own rule, 'zimage'")
        nets, f = model.nets, model.vae_scale_factor

        def denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None):
            length = prompt_ids.shape[1] // 2
            inner = zimage_sampling.make_denoise(nets, steps, latents.shape[3] * f, latents.shape[2] * f,
                                                 return_latents, guided=guided, rule=guidance_rule,
                                                 decode=decode)
            negative = (negative_ids[:, :length], negative_ids[:, length:]) if guided else None
            with seam():
                return inner(params, prompt_ids[:, :length], prompt_ids[:, length:], latents, negative,
                             guidance if guided else None)

        return denoise

    def decode_latents(self, model: Model, vae_params, latents):
        from pipeline.model.layers import vae as vae_net
        return vae_net.vae_decode(model.nets.vae, vae_params, latents, model.nets.vae.config)

    def latents_note(self, model: Model) -> dict:
        config = model.nets.vae.config
        return {"latents": ("final latents of each image [C, H/f, W/f], the flow's output after the last step: "
                            "latents / scaling_factor + shift_factor decoded gives the image. Row = position, as in "
                            "zarr/images."),
                "vae_scaling_factor": float(config.scaling_factor), "vae_shift_factor": float(config.shift_factor)}

    # ---- parts

    def parts(self, model: Model, width: int, height: int, per_device_batch: int, guided: bool, *,
              seam=contextlib.nullcontext, sharding=None, count: bool = False):
        """Qwen3 (to its second-to-last layer) on B prompts, one transformer call on B
        images, the VAE decode (B: twice the images in a guided program)."""
        import jax
        import jax.numpy as jnp

        from pipeline.model.families import shapes
        from pipeline.model.layers import vae as vae_net

        nets = model.nets
        b = per_device_batch * (2 if guided else 1)
        make = shapes.on(sharding)

        def placed(component):
            return shapes.params(model.params[component], sharding, model.param_dtype)

        transformer = nets.transformer
        config = transformer.config
        if count:
            transformer = transformer.clone(unroll=max(config.n_layers, config.n_refiner_layers, 1))
        length = nets.max_sequence_length
        found = [("text_encoder", ("text_encoder",), jax.jit(
            lambda p, i, m: zimage_sampling.caption_states(nets, p, i, m, nets.text_layers if count else 1)).lower(
            placed("text_encoder"), make((b, length), jnp.int32), make((b, length), jnp.int32)))]
        channels, rows, cols = model.latent_shape(width, height)

        def call(p, x, states, lengths, t):
            with seam():
                return transformer.apply({"params": p}, x, states, lengths, t, image_rows=rows // 2)

        found.append(("denoiser", ("transformer",), jax.jit(call).lower(
            placed("transformer"), make((b, (rows // 2) * (cols // 2), config.patch_dim), jnp.float32),
            make((b, length, config.cap_feat_dim), model.dtype), make((b,), jnp.int32), make((b,), jnp.float32))))

        def decode(p, z):
            with seam():
                return vae_net.vae_decode(nets.vae, p, z, nets.vae.config)

        found.append(("vae_decode", ("vae",), jax.jit(decode).lower(
            placed("vae"), make((per_device_batch, channels, rows, cols), jnp.float32))))
        return found


ZIMAGE = ZImage()
