"""What the Qwen-text transformer families share (FLUX.2 [klein], Z-Image): a diffusers
checkpoint of a Qwen3 text encoder with its chat-template tokenizer, a transformer, a VAE
and flow-matching Euler. Written here once:

- ``QwenTextNets``: the networks, in one dtype, and the scheduler config;
- ``read_configs``: the four configs, each refused by name where it asks for what the
  networks do not do;
- ``TextFlow``: the sampling loop, as the families' diffusers pipelines run it (the text
  encoder's states; the transformer on [negative; positive] when guided, its predictions
  combined by the run's guidance rule; flow-matching Euler steps over the packed latents;
  the VAE decode). A family's sampling module subclasses it with what is its own: which
  hidden states the transformer reads, how it is called, how latents become tokens;
- ``QwenTextFamily``: the plumbing of the family object (components, loading, weights,
  LoRA, tokenising, the lowered parts).

Each family names its own transformer module, sampling (its ``TextFlow``), presets and
guidance, and says what differs in ``describe``. A family's folder imports this module;
it is no family of its own (``families.BUILTIN``)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

from pipeline.model.families.base import PATCHED_SIZE_RULE, Family, Model, TransformerNets
from pipeline.model.loading import weights
from pipeline.model.loading.checkpoint import ModelError, read_json_file
from pipeline.model.sampling import decoding, flow
from pipeline.model.sampling.samplers import Sampler

COMPONENTS = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")
LIBRARIES = {"text_encoder": "transformers", "transformer": "diffusers", "vae": "diffusers"}
SAMPLER = "flow_euler"


@dataclasses.dataclass(frozen=True, kw_only=True)
class QwenTextNets(TransformerNets):
    """The networks of a Qwen-text checkpoint: its Qwen3 text encoder's config (the encoder runs
    from it, ``qwen3.hidden_states``) and its compute dtype besides the transformer's; a
    family's subclass says which text encoder layers it runs (``text_layers``)."""
    qwen3: Any  # qwen3.Qwen3Config
    dtype: Any = None

    @property
    def latent_channels(self) -> int:
        """The channels of the initial latents as drawn: the transformer's input."""
        return self.transformer.config.in_channels


def read_configs(directory: str, transformer_config) -> tuple:
    """(scheduler config, Qwen3 config, transformer config, VAE config) of the checkpoint in
    ``directory`` (``transformer_config``: the family's config class, with ``from_dict``);
    ValueError naming a config it would not honour."""
    from pipeline.model.layers import vae
    from pipeline.model.layers.text import qwen3

    scheduler_config = read_json_file(os.path.join(directory, "scheduler", "scheduler_config.json"))
    refused = flow.unsupported(scheduler_config)
    if refused:
        raise ValueError(f"{directory}: scheduler/scheduler_config.json asks for "
                         + "; ".join(f"{k}={v!r}" for k, v in refused) + ", which flow-matching Euler does not do")
    try:
        q_cfg = qwen3.Qwen3Config.from_dict(read_json_file(os.path.join(directory, "text_encoder", "config.json")))
        t_cfg = transformer_config.from_dict(read_json_file(os.path.join(directory, "transformer", "config.json")))
        v_cfg = vae.VaeConfig.from_dict(read_json_file(os.path.join(directory, "vae", "config.json")))
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    return scheduler_config, q_cfg, t_cfg, v_cfg


