"""Two scratch model families that live in the tests, not in the package: a trivial denoiser
over promptmill's shared layers (the attention seam, flow-matching Euler's sigmas, the
built-in models' mechanism), registered from outside the package through
``PROMPTMILL_FAMILIES=tests.scratch_family:SCRATCH,tests.scratch_family:GUIDED``. They
prove the family seam: with no file of the package edited, ``--model scratch-tiny`` plans,
generates on several hosts and collects like any family's model, and the guided one
(``--model scratch-guided-tiny``) brings a guidance rule of its own (``HALF``: no built-in
family has it) and default steps of its own. Their images are noise.

The checkpoint is a diffusers-style folder (``model_index.json`` naming
``ScratchPipeline``, ``denoiser/config.json``, ``scheduler/scheduler_config.json``) with
no weights file: its weights are drawn from a seed at load, leaf by leaf, as the built-in
models' are.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os

from pipeline.model.families.base import Described, Family, Model
from pipeline.model.loading import builtin
from pipeline.model.loading.checkpoint import ModelError, read_json_file
from pipeline.model.sampling import decoding
from pipeline.model.sampling.guidance import Rule

PIPELINE = "ScratchPipeline"
GUIDED_PIPELINE = "GuidedScratchPipeline"
PRESETS = {"scratch-tiny": dict(version="scratch-tiny-v1", channels=4, width=16, heads=2, tokens=12,
                                sample_size=32, vae_scale=4)}
GUIDED_PRESETS = {"scratch-guided-tiny": dict(PRESETS["scratch-tiny"], version="scratch-guided-tiny-v1",
                                              pipeline=GUIDED_PIPELINE)}
GUIDED_STEPS = 3  # the guided family's default steps (no built-in family's)
SEED = 5


def _build(directory: str, name: str) -> None:
    preset = {**PRESETS, **GUIDED_PRESETS}[name]
    os.makedirs(os.path.join(directory, "denoiser"))
    os.makedirs(os.path.join(directory, "scheduler"))
    with open(os.path.join(directory, "model_index.json"), "w") as f:
        json.dump({"_class_name": preset.get("pipeline", PIPELINE), "denoiser": ["scratch", "Denoiser"],
                   "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}, f)
    with open(os.path.join(directory, "denoiser", "config.json"), "w") as f:
        json.dump({key: preset[key] for key in ("channels", "width", "heads", "tokens", "sample_size", "vae_scale")},
                  f)
    with open(os.path.join(directory, "scheduler", "scheduler_config.json"), "w") as f:
        json.dump({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0}, f)


def _shapes(config: dict) -> dict:
    c, w = config["channels"], config["width"]
    return {"embed": {"embedding": (256, w)}, "proj_in": {"kernel": (c, w), "bias": (w,)},
            "qkv": {"kernel": (w, 3 * w)}, "proj_out": {"kernel": (w, c), "bias": (c,)},
            "to_rgb": {"kernel": (c, 3), "bias": (3,)}}


def _decode(p, latents, f: int):
    """Images [B, H, W, 3] in [0, 1]: a 1x1 projection to RGB, a sigmoid, nearest upsampling by ``f``."""
    import jax.numpy as jnp

    x = jnp.transpose(latents, (0, 2, 3, 1)) @ p["to_rgb"]["kernel"] + p["to_rgb"]["bias"]
    return jnp.repeat(jnp.repeat(1.0 / (1.0 + jnp.exp(-x)), f, axis=1), f, axis=2)


class Scratch(Family):
    name, title = "scratch", "Scratch (a test family)"
    pipeline_classes = (PIPELINE,)
    cfg = False

    presets = PRESETS

    def builtins(self) -> dict:
        return dict(self.presets)

    def ensure_builtin(self, name: str, shapes: bool = False) -> str:
        return builtin.ensure(self.presets[name]["version"], lambda folder, weights: _build(folder, name),
                              shapes=shapes)

    def guidance_rule(self, model: Model) -> str:
        return "unused"

    def components(self, index: dict) -> tuple[str, ...]:
        return ("denoiser", "scheduler")

    def weight_libraries(self, index: dict) -> dict[str, str]:
        return {}  # no weights file: drawn from a seed at load

    def describe(self, directory, request, unet_file) -> Described:
        if request.scheduler not in (None, "flow_euler") or request.timestep_spacing or request.max_sequence_length \
                or unet_file:
            raise ModelError(f"{self.title} takes flow_euler and none of --timestep-spacing, --max-sequence-length, "
                             f"--unet")
        config = read_json_file(os.path.join(directory, "denoiser", "config.json"))
        return self._described(config)

    def _described(self, config: dict) -> Described:
        return Described(family=self.name, native_size=config["sample_size"], scheduler="flow_euler",
                         size_multiple=config["vae_scale"], default_guidance=0.0, guidance_rule="unused", cfg=False)

    def load(self, directory, request, unet_file, loras, abstract) -> Model:
        import jax
        import jax.numpy as jnp

        if loras:
            raise ModelError(f"{self.title} takes no LoRA")
        config = read_json_file(os.path.join(directory, "denoiser", "config.json"))
        structs = jax.tree_util.tree_map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32), _shapes(config),
                                         is_leaf=lambda x: isinstance(x, tuple))
        params = {"denoiser": structs if abstract else builtin.random_params(structs, SEED)}
        return Model(path=request.model, fingerprint=None, family=self, nets=config, sampler=None, params=params,
                     dtype=getattr(jnp, request.jax_dtype), latent_channels=config["channels"],
                     vae_scale_factor=config["vae_scale"], native_size=config["sample_size"])

    def lora_shapes(self, directory: str) -> dict:
        return {}

    def tokenize(self, model: Model, texts):
        """The UTF-8 bytes of each text, cut or padded (with 0) to the configured length."""
        import numpy as np

        length = model.nets["tokens"]
        rows = [list(text.encode("utf-8")[:length]) for text in texts]
        return np.array([row + [0] * (length - len(row)) for row in rows], np.int32)

    def truncated(self, model: Model, texts) -> list[bool]:
        return [len(text.encode("utf-8")) > model.nets["tokens"] for text in texts]

    def make_denoise(self, model: Model, steps: int, empty_negative_ids=None, *, return_latents: bool = False,
                     guidance_rule: str = "unused", guided: bool = False, seam=contextlib.nullcontext,
                     decode=decoding.whole):
        import jax.numpy as jnp
        import numpy as np

        from pipeline.model.layers import attention
        from pipeline.model.sampling import guidance as guidance_rules

        sigmas = np.append(np.linspace(1.0, 1.0 / steps, steps), 0.0).astype(np.float32)
        heads = model.nets["heads"]

        def velocity(p, tokens, text, sigma):
            batch, count, _ = tokens.shape
            h = tokens @ p["proj_in"]["kernel"] + p["proj_in"]["bias"] + text[:, None, :] * (1.0 - sigma)
            q, k, v = jnp.split(h @ p["qkv"]["kernel"], 3, axis=-1)
            split = lambda x: x.reshape(batch, count, heads, -1)  # noqa: E731
            mixed = attention.compute("scratch", split(q), split(k), split(v), (h.shape[-1] // heads) ** -0.5)
            return jnp.tanh(mixed.reshape(batch, count, -1)) @ p["proj_out"]["kernel"] + p["proj_out"]["bias"]

        rule = guidance_rules.rule(guidance_rule)

        def denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys=None):
            with seam():
                p = params["denoiser"]
                ids = jnp.concatenate([negative_ids, prompt_ids]) if guided else prompt_ids
                text = p["embed"]["embedding"][ids].mean(axis=1)
                batch, channels, h, w = latents.shape
                tokens = jnp.transpose(latents, (0, 2, 3, 1)).reshape(batch, h * w, channels)
                for i in range(steps):
                    if guided:  # the rule combines the predictions on [negative; prompt]
                        both = velocity(p, jnp.concatenate([tokens, tokens]), text, sigmas[i])
                        v = rule.combine(both, jnp.asarray(guidance, jnp.float32).reshape(batch, 1, 1))
                    else:
                        v = velocity(p, tokens, text, sigmas[i])
                    tokens = tokens + (sigmas[i + 1] - sigmas[i]) * v
                final = jnp.transpose(tokens.reshape(batch, h, w, channels), (0, 3, 1, 2))
                images = decode(lambda z: _decode(p, z, model.vae_scale_factor), final)  # the run's micro-batches
            return (images, final) if return_latents else images

        return denoise

    def decode_latents(self, model: Model, vae_params, latents):
        return _decode(vae_params["denoiser"], latents, model.vae_scale_factor)

    def latents_note(self, model: Model) -> dict:
        return {"decode": "the scratch family's own: a 1x1 projection to RGB, a sigmoid, nearest upsampling"}

    def parts(self, model, width, height, per_device_batch, guided, *, seam=contextlib.nullcontext, sharding=None,
              count=False):
        return []


SCRATCH = Scratch()


@dataclasses.dataclass(frozen=True)
class HalfRule(Rule):
    """The guided scratch family's rule: above 2, prompt + g/2 x (prompt - negative); at 2 or
    below, the prompt alone."""

    def combine(self, prediction, scale):
        import jax.numpy as jnp

        uncond, cond = jnp.split(prediction, 2)
        return jnp.where(scale > self.above, cond + 0.5 * scale * (cond - uncond), cond)


HALF = HalfRule("scratch-half", "the guided scratch family's own: an image whose guidance g is above 2 takes prompt + "
                                "g/2 x (prompt - negative prompt); at 2 or below, the prompt alone", above=2.0)


class GuidedScratch(Scratch):
    """The scratch family with classifier-free guidance by a rule of its own and its own
    default steps."""
    name, title = "scratch-guided", "Scratch, guided (a test family)"
    pipeline_classes = (GUIDED_PIPELINE,)
    cfg = True
    rules = (HALF,)
    presets = GUIDED_PRESETS
    steps_help = f"{GUIDED_STEPS} (the guided scratch family's own)"

    def guidance_rule(self, model: Model) -> str:
        return HALF.name

    def _described(self, config: dict) -> Described:
        return Described(family=self.name, native_size=config["sample_size"], scheduler="flow_euler",
                         size_multiple=config["vae_scale"], default_guidance=1.0, guidance_rule=HALF.name, cfg=True,
                         default_steps=GUIDED_STEPS, max_steps=100)


GUIDED = GuidedScratch()
