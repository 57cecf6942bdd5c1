"""FLUX.2 [klein]: guidance-distilled rectified-flow transformer, in promptmill's own Flax networks.

A diffusers ``Flux2KleinPipeline`` checkpoint: a Qwen3 causal LM (``text_encoder``,
``pipeline.model.layers.qwen3``: hidden states 9, 18, 27, stacked), its tokenizer
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
  positive prediction by selection (the "diffusers" rule, ``guidance.combine``).

Weights are PyTorch safetensors converted
once per machine (``weights.converted``); the text encoder's layers past the deepest
hidden state read (27) are never read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

from pipeline.model.families.base import Described, Family, Model
from pipeline.model.families.flux2 import presets, sampling as flux2_sampling
from pipeline.model.loading import convert, lora, weights
from pipeline.model.loading.checkpoint import ModelError, license_of
from pipeline.model.sampling import decoding
from pipeline.model.sampling.scheduler import Sampler

COMPONENTS = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")
LIBRARIES = {"text_encoder": "transformers", "transformer": "diffusers", "vae": "diffusers"}
GUIDANCE = 0.0  # a distilled klein takes none (its authors pass 1.0, unused): recorded 0, as FLUX.1 [schnell]
BASE_GUIDANCE = 4.0  # Flux2KleinPipeline's default guidance_scale, for the base models
# default steps: BFL's fixed 4 for the distilled models (Flux2KleinPipeline's default is 50,
# the base models' setting, which a distilled model does not need), 50 for the base ones
STEPS, BASE_STEPS = 4, 50
SAMPLER = "flow_euler"
NOT_YET = {"Flux2Pipeline": "FLUX.2 [dev] (Flux2Pipeline, with a Mistral text encoder) is not run by promptmill yet; "
                            "of FLUX.2 it runs [klein] (Flux2KleinPipeline)"}


class Flux2(Family):
    name, title = "flux2", "FLUX.2 [klein]"
    pipeline_classes = ("Flux2KleinPipeline",)
    not_yet = NOT_YET
    size_rule = "twice the VAE's scale factor (2x2 patches): 16, or 4 for the built-in tiny models"
    steps_help = f"{STEPS}, its base models {BASE_STEPS}"
    guidance_help = (f"[klein] (distilled): none, a guidance scale given is unused; [klein] base: classifier-free "
                     f"guidance above 1 (default {BASE_GUIDANCE:g})")
    sequence_help = (f"Qwen3 tokens of the chat-formatted prompt, at most {flux2_sampling.MAX_SEQUENCE_LENGTH} "
                     f"(default {flux2_sampling.MAX_SEQUENCE_LENGTH}, as Flux2KleinPipeline)")

    def builtins(self) -> dict:
        return dict(presets.PRESETS)

    def ensure_builtin(self, name: str, shapes: bool = False) -> str:
        return presets.ensure(name, shapes)

    def guidance_rule(self, model: Model) -> str:
        return "unused" if model.nets.distilled else "diffusers"

    def classifier_free(self, model: Model) -> bool:
        return not model.nets.distilled

    def components(self, index: dict) -> tuple[str, ...]:
        return COMPONENTS

    def weight_libraries(self, index: dict) -> dict[str, str]:
        return dict(LIBRARIES)

    def _nets(self, directory: str, dtype=None) -> flux2_sampling.Flux2Nets:
        try:
            return flux2_sampling.read_nets(directory, dtype)
        except ValueError as e:
            raise ModelError(str(e)) from None

    def describe(self, directory, request, unet_file) -> Described:
        if unet_file is not None:
            raise ModelError("--unet replaces a UNet's weights; FLUX.2 has a transformer, not a UNet")
        if request.scheduler not in (None, SAMPLER):
            raise ModelError(f"--scheduler {request.scheduler}: FLUX.2 [klein] samples with flow-matching Euler "
                             f"(FlowMatchEulerDiscreteScheduler), --scheduler {SAMPLER}")
        if request.timestep_spacing is not None:
            raise ModelError(f"--timestep-spacing {request.timestep_spacing}: FLUX.2's flow-matching sigmas are "
                             f"linspace(1, 1/N, N), shifted by its empirical mu; there is no spacing to set")
        nets = self._nets(directory)
        maximum = flux2_sampling.MAX_SEQUENCE_LENGTH
        length = maximum if request.max_sequence_length is None else request.max_sequence_length
        if not 1 <= length <= maximum:
            raise ModelError(f"--max-sequence-length must be from 1 to {maximum} (Qwen3 tokens, as "
                             f"Flux2KleinPipeline allows), got {request.max_sequence_length}")
        if request.steps is not None:
            try:
                flux2_sampling.make_schedule(nets.scheduler_config, request.steps, 1)
            except ValueError as e:
                raise ModelError(f"{directory}: {e}") from None
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
                     latent_channels=nets.latent_channels, vae_scale_factor=2 * nets.vae_scale_factor,
                     native_size=described.native_size, param_dtype=jdtype, default_steps=described.default_steps)

    @staticmethod
    def _flat_shapes(nets: flux2_sampling.Flux2Nets) -> dict:
        from pipeline.model.families.flux2 import transformer as flux2_net
        from pipeline.model.layers import qwen3, vae as vae_net

        return {"text_encoder": qwen3.param_shapes(nets.qwen3, nets.text_layers),
                "transformer": flux2_net.param_shapes(nets.transformer.config),
                "vae": vae_net.param_shapes(nets.vae.config)}

    def _params(self, directory: str, nets: flux2_sampling.Flux2Nets) -> dict:
        from pipeline.model.families.flux2 import transformer as flux2_net
        from pipeline.model.layers import qwen3, vae as vae_net

        rules = {"text_encoder": lambda state, where: qwen3.from_torch(state, nets.qwen3, where, nets.text_layers),
                 "transformer": lambda state, where: flux2_net.from_torch(state, nets.transformer.config, where),
                 "vae": lambda state, where: vae_net.from_torch(state, nets.vae.config, where)}
        return weights.converted_components(directory, rules, LIBRARIES, "FLUX.2")

    def lora_layouts(self) -> dict:
        from pipeline.model.families.flux2 import transformer as flux2_net

        return {"transformer": flux2_net.LAYOUT}

    def lora_shapes(self, directory: str) -> dict:
        """The transformer's layers: diffusers' Flux2LoraLoaderMixin loads LoRAs into it alone."""
        return {"transformer": self._flat_shapes(self._nets(directory))["transformer"]}

    # ---- prompts

    def tokenize(self, model: Model, texts):
        """int32 [N, 2L]: each chat-formatted text's Qwen3 ids, then its attention mask."""
        import numpy as np

        ids, mask = flux2_sampling.tokenize(model.nets.tokenizer, list(texts), model.nets.max_sequence_length)
        return np.concatenate([ids, mask], axis=1).astype(np.int32)

    def truncated(self, model: Model, texts) -> list[bool]:
        return flux2_sampling.truncated(model.nets.tokenizer, list(texts), model.nets.max_sequence_length)

    # ---- sampling

    def make_denoise(self, model: Model, steps: int, empty_negative_ids=None, *,
                     return_latents: bool = False, guidance_rule: str = "unused", guided: bool = False,
                     seam=contextlib.nullcontext, decode=decoding.whole):
        """``denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None)``:
        ``flux2_sampling.make_denoise`` on the ids and masks ``tokenize`` made. A distilled
        model's program never reads negative ids or guidance; a base model's ``guided``
        program reads both (``guidance_rule`` "diffusers"). Image keys are never
        read (the sampler is deterministic)."""
        nets, f = model.nets, model.vae_scale_factor
        allowed = ("unused",) if nets.distilled else ("diffusers",)
        if guidance_rule not in allowed:
            raise ValueError(f"guidance_rule {guidance_rule!r}: a {'distilled' if nets.distilled else 'base'} "
                             f"FLUX.2 [klein] takes {' or '.join(allowed)}")
        if guided and nets.distilled:
            raise ValueError("a distilled FLUX.2 [klein] has no classifier-free guidance: its program is never the "
                             "guided one")

        def denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None):
            length = prompt_ids.shape[1] // 2
            inner = flux2_sampling.make_denoise(nets, steps, latents.shape[3] * f, latents.shape[2] * f,
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
        return {"latents": ("final latents of each image, 2x2-patched and unpacked [4C, H/2f, W/2f]: the flow's "
                            "output after the last step, before the VAE's batch-norm un-normalisation; "
                            "unpatchify(latents * sqrt(bn.running_var + batch_norm_eps) + bn.running_mean) "
                            "decoded gives the image. Row = position, as in zarr/images."),
                "vae_batch_norm_eps": float(model.nets.vae.config.batch_norm_eps)}

    # ---- parts

    def parts(self, model: Model, width: int, height: int, per_device_batch: int, guided: bool, *,
              seam=contextlib.nullcontext, sharding=None, count: bool = False):
        """Qwen3 (its hidden states stacked) on B prompts, one transformer call on B images,
        the VAE decode."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from pipeline.model.families import shapes
        from pipeline.model.families.flux2 import transformer as flux2_net
        from pipeline.model.layers import vae as vae_net

        nets = model.nets
        b = per_device_batch * (2 if guided else 1)  # through Qwen3 and the transformer: [negative; positive]
        make = shapes.on(sharding)

        def placed(component):
            return shapes.params(model.params[component], sharding, model.param_dtype)

        transformer = nets.transformer
        if count:
            transformer = transformer.clone(unroll=max(transformer.config.num_layers,
                                                       transformer.config.num_single_layers))
        length = nets.max_sequence_length
        found = [("text_encoder", ("text_encoder",), jax.jit(
            lambda p, i, m: flux2_sampling.stacked_states(nets, p, i, m, nets.text_layers if count else 1)).lower(
            placed("text_encoder"), make((b, length), jnp.int32), make((b, length), jnp.int32)))]
        channels, rows, cols = model.latent_shape(width, height)
        config = transformer.config
        image_ids, txt_ids = flux2_net.latent_image_ids(rows, cols), flux2_net.text_ids(length)

        def call(p, x, context, t):
            with seam():
                return transformer.apply({"params": p}, x, context, t, np.asarray(image_ids), np.asarray(txt_ids))

        found.append(("denoiser", ("transformer",), jax.jit(call).lower(
            placed("transformer"), make((b, rows * cols, config.in_channels), jnp.float32),
            make((b, length, config.joint_attention_dim), model.dtype), make((b,), jnp.float32))))

        def decode(p, z):
            with seam():
                return vae_net.vae_decode(nets.vae, p, z, nets.vae.config)

        found.append(("vae_decode", ("vae",), jax.jit(decode).lower(  # the images alone, guided or not
            placed("vae"), make((per_device_batch, channels, rows, cols), jnp.float32))))
        return found


FLUX2 = Flux2()