class TextFlow:
    """A Qwen-text family's sampling in JAX, one fixed-shape program per run: ``sample`` and
    ``make_denoise`` are the loop every such family runs; a subclass (one per family, in its
    sampling module) gives what is its own:

    - ``prompts`` (its ``chat.ChatPrompts``) and ``latent_factor`` (2 where the initial
      latents are drawn 2x2-patched, [4C, H/2f, W/2f]; 1 where drawn [C, H/f, W/f] and
      patched by the transformer);
    - ``transformer()``: its transformer, as (its ``convert.Network``, its config class),
      imported when asked (it needs jax); ``nets_class``: its ``QwenTextNets``;
      ``check_configs(...)``: what its networks must agree on (``read_nets``);
    - ``make_schedule(config, steps, image_tokens)``: its flow-matching schedule, and
      ``sigmas_note``: what its sigmas are, for a refused ``--timestep-spacing``;
    - ``text_states(nets, text_params, input_ids, attention_mask, unroll)``: what its
      transformer reads of the text encoder (an array, or a tuple of them);
    - ``condition(...)``: those states and what else the transformer takes of the batch
      (by default the states alone), made once before the loop;
    - ``model_times(timesteps)``: the transformer's timestep of each step;
    - ``predict(nets, params, x, condition, t, grid)``: one transformer call on the packed
      latents ``x`` at times ``t``; ``velocity(prediction)``: the flow's velocity from the
      (combined) prediction, by default the prediction itself;
    - ``pack(latents)`` and ``unpack(tokens, rows, cols)``: latents to tokens and back;
    - ``check(nets, grid, guided)``: refuses what its networks cannot run."""
    prompts = None
    latent_factor = 1
    nets_class = QwenTextNets
    sigmas_note = ""

    @property
    def max_sequence_length(self) -> int:
        return self.prompts.most

    def transformer(self) -> tuple:
        raise NotImplementedError

    def check_configs(self, directory: str, qwen3_config, transformer_config, vae_config) -> dict:
        """ValueError, naming ``directory``, when the configs do not fit together as the
        family's pipeline needs; else the family's own fields of its nets ({} by default)."""
        return {}

    def read_nets(self, directory: str, dtype=None):
        """The networks of the family's diffusers-format checkpoint in ``directory``, computing in
        ``dtype`` (default float32), from its configs alone; ValueError naming a config it would
        not honour."""
        import jax.numpy as jnp

        from pipeline.model.layers import vae

        network, config_class = self.transformer()
        scheduler_config, q_cfg, t_cfg, v_cfg = read_configs(directory, config_class)
        own = self.check_configs(directory, q_cfg, t_cfg, v_cfg)
        dtype = jnp.float32 if dtype is None else dtype
        return self.nets_class(qwen3=q_cfg, transformer=network.module(t_cfg, dtype), vae=vae.VaeDecoder(v_cfg, dtype),
                               scheduler_config=scheduler_config, dtype=dtype, **own)

    def make_schedule(self, config, steps: int, image_tokens: int) -> flow.FlowSchedule:
        return flow.make_schedule(config, steps, image_tokens)

    def text_states(self, nets, text_params, input_ids, attention_mask, unroll: int = 1):
        raise NotImplementedError

    def condition(self, nets, text_params, input_ids, attention_mask, grid, *, unroll: int = 1):
        return self.text_states(nets, text_params, input_ids, attention_mask, unroll)

    def model_times(self, timesteps):
        raise NotImplementedError

    def predict(self, nets, params, x, condition, t, grid):
        raise NotImplementedError

    def velocity(self, prediction):
        return prediction

    def pack(self, latents):
        raise NotImplementedError

    def unpack(self, tokens, rows: int, cols: int):
        raise NotImplementedError

    def check(self, nets, grid: tuple[int, int], guided: bool) -> None:
        """ValueError for a grid (rows, cols of the latents as drawn) or a program the
        networks cannot run."""

    def sample(self, nets, params, input_ids, attention_mask, latents, *, sigmas, timesteps, negative=None,
               scale=None, rule: str = "diffusers", unroll: int = 1, decode=decoding.whole):
        """float32 images [B, H, W, 3] in [0, 1] and the final latents (as drawn, before the
        VAE's own un-normalisation) from initial latents, over a schedule given as arrays.

        ``negative`` (the guided program): (input_ids, attention_mask) of each image's
        negative prompt; the transformer then runs on [negative; positive] (one call of 2B
        rows: a row's result does not depend on the others) and each image's prediction is
        ``guidance.rule(rule).combine`` of the two with its ``scale`` [B]. ``unroll``: the
        text encoder's layers per loop step. ``decode(decode_fn, latents)`` runs the VAE
        decode (``pipeline.model.sampling.decoding``: whole, or in micro-batches)."""
        import jax
        import jax.numpy as jnp

        from pipeline.model.layers import vae
        from pipeline.model.sampling import guidance

        batch, _, rows, cols = latents.shape
        if negative is not None:
            input_ids = jnp.concatenate([negative[0], input_ids])
            attention_mask = jnp.concatenate([negative[1], attention_mask])
            scale = jnp.asarray(scale, jnp.float32).reshape(batch, 1, 1)
        condition = self.condition(nets, params["text_encoder"], input_ids, attention_mask, (rows, cols),
                                   unroll=unroll)
        sigmas, times = jnp.asarray(sigmas, jnp.float32), self.model_times(timesteps)

        def step(i, x):
            model_input = x if negative is None else jnp.concatenate([x, x])
            t = jnp.broadcast_to(times[i], (model_input.shape[0],))
            prediction = self.predict(nets, params["transformer"], model_input, condition, t,
                                      (rows, cols)).astype(jnp.float32)
            if negative is not None:
                prediction = guidance.rule(rule).combine(prediction, scale)
            return flow.step(x, self.velocity(prediction), sigmas[i], sigmas[i + 1])

        tokens = jax.lax.fori_loop(0, times.shape[0], step, self.pack(latents.astype(jnp.float32)))
        final = self.unpack(tokens, rows, cols)
        return decode(lambda z: vae.vae_decode(nets.vae, params["vae"], z, nets.vae.config), final), final

    def make_denoise(self, nets, steps: int, width: int, height: int, return_latents: bool = False, *,
                     guided: bool = False, rule: str = "diffusers", decode=decoding.whole):
        """``denoise(params, input_ids, attention_mask, latents, negative=None, scale=None)``:
        float32 images [B, height, width, 3] in [0, 1] (with ``return_latents``, also the final
        latents), jit-able; latents float32 [B, C, rows, cols] as the family's pipeline draws
        them (``latent_factor``). ``guided``: the program reads ``negative`` (ids, mask) and
        ``scale`` [B] (``sample``); the other reads neither. The schedule is made here, on the
        host, for the image's (height/2f)(width/2f) tokens. ``decode``: see ``sample``."""
        f = 2 * nets.vae_scale_factor
        if height % f or width % f:
            raise ValueError(f"height and width must be multiples of {f} (twice the VAE's scale factor, for the 2x2 "
                             f"patches), got {width}x{height}")
        drawn = nets.vae_scale_factor * self.latent_factor
        rows, cols = height // drawn, width // drawn
        self.check(nets, (rows, cols), guided)
        schedule = self.make_schedule(nets.scheduler_config, steps, (height // f) * (width // f))

        def denoise(params, input_ids, attention_mask, latents, negative=None, scale=None):
            if tuple(latents.shape[1:]) != (nets.latent_channels, rows, cols):
                raise ValueError(f"latents have shape {tuple(latents.shape)}, expected [B, {nets.latent_channels}, "
                                 f"{rows}, {cols}] for {width}x{height} images")
            if guided != (negative is not None):
                raise ValueError("the guided program takes the negative prompts and the scales; the other neither")
            images, final = self.sample(nets, params, input_ids, attention_mask, latents, sigmas=schedule.sigmas,
                                        timesteps=schedule.timesteps, negative=negative, scale=scale, rule=rule,
                                        decode=decode)
            return (images, final) if return_latents else images

        return denoise


class QwenTextFamily(Family):
    """The shared plumbing. A subclass sets ``presets`` (its presets module) and ``flow`` (its
    ``TextFlow``), and gives ``deepest_stack`` and ``denoiser_call`` (one transformer call at
    one device's shapes, for ``parts``). Its pipeline (``pipeline_classes[0]``) is named in
    messages."""
    component_folders, libraries = COMPONENTS, LIBRARIES
    size_rule = PATCHED_SIZE_RULE
    flow: TextFlow = None

    @property
    def pipeline_title(self) -> str:
        """The diffusers pipeline the family runs (``Flux2KleinPipeline``), for people."""
        return self.pipeline_classes[0]

    @property
    def sequence_help(self) -> str:
        most = self.flow.max_sequence_length
        return f"Qwen3 tokens of the chat-formatted prompt, at most {most} (default {most}, as {self.pipeline_title})"

    def read_nets(self, directory: str, dtype=None):
        return self.flow.read_nets(directory, dtype)

    def checked_request(self, directory: str, request, unet_file):
        """(the checkpoint's nets, the text length) once the request's sampler settings are
        ones this family takes; ModelError naming what it does not."""
        if unet_file is not None:
            raise ModelError(f"--unet replaces a UNet's weights; {self.title} has a transformer, not a UNet")
        if request.scheduler not in (None, SAMPLER):
            raise ModelError(f"--scheduler {request.scheduler}: {self.title} samples with flow-matching Euler "
                             f"(FlowMatchEulerDiscreteScheduler), --scheduler {SAMPLER}")
        if request.timestep_spacing is not None:
            raise ModelError(f"--timestep-spacing {request.timestep_spacing}: {self.flow.sigmas_note}; there is no "
                             f"spacing to set")
        nets = self.nets_of(directory)
        maximum = self.flow.max_sequence_length
        length = maximum if request.max_sequence_length is None else request.max_sequence_length
        if not 1 <= length <= maximum:
            raise ModelError(f"--max-sequence-length must be from 1 to {maximum} (Qwen3 tokens, as "
                             f"{self.pipeline_title} allows), got {request.max_sequence_length}")
        self.check_length(directory, nets, length)
        if request.steps is not None:
            try:
                self.flow.make_schedule(nets.scheduler_config, request.steps, 1)
            except ValueError as e:
                raise ModelError(f"{directory}: {e}") from None
        return nets, length

    def check_length(self, directory: str, nets, length: int) -> None:
        """ModelError when the transformer cannot take captions of ``length`` tokens."""

    def load(self, directory, request, unet_file, loras, abstract) -> Model:
        import jax.numpy as jnp

        from pipeline.model.loading import qwen_tokenizer, tokenizer as tokenizer_lib

        described = self.describe(directory, dataclasses.replace(request, steps=None), unet_file)
        jdtype = getattr(jnp, request.jax_dtype)
        nets = self.nets_of(directory, jdtype)
        try:
            tokenizer = qwen_tokenizer.load(os.path.join(directory, "tokenizer"))
        except tokenizer_lib.TokenizerError as e:
            raise ModelError(str(e)) from None
        params = self.loaded_params(directory, nets, loras, abstract, jdtype)
        nets = dataclasses.replace(nets, tokenizer=tokenizer, max_sequence_length=described.max_sequence_length)
        return Model(path=request.model, fingerprint=None, family=self, nets=nets,
                     sampler=Sampler(SAMPLER, nets.scheduler_config, "flow"), params=params, dtype=jdtype,
                     latent_channels=nets.latent_channels,
                     vae_scale_factor=self.flow.latent_factor * nets.vae_scale_factor,
                     native_size=described.native_size, param_dtype=jdtype, default_steps=described.default_steps)

    def _flat_shapes(self, nets) -> dict:
        from pipeline.model.layers import vae
        from pipeline.model.layers.text import qwen3

        return {"text_encoder": qwen3.param_shapes(nets.qwen3, nets.text_layers),
                "transformer": self.flow.transformer()[0].param_shapes(nets.transformer.config),
                "vae": vae.NETWORK.param_shapes(nets.vae.config)}

    def _params(self, directory: str, nets) -> dict:
        from pipeline.model.layers import vae
        from pipeline.model.layers.text import qwen3

        network, _ = self.flow.transformer()
        rules = {"text_encoder": lambda state, where: qwen3.from_torch(state, nets.qwen3, where, nets.text_layers),
                 "transformer": lambda state, where: network.from_torch(state, nets.transformer.config, where),
                 "vae": lambda state, where: vae.NETWORK.from_torch(state, nets.vae.config, where)}
        return weights.converted_components(directory, rules, LIBRARIES, self.title)

    def lora_torch_names(self) -> dict:
        return {"transformer": self.flow.transformer()[0].torch_names}

    def lora_shapes(self, directory: str) -> dict:
        """The transformer's layers: diffusers' LoRA loader of these pipelines loads into it alone."""
        return {"transformer": self._flat_shapes(self.nets_of(directory))["transformer"]}

    # ---- prompts

    def tokenize(self, model: Model, texts):
        """int32 [N, 2L]: each chat-formatted text's Qwen3 ids, then its attention mask."""
        import numpy as np

        ids, mask = self.flow.prompts.tokenize(model.nets.tokenizer, list(texts), model.nets.max_sequence_length)
        return np.concatenate([ids, mask], axis=1).astype(np.int32)

    def truncated(self, model: Model, texts) -> list[bool]:
        return self.flow.prompts.truncated(model.nets.tokenizer, list(texts), model.nets.max_sequence_length)

    # ---- sampling

    def make_denoise(self, model: Model, steps: int, empty_negative_ids=None, *,
                     return_latents: bool = False, guidance_rule: str | None = None, guided: bool | None = None,
                     seam=contextlib.nullcontext, decode=decoding.whole):
        """``denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None)``:
        the flow's ``make_denoise`` on the ids and masks ``tokenize`` made, under the model's
        own guidance rule (``guidance_rule``; None: that rule). The ``guided`` program (None:
        whether the model has classifier-free guidance) reads the negative ids and each
        image's guidance, the other neither; a model without classifier-free guidance has
        no guided program. Image keys are never read (the sampler is deterministic)."""
        rule = self.guidance_rule(model)
        guidance_rule = rule if guidance_rule is None else guidance_rule
        guided = self.classifier_free(model) if guided is None else guided
        if guidance_rule != rule:
            raise ValueError(f"guidance_rule {guidance_rule!r}: this {self.title} model guides by {rule!r}")
        if guided and not self.classifier_free(model):
            raise ValueError(f"this {self.title} model has no classifier-free guidance: its program is never the "
                             f"guided one")
        nets, f = model.nets, model.vae_scale_factor

        def denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None):
            length = prompt_ids.shape[1] // 2
            inner = self.flow.make_denoise(nets, steps, latents.shape[3] * f, latents.shape[2] * f,
                                           return_latents, guided=guided, rule=guidance_rule, decode=decode)
            negative = (negative_ids[:, :length], negative_ids[:, length:]) if guided else None
            with seam():
                return inner(params, prompt_ids[:, :length], prompt_ids[:, length:], latents, negative,
                             guidance if guided else None)

        return denoise

    # ---- parts

    def parts(self, model: Model, width: int, height: int, per_device_batch: int, guided: bool, *,
              seam=contextlib.nullcontext, sharding=None, count: bool = False):
        """The text encoder (to the hidden states the transformer reads) on B prompts, one
        transformer call on B images (``denoiser_call``), the VAE decode (B: twice the images
        in a guided program, [negative; positive])."""
        import jax
        import jax.numpy as jnp

        from pipeline.model import shapes

        nets = model.nets
        b = per_device_batch * (2 if guided else 1)
        make = shapes.on(sharding)

        def placed(component):
            return shapes.params(model.params[component], sharding, model.param_dtype)

        transformer = nets.transformer
        if count:
            transformer = transformer.clone(unroll=self.deepest_stack(transformer.config))
        length = nets.max_sequence_length
        found = [("text_encoder", ("text_encoder",), jax.jit(
            lambda p, i, m: self.flow.text_states(nets, p, i, m, nets.text_layers if count else 1)).lower(
            placed("text_encoder"), make((b, length), jnp.int32), make((b, length), jnp.int32)))]
        _, rows, cols = model.latent_shape(width, height)
        call, inputs = self.denoiser_call(model, transformer, (rows, cols), b, make=make, seam=seam)
        found.append(("denoiser", ("transformer",), jax.jit(call).lower(placed("transformer"), *inputs)))
        found.append(self.vae_part(model, per_device_batch, width, height, seam=seam, make=make, placed=placed))
        return found

    def deepest_stack(self, config) -> int:
        """The layers of the transformer's longest scanned stack (``parts`` unrolls them for a
        FLOP count: XLA counts a loop's body once)."""
        raise NotImplementedError

    def denoiser_call(self, model: Model, transformer, grid: tuple[int, int], batch: int, *, make, seam):
        """(``call(params, *inputs)``: one transformer call inside ``seam``, its inputs'
        abstract values made by ``make(shape, dtype)``) of ``batch`` images whose latents, as
        drawn, are ``grid`` (rows, cols)."""
        raise NotImplementedError

    def vae_part(self, model: Model, per_device_batch: int, width: int, height: int, *, seam, make, placed):
        """The VAE decode of ``per_device_batch`` images (``parts``: the images alone, guided or not)."""
        import jax
        import jax.numpy as jnp

        from pipeline.model.layers import vae as vae_net

        nets = model.nets
        channels, rows, cols = model.latent_shape(width, height)

        def decode(p, z):
            with seam():
                return vae_net.vae_decode(nets.vae, p, z, nets.vae.config)

        return ("vae_decode", ("vae",), jax.jit(decode).lower(
            placed("vae"), make((per_device_batch, channels, rows, cols), jnp.float32)))
