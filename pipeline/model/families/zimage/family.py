"""Z-Image (Turbo and base): a single-stream rectified-flow transformer on Qwen3, in
promptmill's own Flax networks.

A diffusers ``ZImagePipeline`` checkpoint: a Qwen3 ``Qwen3Model`` (``text_encoder``,
``pipeline.model.layers.text.qwen3``: its second-to-last hidden state, each prompt's own
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

from pipeline.model.families.base import Described, Model
from pipeline.model.families.qwen_text import SAMPLER, QwenTextFamily
from pipeline.model.families.zimage import guidance, presets, sampling as zimage_sampling
from pipeline.model.loading.checkpoint import ModelError, license_of
from pipeline.model.sampling import decoding

GUIDANCE, STEPS = 5.0, 50  # ZImagePipeline's defaults (the base model's settings)
TURBO_STEPS, TURBO_GUIDANCE = 8, 0.0  # the Turbo recipe: 8 transformer calls in diffusers 0.39
TURBO_NOTE = (f"ZImagePipeline's defaults ({STEPS} steps, guidance {GUIDANCE:g}: two transformer calls a step) are "
              f"the base model's; on Z-Image-Turbo use --steps {TURBO_STEPS} --guidance-scale {TURBO_GUIDANCE:g} "
              f"({TURBO_STEPS} calls an image, about 12 times fewer: {2 * STEPS} against {TURBO_STEPS}). "
              f"The model card's 9 steps predate diffusers' sigma fix: in diffusers 0.39, 8 steps are 8 calls")


class ZImage(QwenTextFamily):
    name, title = "zimage", "Z-Image"
    pipeline_classes = ("ZImagePipeline",)
    rules = (guidance.ZIMAGE,)
    size_rule = "twice the VAE's scale factor (2x2 patches): 16, or 4 for the built-in tiny models"
    steps_help = f"{STEPS} (Turbo's recipe: {TURBO_STEPS})"
    guidance_help = (f"classifier-free guidance above 0, prompt + g x (prompt - negative), not SD's scale "
                     f"(default {GUIDANCE:g}; Turbo: 0)")
    sequence_help = (f"Qwen3 tokens of the chat-formatted prompt, at most {zimage_sampling.MAX_SEQUENCE_LENGTH} "
                     f"(default {zimage_sampling.MAX_SEQUENCE_LENGTH}, as ZImagePipeline)")
    presets, sampling = presets, zimage_sampling
    pipeline_title = "ZImagePipeline"
    sigmas_note = "Z-Image's flow-matching sigmas are linspace(1, 1/N, N), shifted as its scheduler config says"

    @staticmethod
    def transformer_module():
        from pipeline.model.families.zimage import transformer

        return transformer

    def guidance_rule(self, model: Model) -> str:
        return guidance.ZIMAGE.name

    def check_length(self, directory: str, nets, length: int) -> None:
        try:
            nets.transformer.config.check_sizes(1, 1, length)
        except ValueError as e:
            raise ModelError(f"{directory}: {e}") from None

    def describe(self, directory, request, unet_file) -> Described:
        nets, length = self.checked_request(directory, request, unet_file)
        config = nets.transformer.config
        f = 2 * nets.vae_scale_factor
        return Described(family=self.name, native_size=1024, scheduler=SAMPLER, size_multiple=f,
                         default_guidance=GUIDANCE, guidance_rule=guidance.ZIMAGE.name, cfg=True,
                         max_sequence_length=length, license=license_of(directory), default_steps=STEPS,
                         defaults_note=TURBO_NOTE,
                         max_size=min(4096, f * min(config.axes_lens[1], config.axes_lens[2])))

    # ---- sampling

    def make_denoise(self, model: Model, steps: int, empty_negative_ids=None, *,
                     return_latents: bool = False, guidance_rule: str = "zimage", guided: bool = True,
                     seam=contextlib.nullcontext, decode=decoding.whole):
        """``QwenTextFamily.denoise_fn`` under Z-Image's own rule."""
        if guidance_rule != guidance.ZIMAGE.name:
            raise ValueError(f"guidance_rule {guidance_rule!r}: Z-Image guides by its own rule, 'zimage'")
        return self.denoise_fn(model, steps, return_latents, guided, guidance_rule, seam=seam, decode=decode)

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
        _, rows, cols = model.latent_shape(width, height)

        def call(p, x, states, lengths, t):
            with seam():
                return transformer.apply({"params": p}, x, states, lengths, t, image_rows=rows // 2)

        found.append(("denoiser", ("transformer",), jax.jit(call).lower(
            placed("transformer"), make((b, (rows // 2) * (cols // 2), config.patch_dim), jnp.float32),
            make((b, length, config.cap_feat_dim), model.dtype), make((b,), jnp.int32), make((b,), jnp.float32))))
        found.append(self.vae_part(model, per_device_batch, width, height, seam=seam, make=make, placed=placed))
        return found


ZIMAGE = ZImage()
