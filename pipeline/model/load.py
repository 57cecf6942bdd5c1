"""Loading a diffusers-format Stable Diffusion checkpoint: the narrow model interface.

Every model, ``--model tiny`` included, is a diffusers-format directory found by
``pipeline.model.sources`` and loaded by ``load``, with the sampler the run chose
(``make_scheduler``). The rest of promptmill sees only ``Model``.
"""
from __future__ import annotations

import dataclasses
import json
import os

from pipeline.core.choices import DTYPES, SCHEDULERS
from pipeline.model import weights
from pipeline.model.libraries import quiet_libraries
from pipeline.model.sources import ModelError, check_layout, family, fingerprint, resolve

# checkpoint scheduler class names (with or without the Flax prefix) -> --scheduler choice
_CHECKPOINT_SCHEDULERS = {"DDIMScheduler": "ddim", "PNDMScheduler": "pndm", "EulerDiscreteScheduler": "euler",
                          "DPMSolverMultistepScheduler": "dpmpp"}


@dataclasses.dataclass(frozen=True)
class Model:
    path: str
    fingerprint: str
    tokenizer: object
    text_encoder: object
    unet: object
    vae: object
    scheduler: object
    params: dict  # {"text_encoder", ["text_encoder_2",] "unet", "vae", "scheduler"}
    tokenizer_2: object = None  # SDXL only
    text_encoder_2: object = None  # SDXL only

    @property
    def family(self) -> str:
        return "sdxl" if self.text_encoder_2 is not None else "sd"

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return self.unet.config.in_channels

    @property
    def native_size(self) -> int:
        return self.unet.config.sample_size * self.vae_scale_factor

    @property
    def scheduler_name(self) -> str:
        return type(self.scheduler).__name__.removeprefix("Flax")

    @property
    def dtype(self):
        return self.unet.dtype

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        f = self.vae_scale_factor
        return (self.latent_channels, height // f, width // f)


# Scheduler-config keys that change sampling in diffusers' PyTorch scheduler of each
# sampler, with the values its Flax class, which promptmill runs, honours. The Flax classes
# lack these keys and ``from_config`` drops them without a word, so a checkpoint whose
# config asks for another value would sample otherwise than its config says: it is
# refused, naming the key (``check_scheduler``, at plan time). A missing key means the
# PyTorch class's default, which every Flax class honours.
HONOURED_CONFIG = {
    "ddim": {"timestep_spacing": ("leading",), "rescale_betas_zero_snr": (False,), "thresholding": (False,)},
    "pndm": {"timestep_spacing": ("leading",), "prediction_type": ("epsilon", "v_prediction")},
    "euler": {"timestep_spacing": ("linspace", "leading"), "prediction_type": ("epsilon", "v_prediction"),
              "use_karras_sigmas": (False,), "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,),
              "final_sigmas_type": ("zero",), "interpolation_type": ("linear",), "timestep_type": ("discrete",),
              "rescale_betas_zero_snr": (False,)},
    "dpmpp": {"algorithm_type": ("dpmsolver++",), "solver_order": (2,), "use_karras_sigmas": (False,),
              "use_lu_lambdas": (False,), "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,),
              "final_sigmas_type": ("zero",), "euler_at_final": (False,), "variance_type": (None,),
              "lambda_min_clipped": (float("-inf"),), "rescale_betas_zero_snr": (False,)},
}


def read_scheduler_config(directory: str) -> dict:
    with open(os.path.join(directory, "scheduler", "scheduler_config.json")) as f:
        return json.load(f)


def checkpoint_scheduler(directory: str) -> str:
    """The --scheduler choice that a checkpoint's own scheduler config names."""
    class_name = read_scheduler_config(directory).get("_class_name", "")
    choice = _CHECKPOINT_SCHEDULERS.get(class_name.removeprefix("Flax"))
    if choice is None:
        raise ModelError(f"{directory}: the checkpoint's scheduler {class_name!r} is not supported; pick one with "
                         f"--scheduler {'|'.join(SCHEDULERS)}")
    return choice


def unhonoured(config: dict, choice: str) -> list[tuple[str, object, tuple]]:
    """(key, value, the values the sampler honours) for each key of a scheduler config
    that the ``choice`` sampler would not honour (pure). A config written by a Flax class
    holds Flax keys only, each honoured or irrelevant."""
    if config.get("_class_name", "").startswith("Flax"):
        return []
    problems = [(key, config[key], honoured) for key, honoured in HONOURED_CONFIG[choice].items()
                if key in config and config[key] not in honoured]
    if choice == "euler" and config.get("timestep_spacing", "linspace") == "leading" \
            and config.get("steps_offset", 0) != 1:  # Flax Euler's leading spacing adds 1, PyTorch's steps_offset
        problems.append(("steps_offset", config.get("steps_offset", 0), (1,)))
    return problems


def check_scheduler(directory: str, choice: str | None) -> str:
    """The sampler a run with ``--scheduler choice`` (None: the checkpoint's own) uses;
    ModelError naming each key and value of the checkpoint's scheduler config it would not
    honour."""
    choice = choice or checkpoint_scheduler(directory)
    if choice not in SCHEDULERS:
        raise ModelError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {choice!r}")
    problems = unhonoured(read_scheduler_config(directory), choice)
    if problems:
        asked = "; ".join(f"{key}={value!r} (the {choice} sampler runs {' or '.join(map(repr, honoured))})"
                          for key, value, honoured in problems)
        raise ModelError(f"{directory}: scheduler/scheduler_config.json asks for {asked}; promptmill would not "
                         f"sample as the checkpoint says, so it refuses: pick another --scheduler, or edit the "
                         f"checkpoint's scheduler config")
    return choice


def make_scheduler(directory: str, choice: str | None):
    """(scheduler, state): the checkpoint's noise schedule with the chosen sampler.

    The checkpoint's config (betas, prediction type, offsets) is kept; only the
    sampling algorithm changes. A config key the sampler would not honour is refused
    (``check_scheduler``).
    """
    import diffusers

    choice = check_scheduler(directory, choice)
    class_name, overrides = SCHEDULERS[choice]
    config = {k: v for k, v in read_scheduler_config(directory).items() if not k.startswith("_")}
    # from_config keeps the keys the class knows and drops the others (e.g. PNDM's
    # skip_prk_steps when switching to Euler); HONOURED_CONFIG lists the dropped keys
    # that would change sampling
    scheduler = getattr(diffusers, class_name).from_config({**config, **overrides})
    if "steps_offset" not in scheduler.config:
        # Flax DPM-Solver reads config.steps_offset for "leading" spacing but does not
        # accept it as an argument; carry the checkpoint's value over.
        scheduler.register_to_config(steps_offset=config.get("steps_offset", 0))
    return scheduler, scheduler.create_state()


def _to_bf16(tree):
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def load(name: str, dtype: str = "fp32", scheduler: str | None = None) -> Model:
    """Load ``--model`` (``tiny`` or a diffusers-format directory) for sampling.

    ``dtype`` is the compute and weight dtype of the networks (``fp32`` or ``bf16``);
    latents and the scheduler always stay in float32.
    """
    quiet_libraries()  # before the Flax classes are imported: some warn at import
    import jax.numpy as jnp
    from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel
    from transformers import CLIPTokenizer, FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

    if dtype not in DTYPES:
        raise ModelError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    directory = resolve(name)
    index = check_layout(directory)
    jdtype = getattr(jnp, DTYPES[dtype])
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(directory, "tokenizer"))
    text_encoder, text_params = weights.load_transformers(FlaxCLIPTextModel, directory, "text_encoder", jdtype)
    unet, unet_params = weights.load_diffusers(FlaxUNet2DConditionModel, directory, "unet", jdtype)
    vae, vae_params = weights.load_diffusers(FlaxAutoencoderKL, directory, "vae", jdtype)
    scheduler, scheduler_state = make_scheduler(directory, scheduler)
    params = {"text_encoder": text_params, "unet": unet_params, "vae": vae_params}
    extra = {}
    if family(index) == "sdxl":
        extra["tokenizer_2"] = CLIPTokenizer.from_pretrained(os.path.join(directory, "tokenizer_2"))
        extra["text_encoder_2"], params["text_encoder_2"] = weights.load_transformers(
            FlaxCLIPTextModelWithProjection, directory, "text_encoder_2", jdtype)
    if dtype == "bf16":  # weights in bf16 too: half the memory and bandwidth
        params = {name: _to_bf16(tree) for name, tree in params.items()}
    params["scheduler"] = scheduler_state
    return Model(path=name, fingerprint=fingerprint(directory), tokenizer=tokenizer, text_encoder=text_encoder,
                 unet=unet, vae=vae, scheduler=scheduler, params=params, **extra)


def describe(name: str, scheduler: str | None = None) -> dict:
    """What planning needs to know of a model, from its configs alone (no weights loaded);
    ``scheduler``: the run's --scheduler, checked against the checkpoint's config."""
    directory = resolve(name)
    check_layout(directory)

    def config(component: str, filename: str = "config.json") -> dict:
        with open(os.path.join(directory, component, filename)) as f:
            return json.load(f)

    vae_scale = 2 ** (len(config("vae")["block_out_channels"]) - 1)
    return {"directory": directory, "fingerprint": fingerprint(directory),
            "scheduler": check_scheduler(directory, scheduler), "native_size": config("unet")["sample_size"] * vae_scale}
