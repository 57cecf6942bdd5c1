"""What the Qwen-text transformer families share (FLUX.2 [klein], Z-Image): a diffusers
checkpoint of a Qwen3 text encoder with its chat-template tokenizer, a transformer, a VAE
and flow-matching Euler; each family names its own transformer module, sampling module
(``read_nets``, ``make_schedule``, ``tokenize``, ``truncated``, ``make_denoise``) and
presets, and says what differs in ``describe``.

A family's folder imports this module; it is no family of its own (``families.BUILTIN``)."""
from __future__ import annotations

import contextlib
import dataclasses
import os

from pipeline.model.families.base import Family, Model
from pipeline.model.loading import weights
from pipeline.model.loading import qwen_tokenizer
from pipeline.model.loading.checkpoint import ModelError, read_json_file
from pipeline.model.sampling import decoding, flow
from pipeline.model.sampling.scheduler import Sampler

COMPONENTS = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")
LIBRARIES = {"text_encoder": "transformers", "transformer": "diffusers", "vae": "diffusers"}
SAMPLER = "flow_euler"


@dataclasses.dataclass(frozen=True)
class ChatPrompts:
    """Prompts in a checkpoint's own chat template, as a family's pipeline formats them:
    ``family`` (for messages), ``thinking`` (the pipeline's enable_thinking) and the most
    text tokens it takes (``qwen_tokenizer``)."""
    family: str
    thinking: bool
    most: int

    def format_prompt(self, tokenizer, text: str) -> str:
        return qwen_tokenizer.format_prompt(tokenizer, text, thinking=self.thinking, family=self.family)

    def tokenize(self, tokenizer, prompts, max_sequence_length: int):
        """(input_ids, attention_mask) int32 [B, L]: chat-formatted, padded to and cut at
        ``max_sequence_length`` (1 to ``most``)."""
        return qwen_tokenizer.tokenize(tokenizer, prompts, max_sequence_length, thinking=self.thinking,
                                       family=self.family, most=self.most)

    def truncated(self, tokenizer, prompts, max_length: int) -> list[bool]:
        """Whether each chat-formatted prompt has more tokens than ``max_length``."""
        return qwen_tokenizer.truncated(tokenizer, prompts, max_length, thinking=self.thinking, family=self.family)


def read_configs(directory: str, transformer_config, check=None) -> tuple:
    """(scheduler config, Qwen3 config, transformer config, VAE config) of the checkpoint in
    ``directory`` (``transformer_config``: the family's config class, with ``from_dict``;
    ``check(qwen3 config)``: the family's own check of its text encoder); ValueError naming a
    config it would not honour."""
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
        if check is not None:
            check(q_cfg)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    return scheduler_config, q_cfg, t_cfg, v_cfg


