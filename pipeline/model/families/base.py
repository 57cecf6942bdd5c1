"""What every model family provides, and the ``Model`` a family loads.

A family (``Family``) is what a checkpoint is made of and how its images are made: the
pipeline classes of ``model_index.json`` it takes and the components they need, how its
networks are loaded (from the configs alone for shapes, or with their weights), what a
plan needs to know of it (its native size, the sampler its scheduler config asks for,
its guidance and its size rule), how its prompts are tokenised, the denoising function
the sampler runs (text conditioning, the denoiser's loop, the VAE decode) and the parts
of a step lowered on their own for FLOP counts and the TPU check.

The rest of promptmill sees ``Model`` and calls its family; nothing outside
``pipeline.model.families`` branches on which family a model is.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from pipeline.model.sampling import decoding

# the size rule of the families whose latents go 2x2 into tokens (``Family.size_rule``)
PATCHED_SIZE_RULE = "twice the VAE's scale factor (2x2 patches): 16, or 4 for the built-in tiny models"


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What a run asks of its model, built from its settings in one place (``of``): the
    checkpoint (``--model``) and how its networks are made. ``steps`` is what ``describe``
    checks the sampler against (None: not checked)."""
    model: str
    dtype: str = "fp32"  # a --dtype choice
    scheduler: str | None = None  # None: the checkpoint's own
    timestep_spacing: str | None = None  # None: the checkpoint's own
    unet: str | None = None  # a --unet file
    loras: tuple[str, ...] = ()  # --lora specs, PATH@SCALE, merged in order
    max_sequence_length: int | None = None  # None: the family's
    steps: int | None = None

    @classmethod
    def of(cls, settings) -> "LoadRequest":
        """The request of a run's ``Settings``."""
        return cls(settings.model, settings.dtype, settings.scheduler, settings.timestep_spacing, settings.unet,
                   tuple(settings.loras), settings.max_sequence_length, settings.steps)

    @property
    def jax_dtype(self) -> str:
        """The jax.numpy name of the networks' dtype ("float32", "bfloat16")."""
        from pipeline.core.choices import DTYPES

        return DTYPES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded (or, ``abstract``, shapes-only) checkpoint, as its family made it."""
    path: str
    fingerprint: str | None  # None for an abstract model (``load(abstract=True)``)
    family: "Family"
    # the family's own networks, tokenizers and what its sampling reads (a dataclass of the
    # family's, e.g. SD's UNet and CLIP, FLUX.1's transformer and T5): only the family reads it
    nets: object
    sampler: object  # the family's resolved sampler (its choice, config and engine)
    params: dict  # {component: tree}; for an abstract model, jax.ShapeDtypeStructs
    dtype: object  # the networks' compute dtype (jax.numpy)
    latent_channels: int
    vae_scale_factor: int
    native_size: int
    # the dtype of floating params on the devices, when the host keeps them in another
    # (FLUX.1: stored bf16 in an fp32 run, cast on the devices); None: as on the host
    param_dtype: object = None
    default_steps: int = 20  # what --steps is when not given (``Described.default_steps``)

    def steps(self, steps: int | None) -> int:
        """The steps asked for, or the model's default when left out (None)."""
        return self.default_steps if steps is None else steps

    def size(self, width: int | None, height: int | None) -> tuple[int, int]:
        """(width, height) of the model's images: those asked for, each left out (None)
        the model's native size. Width and height travel in this order everywhere."""
        return width or self.native_size, height or self.native_size

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """(C, H/f, W/f): one image's initial latents, as diffusers draws them."""
        f = self.vae_scale_factor
        return (self.latent_channels, height // f, width // f)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerNets:
    """What the networks of the rectified-flow transformer families (FLUX.1, FLUX.2 [klein],
    Z-Image) have in common, in one dtype: the transformer, the VAE decoder and the scheduler
    config, and, once the family loads them, the (first) tokenizer and the text length; a
    family's subclass adds its text encoders and how many channels its latents are drawn with
    (``latent_channels``)."""
    transformer: Any  # the family's transformer module
    vae: Any  # vae.VaeDecoder
    scheduler_config: dict
    tokenizer: Any = None
    max_sequence_length: int | None = None

    @property
    def vae_scale_factor(self) -> int:
        return self.vae.config.scale_factor


@dataclasses.dataclass(frozen=True)
class Described:
    """What a plan needs to know of a checkpoint, from its configs alone."""
    family: str
    native_size: int
    scheduler: str  # the sampler choice the run will record (``--scheduler``'s value)
    size_multiple: int  # width and height must be multiples of it
    default_guidance: float  # what --guidance-scale is when not given
    guidance_rule: str  # how guidance acts (``Settings.guidance_rule``): diffusers, embedded or unused
    cfg: bool  # whether the family has classifier-free guidance at all
    max_sequence_length: int | None = None  # the resolved T5 length (FLUX.1)
    license: str | None = None  # the licence the checkpoint states, if any
    # the bounds of the family's settings, checked at plan time (``prepare.resolve_settings``):
    # the step counts its sampler runs correctly (``steps_bound`` says why), and the largest
    # width and height its networks are run at
    min_steps: int = 1
    max_steps: int = 1000
    steps_bound: str = ""
    max_size: int = 4096
    # what --steps is when not given (a run records the number), and why, when it is not the
    # reference pipeline's default
    default_steps: int = 20
    steps_note: str = ""
    # said when a run leaves --steps or --guidance-scale at the model's defaults (Z-Image: its
    # files do not say whether it is Turbo, whose recipe is not the defaults)
    defaults_note: str = ""


class Family:
    """The interface of a model family (see the module docstring); one object per family,
    registered in ``pipeline.model.families.FAMILIES``. Methods that take a model take
    the ``Model`` this family's ``load`` made. The defaults here are what the built-in
    families share: a family overrides only what is its own."""
    name: str = ""
    title: str = ""  # for people: "SD 1.x/2.x", "SDXL", "FLUX.1"
    pipeline_classes: tuple[str, ...] = ()  # model_index.json _class_name values it takes
    cfg: bool = True  # whether it has classifier-free guidance (a guided program) at all
    rules: tuple = ()  # the guidance rules it brings of its own (``guidance.Rule``), registered with it
    # pipeline classes of a model this family will run one day, refused now with the reason
    # ({class: why}), where a plain "promptmill does not run it" would not say enough
    not_yet: dict = {}
    # for people (help texts, the card): the family's size unit (``Described.size_multiple``
    # of its checkpoints, built-in ones included), its default steps, what its guidance scale
    # does, and its text length setting (empty: none)
    size_rule: str = "8"
    steps_help: str = ""
    guidance_help: str = ""
    sequence_help: str = ""
    # whether diffusers' Flax notebook recipe (FlaxStableDiffusionPipeline) runs it: the seed
    # baseline that ``bench generator``'s sweep and recipes compare with
    notebook_baseline: bool = False
    # its built-in random models: a module (or object) with ``PRESETS`` ({name: preset}) and
    # ``ensure(name, shapes)``; None: it has none
    presets = None
    # the folders a checkpoint of it has, and the ones holding weights by the library whose
    # file names they use ({component: "diffusers" | "transformers"})
    component_folders: tuple[str, ...] = ()
    libraries: dict = {}

    def with_sampler(self, model: Model, directory: str, scheduler: str | None,
                     timestep_spacing: str | None) -> Model:
        """``model``'s networks and weights (nothing reloaded) with another sampler."""
        from pipeline.model.loading.checkpoint import ModelError

        raise ModelError(f"{self.title} has one sampler; --scheduler chooses among SD's")

    def builtins(self) -> dict:
        """{name: preset} of the family's built-in random models (``--model tiny``, ...)."""
        return {} if self.presets is None else dict(self.presets.PRESETS)

    def ensure_builtin(self, name: str, shapes: bool = False) -> str:
        """The folder of the built-in model ``name`` (one of ``builtins``), built once per machine."""
        return self.presets.ensure(name, shapes)

    def guidance_rule(self, model: Model) -> str:
        """How a new run's guidance acts (``Settings.guidance_rule``)."""
        return "diffusers"

    def classifier_free(self, model: Model) -> bool:
        """Whether ``model`` has classifier-free guidance (a guided program) at all: the
        family's ``cfg``, or per checkpoint (FLUX.2 [klein]: its base models only)."""
        return self.cfg

    def loaded_params(self, directory: str, nets, loras, abstract: bool, dtype) -> dict:
        """{component: params} of a family that converts its own weights (its ``_flat_shapes``
        and ``_params``): the networks' shapes in ``dtype`` when ``abstract`` (what the devices
        hold), else the converted weights with ``loras`` merged (a merged layer is the one
        copy made on the host, cast back to its stored dtype)."""
        from pipeline.model.loading import convert, lora
        from pipeline.model.loading.checkpoint import ModelError

        if abstract:
            return convert.abstract_params(self._flat_shapes(nets), dtype)
        params = self._params(directory, nets)
        if loras:
            try:
                params = lora.merge(params, loras, torch_names=self.lora_torch_names())
            except lora.LoraError as e:
                raise ModelError(str(e)) from None
        return params

    def lora_torch_names(self) -> dict:
        """{component: ``convert.TorchNames``} of promptmill's own networks, whose layers a
        LoRA names by PyTorch's names (a stacked block by its index)."""
        return {}

    def claims(self, index: dict) -> bool:
        """Whether ``model_index.json`` (``index``) is a checkpoint of this family."""
        return index.get("_class_name", "").removeprefix("Flax") in self.pipeline_classes

    def components(self, index: dict) -> tuple[str, ...]:
        """The folders a checkpoint of this family must have."""
        return self.component_folders

    def weight_libraries(self, index: dict) -> dict[str, str]:
        """{component: "diffusers" | "transformers"}: the components that hold weights, by
        the library whose file names they use (``weights.FLAX_FILES`` /
        ``SAFETENSORS_FILES``)."""
        return dict(self.libraries)

    def read_nets(self, directory: str, dtype=None):
        """The family's networks of the checkpoint in ``directory``, computing in ``dtype``
        (None: float32), from its configs alone; ValueError naming a config it would not
        honour."""
        raise NotImplementedError

    def nets_of(self, directory: str, dtype=None):
        """``read_nets``, a config it would not honour a ModelError."""
        from pipeline.model.loading.checkpoint import ModelError

        try:
            return self.read_nets(directory, dtype)
        except ValueError as e:
            raise ModelError(str(e)) from None

    def unet_file(self, directory: str, unet: str) -> str:
        """The local file of ``--unet`` (``unet``: a UNet-only safetensors file, local or
        gs://, copied once into the cache), checked against the checkpoint's UNet; the
        base refuses before anything is fetched: its checkpoints have no UNet."""
        from pipeline.model.loading.checkpoint import ModelError

        raise ModelError("--unet replaces a UNet's weights; the model has no UNet")

    def describe(self, directory: str, request: LoadRequest, unet_file: str | None) -> Described:
        """What a plan needs to know of the checkpoint (configs alone) for ``request``;
        ModelError for a setting the family refuses (a sampler, spacing, step count, length
        or file it cannot honour). ``unet_file``: the local ``--unet`` file, if any."""
        raise NotImplementedError

    def load(self, directory: str, request: LoadRequest, unet_file: str | None, loras: list[tuple[str, float]],
             abstract: bool) -> Model:
        """The model's networks and params for ``request`` (``unet_file``: the local
        ``--unet`` file; ``loras``: (local file, scale) merged in order); ``abstract``:
        params as ShapeDtypeStructs from the configs alone."""
        raise NotImplementedError

    def lora_shapes(self, directory: str) -> dict:
        """{component: {flat param path: shape}} of the layers a LoRA may adapt (configs alone)."""
        raise NotImplementedError

    def tokenize(self, model: Model, texts):
        """int32 token ids of ``texts``, one row per text."""
        raise NotImplementedError

    def truncated(self, model: Model, texts) -> list[bool]:
        """Whether each text is longer than a text encoder takes (``tokenize`` cuts it)."""
        raise NotImplementedError

    def make_denoise(self, model: Model, steps: int, empty_negative_ids=None, *,
                     return_latents: bool = False, guidance_rule: str = "diffusers", guided: bool = True,
                     seam=contextlib.nullcontext, decode=decoding.whole):
        """``denoise(params, prompt_ids, negative_ids, guidance, latents, image_keys)``:
        float32 images [B, H, W, 3] in [0, 1] from initial latents [B, C, H/f, W/f]
        (with ``return_latents``, also the final latents). ``seam()`` is entered while
        the function is traced (the attention seam). ``decode(decode_fn, latents)`` runs
        the VAE decode of the final latents (``pipeline.model.sampling.decoding``: whole, or
        in micro-batches)."""
        raise NotImplementedError

    def decode_latents(self, model: Model, vae_params, latents):
        """float32 images [B, H, W, 3] in [0, 1] from final latents as the sampler returns
        them (``make_denoise(..., return_latents=True)``): by default the model's VAE
        decoder (``model.nets.vae``, ``pipeline.model.layers.vae``), which undoes its own
        scaling, shift or batch-norm statistics."""
        from pipeline.model.layers import vae

        return vae.vae_decode(model.nets.vae, vae_params, latents, model.nets.vae.config)

    def latents_note(self, model: Model) -> dict:
        """Attributes of a run's saved final latents: how to decode them."""
        raise NotImplementedError

    def parts(self, model: Model, width: int, height: int, per_device_batch: int, guided: bool, *,
              seam=contextlib.nullcontext, sharding=None, count: bool = False
              ) -> list[tuple[str, tuple[str, ...], object]]:
        """(label, the param components it reads, the lowered program) of each part of a
        sampler step, at one device's shapes: the text encoders, one denoiser call, the
        VAE decode; lowered from shapes alone (``sharding``: where its inputs live).
        ``count``: lowered for XLA's cost analysis, which counts a loop's body once: a
        network's repeated layers are unrolled (the same arithmetic)."""
        raise NotImplementedError

    def denoiser_calls(self, model: Model, steps: int) -> int:
        """How many times ``steps`` steps of one image run the denoiser part (``parts``)."""
        return steps
