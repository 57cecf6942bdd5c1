"""Loading a diffusers-format Stable Diffusion checkpoint: the narrow model interface.

Every model, ``--model tiny`` included, is a diffusers-format directory found by
``pipeline.model.sources`` and loaded by ``load``, with the sampler the run chose
(``pipeline.model.scheduler.resolve_sampler``). The rest of promptmill sees only ``Model``.
"""
from __future__ import annotations

import dataclasses
import json
import os

from pipeline.core.choices import DTYPES
from pipeline.core.settings import parse_lora
from pipeline.model import lora, tiny, weights
from pipeline.model.libraries import quiet_libraries
from pipeline.model.scheduler import Sampler, make_flax_scheduler, resolve_sampler
from pipeline.model.sources import (
    ModelError,
    check_layout,
    check_unet_file,
    family,
    file_sha256,
    model_fingerprint,
    resolve,
    resolve_lora,
    resolve_unet,
)

@dataclasses.dataclass(frozen=True)
class Model:
    path: str
    fingerprint: str | None  # None for an abstract model (``load(abstract=True)``)
    tokenizer: object
    text_encoder: object
    unet: object
    vae: object
    sampler: Sampler
    scheduler: object  # the Flax scheduler of a "flax"-engine sampler, else None
    params: dict  # {"text_encoder", ["text_encoder_2",] "unet", "vae"[, "scheduler" (Flax state)]}
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
    def dtype(self):
        return self.unet.dtype

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        f = self.vae_scale_factor
        return (self.latent_channels, height // f, width // f)


def _to_bf16(tree):
    import jax
    import jax.numpy as jnp

    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
        return x.astype(jnp.bfloat16)

    return jax.tree_util.tree_map(cast, tree)


def load(name: str, dtype: str = "fp32", scheduler: str | None = None, timestep_spacing: str | None = None,
         unet: str | None = None, loras: tuple[str, ...] | list[str] = (), abstract: bool = False,
         fingerprint: bool = True) -> Model:
    """Load ``--model`` (``tiny`` or a diffusers-format directory) for sampling.

    ``dtype`` is the compute and weight dtype of the networks (``fp32`` or ``bf16``);
    latents and the scheduler always stay in float32. ``scheduler`` and
    ``timestep_spacing``: the run's choices (None: the checkpoint's own), resolved by
    ``pipeline.model.scheduler.resolve_sampler``. ``unet``: a UNet-only safetensors file
    (local or gs://) whose weights replace the checkpoint's (``--unet``). ``loras``: the
    ``--lora`` specs (``PATH[@SCALE]``), merged in order into the float32 weights
    (``pipeline.model.lora``) before the cast to ``dtype``; they change parameter values
    only, never the compiled program.

    ``abstract``: the same model with its networks' params as ``jax.ShapeDtypeStruct``s,
    from the configs alone (no weight read, no adapter merged): enough to lower and compile
    its programs. ``fingerprint=False``: the model's fingerprint is left None (not
    computed: the caller checks the files another way, ``sources.check_files``).
    """
    quiet_libraries()  # before the Flax classes are imported: some warn at import
    import jax.numpy as jnp
    from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel
    from transformers import CLIPTokenizer, FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

    if dtype not in DTYPES:
        raise ModelError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    directory = resolve(name, weights=not abstract, shapes=abstract)  # shapes come from the configs alone
    index = check_layout(directory)
    if not abstract and tiny.shapes_only(directory):
        raise ModelError(f"model {name!r} is a shapes-only built-in model: its weights are never written, so it "
                         f"can be compiled and measured (the TPU check, `promptmill bench`) but not run; use "
                         f"{', '.join(n for n, p in tiny.PRESETS.items() if not p.get('shapes_only'))} to run a "
                         f"random model")
    unet_file = _checked_unet(directory, unet)
    adapters = _resolved_loras(loras)
    sampler = resolve_sampler(directory, scheduler, timestep_spacing)
    jdtype = getattr(jnp, DTYPES[dtype])
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(directory, "tokenizer"))
    text_encoder, text_params = weights.load_transformers(
        FlaxCLIPTextModel, directory, "text_encoder", jdtype, abstract)
    unet, unet_params = weights.load_diffusers(
        FlaxUNet2DConditionModel, directory, "unet", jdtype, unet_file, abstract)
    vae, vae_params = weights.load_diffusers(FlaxAutoencoderKL, directory, "vae", jdtype, abstract=abstract)
    params = {"text_encoder": text_params, "unet": unet_params, "vae": vae_params}
    extra = {}
    if family(index) == "sdxl":
        extra["tokenizer_2"] = CLIPTokenizer.from_pretrained(os.path.join(directory, "tokenizer_2"))
        extra["text_encoder_2"], params["text_encoder_2"] = weights.load_transformers(
            FlaxCLIPTextModelWithProjection, directory, "text_encoder_2", jdtype, abstract)
    if not abstract:
        try:  # on the host, in float32: before the cast below and before any transfer to devices
            params = lora.merge(params, [(local, scale) for _, local, scale in adapters])
        except lora.LoraError as e:
            raise ModelError(str(e)) from None
    if dtype == "bf16":  # weights in bf16 too: half the memory and bandwidth
        params = {name: _to_bf16(tree) for name, tree in params.items()}
    flax_scheduler, params = _with_sampler_state(sampler, params)
    value = None if abstract or not fingerprint else model_fingerprint(
        directory, unet_file, [(local, scale) for _, local, scale in adapters])
    return Model(path=name, fingerprint=value, tokenizer=tokenizer,
                 text_encoder=text_encoder, unet=unet, vae=vae, sampler=sampler, scheduler=flax_scheduler,
                 params=params, **extra)


