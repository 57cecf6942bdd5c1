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
    steps_help = f"{STEPS} (Turbo's recipe: {TURBO_STEPS})"
    guidance_help = (f"classifier-free guidance above 0, prompt + g x (prompt - negative), not SD's scale "
                     f"(default {GUIDANCE:g}; Turbo: 0)")
    presets, flow = presets, zimage_sampling.FLOW

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

    def latents_note(self, model: Model) -> dict:
        config = model.nets.vae.config
        return {"latents": ("final latents of each image [C, H/f, W/f], the flow's output after the last step: "
                            "latents / scaling_factor + shift_factor decoded gives the image. Row = position, as in "
                            "zarr/images."),
                "vae_scaling_factor": float(config.scaling_factor), "vae_shift_factor": float(config.shift_factor)}

    # ---- parts

    def deepest_stack(self, config) -> int:
        return max(config.n_layers, config.n_refiner_layers, 1)

    def denoiser_call(self, model: Model, transformer, grid, batch: int, *, make, seam=contextlib.nullcontext):
        """The transformer on each caption's own states (its length), the image 2x2-patched."""
        import jax.numpy as jnp

        rows, cols = grid
        config, length = transformer.config, model.nets.max_sequence_length

        def call(p, x, states, lengths, t):
            with seam():
                return transformer.apply({"params": p}, x, states, lengths, t, image_rows=rows // 2)

        return call, (make((batch, (rows // 2) * (cols // 2), config.patch_dim), jnp.float32),
                      make((batch, length, config.cap_feat_dim), model.dtype), make((batch,), jnp.int32),
                      make((batch,), jnp.float32))


ZIMAGE = ZImage()