class QwenTextFamily(Family):
    """The shared plumbing. A subclass sets ``presets`` and ``sampling`` (its modules),
    ``pipeline_title`` (the diffusers pipeline, for messages), ``sigmas_note`` (what its
    flow-matching sigmas are), ``latent_factor`` (the model's ``vae_scale_factor`` over the
    VAE's: 2 where initial latents are drawn 2x2-patched) and ``transformer_module`` (a
    function returning its transformer module, imported when asked)."""
    presets = None
    sampling = None
    pipeline_title = ""
    sigmas_note = ""
    latent_factor = 1

    @staticmethod
    def transformer_module():
        raise NotImplementedError

    def builtins(self) -> dict:
        return dict(self.presets.PRESETS)

    def ensure_builtin(self, name: str, shapes: bool = False) -> str:
        return self.presets.ensure(name, shapes)

    def components(self, index: dict) -> tuple[str, ...]:
        return COMPONENTS

    def weight_libraries(self, index: dict) -> dict[str, str]:
        return dict(LIBRARIES)

    def _nets(self, directory: str, dtype=None):
        try:
            return self.sampling.read_nets(directory, dtype)
        except ValueError as e:
            raise ModelError(str(e)) from None

    def checked_request(self, directory: str, request, unet_file):
        """(the checkpoint's nets, the text length) once the request's sampler settings are
        ones this family takes; ModelError naming what it does not."""
        if unet_file is not None:
            raise ModelError(f"--unet replaces a UNet's weights; {self.title} has a transformer, not a UNet")
        if request.scheduler not in (None, SAMPLER):
            raise ModelError(f"--scheduler {request.scheduler}: {self.title} samples with flow-matching Euler "
                             f"(FlowMatchEulerDiscreteScheduler), --scheduler {SAMPLER}")
        if request.timestep_spacing is not None:
            raise ModelError(f"--timestep-spacing {request.timestep_spacing}: {self.sigmas_note}; there is no "
                             f"spacing to set")
        nets = self._nets(directory)
        maximum = self.sampling.MAX_SEQUENCE_LENGTH
        length = maximum if request.max_sequence_length is None else request.max_sequence_length
        if not 1 <= length <= maximum:
            raise ModelError(f"--max-sequence-length must be from 1 to {maximum} (Qwen3 tokens, as "
                             f"{self.pipeline_title} allows), got {request.max_sequence_length}")
        self.check_length(directory, nets, length)
        if request.steps is not None:
            try:
                self.sampling.make_schedule(nets.scheduler_config, request.steps, 1)
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
        nets = self._nets(directory, jdtype)
        try:
            tokenizer = qwen_tokenizer.load(os.path.join(directory, "tokenizer"))
        except tokenizer_lib.TokenizerError as e:
            raise ModelError(str(e)) from None
        params = self.loaded_params(directory, nets, loras, abstract, jdtype)
        nets = dataclasses.replace(nets, tokenizer=tokenizer, max_sequence_length=described.max_sequence_length)
        return Model(path=request.model, fingerprint=None, family=self, nets=nets,
                     sampler=Sampler(SAMPLER, nets.scheduler_config, "flow"), params=params, dtype=jdtype,
                     latent_channels=nets.latent_channels, vae_scale_factor=self.latent_factor * nets.vae_scale_factor,
                     native_size=described.native_size, param_dtype=jdtype, default_steps=described.default_steps)

    def _flat_shapes(self, nets) -> dict:
        from pipeline.model.layers import vae as vae_net
        from pipeline.model.layers.text import qwen3

        return {"text_encoder": qwen3.param_shapes(nets.qwen3, nets.text_layers),
                "transformer": self.transformer_module().param_shapes(nets.transformer.config),
                "vae": vae_net.param_shapes(nets.vae.config)}

    def _params(self, directory: str, nets) -> dict:
        from pipeline.model.layers import vae as vae_net
        from pipeline.model.layers.text import qwen3

        net = self.transformer_module()
        rules = {"text_encoder": lambda state, where: qwen3.from_torch(state, nets.qwen3, where, nets.text_layers),
                 "transformer": lambda state, where: net.from_torch(state, nets.transformer.config, where),
                 "vae": lambda state, where: vae_net.from_torch(state, nets.vae.config, where)}
        return weights.converted_components(directory, rules, LIBRARIES, self.title)

    def lora_layouts(self) -> dict:
        return {"transformer": self.transformer_module().LAYOUT}

    def lora_shapes(self, directory: str) -> dict:
        """The transformer's layers: diffusers' LoRA loader of these pipelines loads into it alone."""
        return {"transformer": self._flat_shapes(self._nets(directory))["transformer"]}

    # ---- prompts

    def tokenize(self, model: Model, texts):
        """int32 [N, 2L]: each chat-formatted text's Qwen3 ids, then its attention mask."""
        import numpy as np

        ids, mask = self.sampling.tokenize(model.nets.tokenizer, list(texts), model.nets.max_sequence_length)
        return np.concatenate([ids, mask], axis=1).astype(np.int32)

    def truncated(self, model: Model, texts) -> list[bool]:
        return self.sampling.truncated(model.nets.tokenizer, list(texts), model.nets.max_sequence_length)

    # ---- sampling

    def denoise_fn(self, model: Model, steps: int, return_latents: bool, guided: bool, guidance_rule: str, *,
                   seam=contextlib.nullcontext, decode=decoding.whole):
        """``denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None)``:
        the sampling module's ``make_denoise`` on the ids and masks ``tokenize`` made; the
        guided program reads the negative ids and each image's guidance, the other neither.
        Image keys are never read (the sampler is deterministic)."""
        nets, f = model.nets, model.vae_scale_factor

        def denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None):
            length = prompt_ids.shape[1] // 2
            inner = self.sampling.make_denoise(nets, steps, latents.shape[3] * f, latents.shape[2] * f,
                                               return_latents, guided=guided, rule=guidance_rule, decode=decode)
            negative = (negative_ids[:, :length], negative_ids[:, length:]) if guided else None
            with seam():
                return inner(params, prompt_ids[:, :length], prompt_ids[:, length:], latents, negative,
                             guidance if guided else None)

        return denoise

    def decode_latents(self, model: Model, vae_params, latents):
        from pipeline.model.layers import vae as vae_net

        return vae_net.vae_decode(model.nets.vae, vae_params, latents, model.nets.vae.config)

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