def _with_sampler_state(sampler: Sampler, params: dict) -> tuple[object, dict]:
    """(the Flax scheduler or None, params with the Flax scheduler's state or without any)."""
    params = {name: tree for name, tree in params.items() if name != "scheduler"}
    if sampler.engine != "flax":
        return None, params
    flax_scheduler, params["scheduler"] = make_flax_scheduler(sampler)
    return flax_scheduler, params


def with_sampler(model: Model, scheduler: str | None, timestep_spacing: str | None = None) -> Model:
    """The same networks and weights (nothing reloaded) with another sampler, resolved as
    ``load`` resolves it."""
    sampler = resolve_sampler(resolve(model.path), scheduler, timestep_spacing)
    flax_scheduler, params = _with_sampler_state(sampler, model.params)
    return dataclasses.replace(model, sampler=sampler, scheduler=flax_scheduler, params=params)


# UNet config keys that the Flax UNet lacks and that would change its output: a
# checkpoint setting them is refused, not loaded without them
_UNET_KEYS_FLAX_LACKS = ("time_cond_proj_dim", "class_embed_type", "encoder_hid_dim")


def _checked_unet(directory: str, unet: str | None) -> str | None:
    """The local ``--unet`` file (None without one), once the checkpoint's UNet config and
    the file have been checked against what the Flax UNet runs."""
    check_unet(directory)
    if not unet:
        return None
    unet_file = resolve_unet(unet)
    check_unet_file(directory, unet_file)
    return unet_file


def _resolved_loras(specs) -> list[tuple[str, str, float]]:
    """(path as given, local file, scale) of each ``--lora`` spec, in order."""
    resolved = []
    for spec in specs:
        try:
            path, scale = parse_lora(spec)
        except ValueError as e:
            raise ModelError(str(e)) from None
        resolved.append((path, resolve_lora(path), scale))
    return resolved


def _checked_loras(directory: str, index: dict, specs) -> list[tuple[str, str, float]]:
    """``_resolved_loras``, once each file has been read and every key matched to a layer
    of the checkpoint, with fitting shapes (from its configs: no weights are loaded)."""
    adapters = _resolved_loras(specs)
    if not adapters:
        return adapters
    try:
        read = [lora.read(local) for _, local, _ in adapters]  # headers only: an unreadable file fails first
        components = ("unet", "text_encoder") + (("text_encoder_2",) if family(index) == "sdxl" else ())
        shapes = {component: weights.param_shapes(directory, component) for component in components}
        for adapter in read:
            lora.match(adapter, shapes)
    except lora.LoraError as e:
        raise ModelError(str(e)) from None
    return adapters


def check_unet(directory: str) -> None:
    """ModelError naming each UNet config key the Flax UNet would drop (e.g. an LCM
    UNet's ``time_cond_proj_dim``, the guidance embedding)."""
    with open(os.path.join(directory, "unet", "config.json")) as f:
        config = json.load(f)
    asked = [f"{key}={config[key]!r}" for key in _UNET_KEYS_FLAX_LACKS
             if config.get(key) is not None]
    if asked:
        raise ModelError(f"{directory}: unet/config.json asks for {', '.join(asked)}, which diffusers' Flax UNet "
                         f"does not have; promptmill cannot run this UNet as its config says")


def describe(name: str, scheduler: str | None = None, timestep_spacing: str | None = None,
             steps: int | None = None, unet: str | None = None, loras: tuple[str, ...] | list[str] = ()) -> dict:
    """What planning needs to know of a model, from its configs alone (no weights loaded);
    ``scheduler``, ``timestep_spacing`` and ``steps``: the run's, checked against the
    checkpoint's config (``resolve_sampler``); ``unet``: the run's --unet file, checked
    against the checkpoint's UNet and part of the fingerprint; ``loras``: the run's --lora
    specs, each file read and matched layer by layer against the checkpoint's networks, and
    part of the fingerprint. ``loras`` in the result: {path, scale, sha256} of each. Of a
    gs:// checkpoint only the configs are downloaded, and its fingerprint is its objects'
    checksums (``sources.fingerprint``)."""
    directory = resolve(name, weights=False)
    index = check_layout(directory)
    unet_file = _checked_unet(directory, unet)
    adapters = _checked_loras(directory, index, loras)

    def config(component: str, filename: str = "config.json") -> dict:
        with open(os.path.join(directory, component, filename)) as f:
            return json.load(f)

    vae_scale = 2 ** (len(config("vae")["block_out_channels"]) - 1)
    return {"directory": directory,
            "fingerprint": model_fingerprint(directory, unet_file, [(local, scale) for _, local, scale in adapters]),
            "loras": [{"path": path, "scale": scale, "sha256": file_sha256(local)} for path, local, scale in adapters],
            "scheduler": resolve_sampler(directory, scheduler, timestep_spacing, steps).choice,
            "native_size": config("unet")["sample_size"] * vae_scale}
