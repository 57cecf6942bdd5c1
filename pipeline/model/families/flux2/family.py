"""FLUX.2 [klein]: guidance-distilled rectified-flow transformer, in promptmill's own Flax networks.

A diffusers ``Flux2KleinPipeline`` checkpoint: a Qwen3 causal LM (``text_encoder``,
``pipeline.model.layers.text.qwen3``: hidden states 9, 18, 27, stacked), its tokenizer
(``tokenizer``, Qwen's chat template), ``Flux2Transformer2DModel`` (``transformer``,
``pipeline.model.families.flux2.transformer``), ``AutoencoderKLFlux2`` (``vae``: batch-norm
statistics, 2x2-patched latents, ``pipeline.model.layers.vae``) and
``FlowMatchEulerDiscreteScheduler`` with klein's empirical ``mu``
(``pipeline.model.families.flux2.sampling``). Initial latents are drawn patched, [4C, H/2f,
W/2f]: the model's ``latent_channels`` is the transformer's ``in_channels`` and its
``vae_scale_factor`` twice the VAE's.

Guidance, by ``model_index.json``'s ``is_distilled``:

- distilled (klein, 4 steps by default): none. A guidance scale given is unused
  (``guidance_rule`` "unused", counted and said on the card, as FLUX.1 [schnell]'s) and
  negative prompts are never used;
- base (klein-base, 50 steps, guidance 4.0 by default): classifier-free guidance as
  ``Flux2KleinPipeline`` runs it when the scale is above 1 (``do_classifier_free_guidance``),
  two transformer predictions per step, ``neg + s * (pos - neg)``, the negative prompt the
  empty one unless a record gives its own; an image whose guidance is 1 or less takes the
  positive prediction by selection (the "diffusers" rule, ``guidance.Rule.combine``).

Weights are PyTorch safetensors converted
once per machine (``weights.converted``); the text encoder's layers past the deepest
hidden state read (27) are never read.
"""
from __future__ import annotations

import contextlib

from pipeline.model.families.base import Described, Model
from pipeline.model.families.flux2 import presets, sampling as flux2_sampling
from pipeline.model.families.qwen_text import SAMPLER, QwenTextFamily
from pipeline.model.loading.checkpoint import license_of

GUIDANCE = 0.0  # a distilled klein takes none (its authors pass 1.0, unused): recorded 0, as FLUX.1 [schnell]
BASE_GUIDANCE = 4.0  # Flux2KleinPipeline's default guidance_scale, for the base models
# default steps: BFL's fixed 4 for the distilled models (Flux2KleinPipeline's default is 50,
# the base models' setting, which a distilled model does not need), 50 for the base ones
STEPS, BASE_STEPS = 4, 50
NOT_YET = {"Flux2Pipeline": "FLUX.2 [dev] (Flux2Pipeline, with a Mistral text encoder) is not run by promptmill yet; "
                            "of FLUX.2 it runs [klein] (Flux2KleinPipeline)"}


class Flux2(QwenTextFamily):
    name, title = "flux2", "FLUX.2 [klein]"
    pipeline_classes = ("Flux2KleinPipeline",)
    not_yet = NOT_YET
    steps_help = f"{STEPS}, its base models {BASE_STEPS}"
    guidance_help = (f"[klein] (distilled): none, a guidance scale given is unused; [klein] base: classifier-free "
                     f"guidance above 1 (default {BASE_GUIDANCE:g})")
    presets, flow = presets, flux2_sampling.FLOW

    def guidance_rule(self, model: Model) -> str:
        return "unused" if model.nets.distilled else "diffusers"

    def classifier_free(self, model: Model) -> bool:
        return not model.nets.distilled

    def describe(self, directory, request, unet_file) -> Described:
        nets, length = self.checked_request(directory, request, unet_file)
        native = 128 * nets.vae_scale_factor  # Flux2KleinPipeline's default_sample_size x the VAE's factor
        distilled = nets.distilled
        return Described(family=self.name, native_size=native, scheduler=SAMPLER,
                         size_multiple=2 * nets.vae_scale_factor,
                         default_guidance=GUIDANCE if distilled else BASE_GUIDANCE,
                         guidance_rule="unused" if distilled else "diffusers", cfg=not distilled,
                         max_sequence_length=length, license=license_of(directory),
                         default_steps=STEPS if distilled else BASE_STEPS,
                         steps_note=(f"{STEPS}, BFL's setting for a distilled [klein] (Flux2KleinPipeline's default "
                                     f"of {BASE_STEPS} is the base models')" if distilled else ""))

    def latents_note(self, model: Model) -> dict:
        return {"latents": ("final latents of each image, 2x2-patched and unpacked [4C, H/2f, W/2f]: the flow's "
                            "output after the last step, before the VAE's batch-norm un-normalisation; "
                            "unpatchify(latents * sqrt(bn.running_var + batch_norm_eps) + bn.running_mean) "
                            "decoded gives the image. Row = position, as in zarr/images."),
                "vae_batch_norm_eps": float(model.nets.vae.config.batch_norm_eps)}

    # ---- parts

    def deepest_stack(self, config) -> int:
        return max(config.num_layers, config.num_single_layers)

    def denoiser_call(self, model: Model, transformer, grid, batch: int, *, make, seam=contextlib.nullcontext):
        """The transformer on the stacked states, with the image and text tokens' positions."""
        import jax.numpy as jnp
        import numpy as np

        from pipeline.model.families.flux2 import transformer as flux2_net

        rows, cols = grid
        config, length = transformer.config, model.nets.max_sequence_length
        image_ids, txt_ids = flux2_net.latent_image_ids(rows, cols), flux2_net.text_ids(length)

        def call(p, x, context, t):
            with seam():
                return transformer.apply({"params": p}, x, context, t, np.asarray(image_ids), np.asarray(txt_ids))

        return call, (make((batch, rows * cols, config.in_channels), jnp.float32),
                      make((batch, length, config.joint_attention_dim), model.dtype), make((batch,), jnp.float32))


FLUX2 = Flux2()
