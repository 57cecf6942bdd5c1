"""FLUX.1 [schnell] and [dev]: rectified-flow transformers, in promptmill's own Flax networks.

A diffusers ``FluxPipeline`` checkpoint: CLIP-L (``text_encoder``,
``pipeline.model.layers.text.clip``: its pooled output), the T5 v1.1 encoder (``text_encoder_2``,
``pipeline.model.layers.text.t5``), ``FluxTransformer2DModel`` (``transformer``,
``pipeline.model.families.flux.transformer``), the 16-channel VAE without quant convs (``vae``,
``pipeline.model.layers.vae``) and ``FlowMatchEulerDiscreteScheduler``
(``pipeline.model.sampling.flow``). Sampling is ``pipeline.model.families.flux.sampling``: initial latents
``normal(image_key, (16, H/f, W/f))``, packed 2x2 into tokens, one transformer call per
flow-matching Euler step, unpacked and decoded ``z / scaling_factor + shift_factor``.

Guidance: never classifier-free. [dev] (``guidance_embeds``) takes each image's
``--guidance-scale`` as an embedding (``guidance_rule`` "embedded", default 3.5, as
FluxPipeline); [schnell] takes none (``"unused"``: a guidance given is counted in the
stats and said on the card, its default 0.0 as its authors run it). Negative prompts are
never used (counted likewise). Sizes are multiples of 2f (16 for FLUX.1's VAE).

Weights are PyTorch safetensors (single files or shards with their index), converted
once per machine by the networks' naming rule into stacked Flax arrays in their stored
dtype (bf16 for FLUX.1's own files: a 12B model never gets a float32 copy on the host),
memory-mapped afterwards (``weights.converted``). A run whose ``--dtype`` differs from
the stored one casts them on the devices (``Model.param_dtype``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

from pipeline.model.families.base import PATCHED_SIZE_RULE, Described, Family, Model
from pipeline.model.families.flux import presets, sampling as flux_sampling
from pipeline.model.loading import weights
from pipeline.model.loading.checkpoint import ModelError, license_of, read_json_file
from pipeline.model.sampling import decoding, flow
from pipeline.model.sampling.samplers import Sampler

COMPONENTS = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "transformer", "vae", "scheduler")
LIBRARIES = {"text_encoder": "transformers", "text_encoder_2": "transformers", "transformer": "diffusers",
             "vae": "diffusers"}
DEV_GUIDANCE = 3.5  # FluxPipeline's default guidance_scale: the embedded guidance of [dev]
SCHNELL_GUIDANCE = 0.0  # [schnell] takes none; its authors pass 0.0
# default steps, as BFL and diffusers run them: [dev] 28 (FluxPipeline's default), [schnell] 4
# (its timestep-distilled setting; FluxPipeline's default of 28 is [dev]'s)
DEV_STEPS, SCHNELL_STEPS = 28, 4
SAMPLER = "flow_euler"  # the --scheduler choice of flow-matching Euler


def _config(directory: str, component: str, filename: str = "config.json") -> dict:
    return read_json_file(os.path.join(directory, component, filename))


class Flux(Family):
    name, title = "flux", "FLUX.1"
    pipeline_classes = ("FluxPipeline",)
    cfg = False
    presets, component_folders, libraries = presets, COMPONENTS, LIBRARIES
    size_rule = PATCHED_SIZE_RULE
    steps_help = f"[schnell] {SCHNELL_STEPS}, [dev] {DEV_STEPS}"
    guidance_help = (f"[dev]: the guidance embedded in the transformer, one call per step (default {DEV_GUIDANCE:g}); "
                     f"[schnell] takes none")
    sequence_help = (f"T5 tokens, at most {flux_sampling.MAX_SEQUENCE_LENGTH} (default "
                     f"{flux_sampling.MAX_SEQUENCE_LENGTH}, as diffusers' FluxPipeline; [schnell]'s authors use 256)")

    def guidance_rule(self, model: Model) -> str:
        return "embedded" if model.nets.transformer.config.guidance_embeds else "unused"

    def read_nets(self, directory: str, dtype=None) -> flux_sampling.FluxNets:
        return flux_sampling.read_nets(directory, dtype)

    def describe(self, directory, request, unet_file) -> Described:
        scheduler, timestep_spacing = request.scheduler, request.timestep_spacing
        steps, max_sequence_length = request.steps, request.max_sequence_length
        if unet_file is not None:
            raise ModelError("--unet replaces a UNet's weights; FLUX.1 has a transformer, not a UNet")
        if scheduler not in (None, SAMPLER):
            raise ModelError(f"--scheduler {scheduler}: FLUX.1 samples with flow-matching Euler "
                             f"(FlowMatchEulerDiscreteScheduler), --scheduler {SAMPLER}")
        if timestep_spacing is not None:
            raise ModelError(f"--timestep-spacing {timestep_spacing}: FLUX.1's flow-matching sigmas are "
                             f"linspace(1, 1/N, N), shifted as its scheduler config says; there is no spacing to set")
        nets = self.nets_of(directory)
        length = flux_sampling.MAX_SEQUENCE_LENGTH if max_sequence_length is None else max_sequence_length
        if not 1 <= length <= flux_sampling.MAX_SEQUENCE_LENGTH:
            raise ModelError(f"--max-sequence-length must be from 1 to {flux_sampling.MAX_SEQUENCE_LENGTH} (T5 "
                             f"tokens, as FluxPipeline allows), got {max_sequence_length}")
        if steps is not None:
            try:
                flow.make_schedule(nets.scheduler_config, steps, 1)
            except ValueError as e:
                raise ModelError(f"{directory}: {e}") from None
        embeds = nets.guidance_embeds
        return Described(family=self.name, native_size=_config(directory, "vae").get("sample_size", 1024),
                         scheduler=SAMPLER, size_multiple=2 * nets.vae_scale_factor,
                         default_guidance=DEV_GUIDANCE if embeds else SCHNELL_GUIDANCE,
                         guidance_rule="embedded" if embeds else "unused", cfg=False, max_sequence_length=length,
                         license=license_of(directory), default_steps=DEV_STEPS if embeds else SCHNELL_STEPS,
                         steps_note="" if embeds else (f"{SCHNELL_STEPS}, [schnell]'s timestep-distilled setting "
                                                       f"(FluxPipeline's default of {DEV_STEPS} is [dev]'s)"))

    def load(self, directory, request, unet_file, loras, abstract) -> Model:
        import jax.numpy as jnp

        from pipeline.model.loading import tokenizer as tokenizer_lib

        described = self.describe(directory, dataclasses.replace(request, steps=None), unet_file)
        jdtype = getattr(jnp, request.jax_dtype)
        nets = self.nets_of(directory, jdtype)
        try:
            tokenizer = tokenizer_lib.clip(os.path.join(directory, "tokenizer"),
                                           nets.clip.config.max_position_embeddings)
            tokenizer_2 = tokenizer_lib.from_json(os.path.join(directory, "tokenizer_2"),
                                                  flux_sampling.MAX_SEQUENCE_LENGTH)
        except tokenizer_lib.TokenizerError as e:
            raise ModelError(str(e)) from None
        params = self.loaded_params(directory, nets, loras, abstract, jdtype)
        f = nets.vae_scale_factor
        nets = dataclasses.replace(nets, tokenizer=tokenizer, tokenizer_2=tokenizer_2,
                                   max_sequence_length=described.max_sequence_length)
        return Model(path=request.model, fingerprint=None, family=self, nets=nets,
                     sampler=Sampler(SAMPLER, nets.scheduler_config, "flow"), params=params, dtype=jdtype,
                     latent_channels=nets.latent_channels, vae_scale_factor=f, native_size=described.native_size,
                     param_dtype=jdtype, default_steps=described.default_steps)

    @staticmethod
    def _flat_shapes(nets: flux_sampling.FluxNets) -> dict:
        from pipeline.model.families.flux import transformer as flux_net
        from pipeline.model.layers import vae as vae_net
        from pipeline.model.layers.text import clip, t5

        return {"text_encoder": clip.param_shapes(nets.clip.config),
                "text_encoder_2": t5.NETWORK.param_shapes(nets.t5.config),
                "transformer": flux_net.NETWORK.param_shapes(nets.transformer.config),
                "vae": vae_net.NETWORK.param_shapes(nets.vae.config)}

    def _params(self, directory: str, nets: flux_sampling.FluxNets) -> dict:
        """Each component's params, converted once per machine from its safetensors (by the
        networks' naming rule, in the stored dtype) and memory-mapped after."""
        from pipeline.model.families.flux import transformer as flux_net
        from pipeline.model.layers import vae as vae_net
        from pipeline.model.layers.text import clip, t5

        rules = {"text_encoder": lambda state, where: clip.from_torch(state, nets.clip.config, where),
                 "text_encoder_2": lambda state, where: t5.NETWORK.from_torch(state, nets.t5.config, where),
                 "transformer": lambda state, where: flux_net.NETWORK.from_torch(state, nets.transformer.config, where),
                 "vae": lambda state, where: vae_net.NETWORK.from_torch(state, nets.vae.config, where)}
        return weights.converted_components(directory, rules, LIBRARIES, self.title)

    def lora_torch_names(self) -> dict:
        from pipeline.model.families.flux import transformer as flux_net
        from pipeline.model.layers.text import clip, t5

        return {"transformer": flux_net.TORCH_NAMES, "text_encoder": clip.TORCH_NAMES, "text_encoder_2": t5.TORCH_NAMES}

    def lora_shapes(self, directory: str) -> dict:
        nets = self.nets_of(directory)
        return {component: flat for component, flat in self._flat_shapes(nets).items() if component != "vae"}

    # ---- prompts

    def tokenize(self, model: Model, texts):
        """int32 [N, 77 + L]: each text's CLIP ids then its T5 ids (``--max-sequence-length``)."""
        import numpy as np

        nets = model.nets
        clip_ids, t5_ids = flux_sampling.tokenize(nets.tokenizer, nets.tokenizer_2, texts, nets.max_sequence_length)
        return np.concatenate([clip_ids, t5_ids], axis=1).astype(np.int32)

    def truncated(self, model: Model, texts) -> list[bool]:
        """Cut by T5 (longer than ``--max-sequence-length`` tokens) or by CLIP (77, its pooled
        embedding): some text encoder saw only its start."""
        texts = list(texts)
        by_t5 = flux_sampling.truncated(model.nets.tokenizer_2, texts, model.nets.max_sequence_length)
        by_clip = flux_sampling.truncated(model.nets.tokenizer, texts, model.nets.tokenizer.model_max_length)
        return [a or b for a, b in zip(by_t5, by_clip)]

    # ---- sampling

    def make_denoise(self, model: Model, steps: int, empty_negative_ids=None, *,
                     return_latents: bool = False, guidance_rule: str = "embedded", guided: bool = False,
                     seam=contextlib.nullcontext, decode=decoding.whole):
        """``denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None)``:
        ``flux_sampling.make_denoise`` on the ids ``tokenize`` made (``negative_ids`` and
        ``image_keys`` are never read: no classifier-free guidance, a deterministic
        sampler); ``guidance`` is embedded under the "embedded" rule ([dev]) and not read
        under "unused" ([schnell]). ``decode``: how the VAE decodes (``Family.make_denoise``)."""
        if guided:
            raise ValueError("FLUX.1 has no classifier-free guidance: its program is never the guided one")
        embedded = model.nets.transformer.config.guidance_embeds
        if guidance_rule != ("embedded" if embedded else "unused"):
            raise ValueError(f"guidance_rule {guidance_rule!r} does not fit this FLUX.1 transformer (guidance_embeds "
                             f"{embedded})")
        nets, f = model.nets, model.vae_scale_factor
        clip_length = nets.tokenizer.model_max_length

        def denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None):
            # the schedule follows the image's token count: made on the host, as the program is traced
            inner = flux_sampling.make_denoise(nets, steps, latents.shape[3] * f, latents.shape[2] * f,
                                               return_latents, decode=decode)
            with seam():
                return inner(params, prompt_ids[:, :clip_length], prompt_ids[:, clip_length:], latents,
                             guidance if embedded else None)

        return denoise

    def latents_note(self, model: Model) -> dict:
        return {"latents": ("final latents of each image, unpacked [C, H/f, W/f]: the flow's output after the last "
                            "step, before the VAE's scaling and shift; decode(latents / scaling_factor + "
                            "shift_factor) gives the image. Row = position, as in zarr/images."),
                "vae_scaling_factor": float(model.nets.vae.config.scaling_factor),
                "vae_shift_factor": float(model.nets.vae.config.shift_factor)}

    # ---- parts

    def parts(self, model: Model, width: int, height: int, per_device_batch: int, guided: bool, *,
              seam=contextlib.nullcontext, sharding=None, count: bool = False):
        """CLIP (pooled) and T5 on B prompts, one transformer call on B images, the VAE
        decode. ``count``: the scanned layers unrolled, so that XLA's cost analysis (which
        counts a loop's body once) counts every one of them."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from pipeline.model import shapes
        from pipeline.model.families.flux import transformer as flux_net
        from pipeline.model.layers import vae as vae_net

        b = per_device_batch
        make = shapes.on(sharding)

        def placed(component):
            return shapes.params(model.params[component], sharding, model.param_dtype)

        clip_net, t5_net, transformer = model.nets.clip, model.nets.t5, model.nets.transformer
        if count:
            clip_net = clip_net.clone(unroll=clip_net.config.num_hidden_layers)
            t5_net = t5_net.clone(unroll=t5_net.config.num_layers)
            transformer = transformer.clone(unroll=max(transformer.config.num_layers,
                                                       transformer.config.num_single_layers))
        length = model.nets.max_sequence_length
        found = [("text_encoder", ("text_encoder",), jax.jit(
                     lambda p, i: clip_net.apply({"params": p}, i).pooled).lower(
                     placed("text_encoder"), make((b, model.nets.tokenizer.model_max_length), jnp.int32))),
                 ("text_encoder", ("text_encoder_2",), jax.jit(
                     lambda p, i: t5_net.apply({"params": p}, i)).lower(
                     placed("text_encoder_2"), make((b, length), jnp.int32)))]
        channels, rows, cols = model.latent_shape(width, height)
        tokens = (rows // 2) * (cols // 2)
        config = transformer.config
        image_ids = flux_net.latent_image_ids(rows // 2, cols // 2)
        txt_ids = flux_net.text_ids(length)
        embedded = config.guidance_embeds

        def call(p, x, context, pooled, t, guidance):
            with seam():
                return transformer.apply({"params": p}, x, context, pooled, t, np.asarray(image_ids),
                                         np.asarray(txt_ids), guidance=guidance if embedded else None)

        found.append(("denoiser", ("transformer",), jax.jit(call).lower(
            placed("transformer"), make((b, tokens, config.in_channels), jnp.float32),
            make((b, length, config.joint_attention_dim), model.dtype),
            make((b, config.pooled_projection_dim), model.dtype), make((b,), jnp.float32),
            make((b,), jnp.float32))))

        def decode(p, z):
            with seam():
                return vae_net.vae_decode(model.nets.vae, p, z, model.nets.vae.config)

        found.append(("vae_decode", ("vae",), jax.jit(decode).lower(
            placed("vae"), make((b, channels, rows, cols), jnp.float32))))
        return found


FLUX = Flux()
