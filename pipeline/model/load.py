"""Loading a diffusers-format Stable Diffusion checkpoint: the narrow model interface.

Every model, ``--model tiny`` included, is a diffusers-format directory
(``model_index.json``, ``tokenizer/``, ``text_encoder/``, ``unet/``, ``vae/``,
``scheduler/``) loaded by ``load``. The rest of promptmill sees only ``Model``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

from pipeline.core.choices import DTYPES, SCHEDULERS
from pipeline.model import tiny
from pipeline.model import weights
from pipeline.model.cache import cache_dir, materialize
from pipeline.model.libraries import quiet_libraries

COMPONENTS = ("tokenizer", "text_encoder", "unet", "vae", "scheduler")
SDXL_COMPONENTS = ("tokenizer_2", "text_encoder_2")  # SDXL's second text encoder
# checkpoint scheduler class names (with or without the Flax prefix) -> --scheduler choice
_CHECKPOINT_SCHEDULERS = {"DDIMScheduler": "ddim", "PNDMScheduler": "pndm", "EulerDiscreteScheduler": "euler",
                          "DPMSolverMultistepScheduler": "dpmpp"}


class ModelError(ValueError):
    """A checkpoint that cannot be used; the message names the missing or bad piece."""


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


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.txt", "*.msgpack", "*.safetensors"]


def resolve(name: str) -> str:
    """The local diffusers-format directory for ``--model``.

    A built-in random model's name, a local folder, a ``gs://`` prefix (copied once
    into the cache, keyed by the objects' checksums), or a Hugging Face id (fetched
    through the hub's own cache, where the network allows).
    """
    from pipeline.io import storage

    if name in tiny.PRESETS:
        return tiny.ensure(os.path.join(cache_dir(), "models"), name)
    if storage.is_gcs(name):
        return fetch_remote(name)
    if os.path.isdir(name):
        return name
    if _HUB_ID.fullmatch(name) and not os.path.exists(name):
        return _fetch_hub(name)
    raise ModelError(f"model {name!r} is not a directory (give a diffusers-format folder, a gs:// prefix, a "
                     f"Hugging Face id, or one of the built-in random models: {', '.join(tiny.PRESETS)})")


def fetch_remote(prefix: str) -> str:
    """Copy a remote checkpoint into the local cache once; returns the local folder.

    The cache key is a hash of every object's name, size and checksum, so a changed
    checkpoint is fetched anew and an unchanged one never is. The copy is made in a
    scratch folder and renamed into place (a local rename), so a crash leaves no
    half-copied model behind.
    """
    from pipeline.io import storage

    sums = storage.checksums(prefix)
    if "model_index.json" not in sums:
        raise ModelError(f"{prefix}: missing model_index.json (not a diffusers-format checkpoint)")
    key = hashlib.sha256(json.dumps(sorted(sums.items())).encode()).hexdigest()[:24]
    target = os.path.join(cache_dir(), "models", "remote", key)

    def copy(scratch: str) -> None:
        for relative in sorted(sums):
            storage.download(f"{prefix.rstrip('/')}/{relative}", os.path.join(scratch, relative))

    return materialize(target, copy)


def _fetch_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except Exception as e:  # offline, unknown id, gated repo: say which and why
        raise ModelError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
                         "download it elsewhere and pass the folder or a gs:// copy") from e


def fingerprint(directory: str) -> str:
    """sha256 over every file of the checkpoint (relative name and content)."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, directory).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            digest.update(b"\0")
    return digest.hexdigest()


def family(index: dict) -> str:
    """'sdxl' for a checkpoint with a second text encoder, else 'sd' (SD 1.x / 2.x)."""
    return "sdxl" if index.get("text_encoder_2", [None])[0] else "sd"


def check_layout(directory: str) -> dict:
    """Read ``model_index.json`` and check that every component is present."""
    index_path = os.path.join(directory, "model_index.json")
    if not os.path.isfile(index_path):
        raise ModelError(f"{directory}: missing model_index.json (not a diffusers-format checkpoint)")
    with open(index_path) as f:
        index = json.load(f)
    components = COMPONENTS + (SDXL_COMPONENTS if family(index) == "sdxl" else ())
    for component in components:
        if component not in index or not os.path.isdir(os.path.join(directory, component)):
            raise ModelError(f"{directory}: missing component '{component}/'")
    for component in components:
        if component in weights.LIBRARY:
            sub = os.path.join(directory, component)
            if not os.path.isfile(os.path.join(sub, "config.json")):
                raise ModelError(f"{directory}: missing {component}/config.json")
            try:
                weights.find(sub, component)
            except weights.WeightsError as e:
                raise ModelError(str(e)) from None
    if not os.path.isfile(os.path.join(directory, "scheduler", "scheduler_config.json")):
        raise ModelError(f"{directory}: missing scheduler/scheduler_config.json")
    return index


def checkpoint_scheduler(directory: str) -> str:
    """The --scheduler choice that a checkpoint's own scheduler config names."""
    with open(os.path.join(directory, "scheduler", "scheduler_config.json")) as f:
        class_name = json.load(f).get("_class_name", "")
    choice = _CHECKPOINT_SCHEDULERS.get(class_name.removeprefix("Flax"))
    if choice is None:
        raise ModelError(f"{directory}: the checkpoint's scheduler {class_name!r} is not supported; pick one with "
                         f"--scheduler {'|'.join(SCHEDULERS)}")
    return choice


def make_scheduler(directory: str, choice: str | None):
    """(scheduler, state): the checkpoint's noise schedule with the chosen sampler.

    The checkpoint's config (betas, prediction type, offsets) is kept; only the
    sampling algorithm changes.
    """
    import diffusers

    choice = choice or checkpoint_scheduler(directory)
    if choice not in SCHEDULERS:
        raise ModelError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {choice!r}")
    class_name, overrides = SCHEDULERS[choice]
    with open(os.path.join(directory, "scheduler", "scheduler_config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    # from_config keeps the keys the class knows and drops the others (e.g. PNDM's
    # skip_prk_steps when switching to Euler)
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


def describe(name: str) -> dict:
    """What planning needs to know of a model, from its configs alone (no weights loaded)."""
    directory = resolve(name)
    check_layout(directory)

    def config(component: str, filename: str = "config.json") -> dict:
        with open(os.path.join(directory, component, filename)) as f:
            return json.load(f)

    vae_scale = 2 ** (len(config("vae")["block_out_channels"]) - 1)
    return {"directory": directory, "fingerprint": fingerprint(directory),
            "scheduler": checkpoint_scheduler(directory), "native_size": config("unet")["sample_size"] * vae_scale}
