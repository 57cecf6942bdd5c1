"""The one settings object of a run.

CLI flags and Beam options are translated into ``Settings``; nothing else is a source
of truth. ``run.json`` holds a ``Run``: the resolved settings and what pins the outputs'
bytes. Every later stage reads it back into a ``Run`` (``pipeline.io.runs``), and no
module reads a run setting by string key. Each setting's default is written once, here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math

from pipeline.core import buckets, keys, naming, slicing
from pipeline.core.records import MAX_GUIDANCE, MIN_GUIDANCE
from pipeline.core.choices import (
    ATTENTIONS,
    DTYPES,
    FORMATS,
    IMAGE_FORMATS,
    SCHEDULERS,
    SCORES,
    TIMESTEP_SPACINGS,
    parse_formats,
    parse_scores,
)


@dataclasses.dataclass(frozen=True)
class Settings:
    prompts: str = "examples/prompts.jsonl"
    out: str = "promptmill-out"
    model: str = "tiny"
    unet: str | None = None  # a UNet-only safetensors file (local or gs://) replacing the checkpoint's UNet weights
    # LoRA adapters merged into the weights once, at load, in this order: "PATH@SCALE" (parse_lora)
    loras: tuple[str, ...] = ()
    width: int | None = None  # None: the model's native size (with sizes: the first, the default bucket)
    height: int | None = None
    # the run's image sizes, its aspect-ratio buckets ("WxH", ``pipeline.core.buckets``), when --sizes
    # gave them: the first is the default, and a record may ask for one by width/height or
    # aspect_ratio. Empty: one size, width x height, and those record fields only pass through.
    # ("common" before planning: the preset, scaled to the family's native area.)
    sizes: tuple[str, ...] = ()
    # each bucket's per-device batch, in the order of sizes, as --per-device-batch auto chose them
    # (a 512x512 bucket may fit more than a 1024x1024 one); empty: every bucket runs per_device_batch
    bucket_batches: tuple[int, ...] = ()
    # None: the model family's default (SD and SDXL 20, FLUX.1 [schnell] 4 and [dev] 28, FLUX.2
    # [klein] 4 and its base 50), resolved when planning: run.json holds the number, and a
    # resumed run keeps its own
    steps: int | None = None
    scheduler: str | None = None  # None: the checkpoint's own (resolved when planning)
    timestep_spacing: str | None = None  # None: the checkpoint's scheduler config's own
    # None: the model family's default (SD and SDXL 7.5, FLUX.1 [dev] 3.5, [schnell] 0: it takes
    # none), resolved when planning: run.json holds the number
    guidance_scale: float | None = None
    # FLUX.1's T5 sequence length in tokens (None: the family's, 512, resolved when planning);
    # refused for families without a T5 encoder
    max_sequence_length: int | None = None
    seed: int = 0  # the run seed, hashed with a record's id when it has no seed
    per_device_batch: int | str = 1  # "auto": the largest that fits a device, chosen before planning
    # the memory of one device in GiB, for --per-device-batch auto (None: the device's own figure)
    device_memory: float | None = None
    # device steps per slice; "auto": decided by the plan once it knows the run's images
    # (``slicing.auto_batches_per_slice``: today's 2 under a million images, about 1,024 images
    # a slice from a million), recorded in run.json, and a resumed run keeps its own
    batches_per_slice: int | str = "auto"
    devices_per_host: int = 1
    # FSDP (pipeline.model.sharding): each host's weights sharded over groups of this many of
    # its devices, gathered as they are used; 1: a whole copy on every device (the replicated
    # program); "auto": the smallest that fits one image per device, chosen before planning
    fsdp: int | str = 1
    dtype: str = "fp32"
    # the VAE decodes a device's batch in micro-batches of this many images, one after the other, so
    # that the denoiser, not the decoder, bounds the batch; it can change float bits, so it is part
    # of the run: "auto" is resolved when planning; None: the whole batch at once (runs planned before)
    decode_batch: int | str | None = "auto"
    # attention kernels (pipeline.model.layers.attention): auto picks per call from the platform and
    # shapes; the choice can change float bits, so it is part of the run
    attention: str = "auto"
    formats: tuple[str, ...] = ("files",)
    image_format: str = "png"
    quality: int = 95  # jpeg and webp
    save_latents: bool = False  # zarr: also OUT/zarr/latents, the final latents before VAE decoding
    prompt_field: str = "prompt"  # the prompt's column / key in jsonl, json, csv, tsv and parquet inputs
    dedupe: bool = False  # plan: a record whose prompt an earlier record has is rejected (duplicate_prompt)
    # the name of how guidance acts (``pipeline.model.sampling.guidance``: a rule the shared ones or
    # the model's family bring). Not a flag: decided by the model's family when planning, and a
    # run keeps it.
    guidance_rule: str = "diffusers"
    # whether the run's program runs classifier-free guidance (UNet batch 2B, negative prompts
    # encoded) or is guidance-free (batch B, no negative prompts): decided by the plan, True
    # when any planned record's guidance asks for it under the run's rule; None until then.
    # Not a flag. Per run, never per batch, so an image's bits never depend on its neighbours.
    guided: bool | None = None
    # scores computed on the devices that made the images (pipeline.generate.scoring): a subset
    # of SCORES; each reads its model: clip_model (CLIP in transformers' format: a built-in name,
    # local folder, gs:// or hub id), aesthetic_head (a safetensors file of LAION's improved
    # aesthetic predictor), safety_checker (diffusers' safety checker; None: the checkpoint's own)
    scores: tuple[str, ...] = ()
    clip_model: str | None = None
    aesthetic_head: str | None = None
    safety_checker: str | None = None
    # filters (pipeline.core.filters): an image failing one is written to no image output, and its
    # metadata row keeps a ``dropped`` reason
    min_clip_similarity: float | None = None
    min_aesthetic: float | None = None
    drop_nsfw: bool = False

    @property
    def slice_size(self) -> int:
        if self.per_device_batch == AUTO:
            raise ValueError("--per-device-batch auto is resolved to a number before planning "
                             "(pipeline.generate.fit.resolve_per_device_batch)")
        if self.batches_per_slice == AUTO:
            raise ValueError("--batches-per-slice auto is resolved to a number when planning, once the run's images "
                             "are counted (pipeline.plan.decide.decide_batches_per_slice)")
        return slicing.slice_size(self.devices_per_host, self.per_device_batch, self.batches_per_slice)

    def validate(self) -> "Settings":
        """Return self, or raise ValueError naming the bad setting."""
        for name in ("width", "height"):
            if getattr(self, name) is not None:
                check_size(name, getattr(self, name))
        self._validate_sizes()
        if self.steps is not None:
            _check_int("--steps", self.steps, 1, MAX_STEPS, "a sampler's steps; each family may allow fewer")
        _check_int("--per-device-batch", self.per_device_batch, 1, MAX_PER_DEVICE_BATCH, "images per device "
                   "and batch", AUTO)
        _check_int("--batches-per-slice", self.batches_per_slice, 1, MAX_BATCHES_PER_SLICE, "batches per slice", AUTO)
        _check_int("--devices-per-host", self.devices_per_host, 1, MAX_DEVICES_PER_HOST, "devices of one host")
        if not 0 <= self.seed < keys.MAX_SEED:
            raise ValueError(f"--seed must be in [0, 2**63), got {self.seed}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise ValueError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if tuple(self.formats) != parse_formats(",".join(self.formats)):
            raise ValueError(f"--format must list some of {', '.join(FORMATS)}, got {self.formats}")
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(f"--image-format must be one of {', '.join(IMAGE_FORMATS)}, "
                             f"got {self.image_format!r}")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"--quality must be in [1, 100], got {self.quality}")
        if self.save_latents and "zarr" not in self.formats:
            raise ValueError(f"--save-latents needs --format zarr (latents are written to OUT/zarr/latents), "
                             f"got --format {','.join(self.formats)}")
        if not isinstance(self.guidance_rule, str) or not self.guidance_rule:
            raise ValueError(f"guidance_rule must name a guidance rule, got {self.guidance_rule!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"--attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.timestep_spacing is not None and self.timestep_spacing not in TIMESTEP_SPACINGS:
            raise ValueError(f"--timestep-spacing must be one of {', '.join(TIMESTEP_SPACINGS)}, "
                             f"got {self.timestep_spacing!r}")
        if self.guided not in (None, True, False):
            raise ValueError(f"guided must be true, false or null, got {self.guided!r}")
        if self.guidance_scale is not None and (isinstance(self.guidance_scale, bool) or not isinstance(
                self.guidance_scale, (int, float)) or not MIN_GUIDANCE <= self.guidance_scale <= MAX_GUIDANCE):
            raise ValueError(f"--guidance-scale must be a number in [{MIN_GUIDANCE:g}, {MAX_GUIDANCE:g}] (as a "
                             f"record's guidance_scale), got {self.guidance_scale!r}")
        if self.max_sequence_length is not None and (isinstance(self.max_sequence_length, bool) or not isinstance(
                self.max_sequence_length, int) or not 1 <= self.max_sequence_length <= MAX_SEQUENCE_LENGTH):
            raise ValueError(f"--max-sequence-length must be a whole number of text tokens from 1 to "
                             f"{MAX_SEQUENCE_LENGTH}, got {self.max_sequence_length!r}")
        for spec in self.loras:
            parse_lora(spec)
        if not isinstance(self.prompt_field, str) or not self.prompt_field:
            raise ValueError(f"--prompt-field must be a non-empty name, got {self.prompt_field!r}")
        if self.device_memory is not None and (isinstance(self.device_memory, bool) or not isinstance(
                self.device_memory, (int, float)) or not 0 < self.device_memory <= MAX_DEVICE_MEMORY):
            raise ValueError(f"--device-memory must be a number of GiB in (0, {MAX_DEVICE_MEMORY}], "
                             f"got {self.device_memory}")
        self._validate_scores()
        if AUTO in (self.per_device_batch, self.batches_per_slice):  # the factors that are numbers
            slicing.slice_size(self.devices_per_host, 1 if self.per_device_batch == AUTO else self.per_device_batch,
                               1 if self.batches_per_slice == AUTO else self.batches_per_slice)
        else:
            self.slice_size  # validates the three slice factors
        if self.fsdp != AUTO:
            if isinstance(self.fsdp, bool) or not isinstance(self.fsdp, int) or self.fsdp < 1:
                raise ValueError(f"--fsdp must be a whole number >= 1 or auto, got {self.fsdp!r}")
            if self.devices_per_host % self.fsdp:
                divisors = [n for n in range(1, self.devices_per_host + 1) if self.devices_per_host % n == 0]
                raise ValueError(f"--fsdp {self.fsdp} must divide the devices of a host ({self.devices_per_host}): "
                                 f"the weights are sharded over groups of {self.fsdp} of them; possible: "
                                 f"{', '.join(map(str, divisors))}")
        return self

    def _validate_sizes(self) -> None:
        """--sizes, the buckets' per-device batches and the decoder's micro-batch."""
        if self.sizes and tuple(self.sizes) != buckets.parse_sizes(",".join(self.sizes)):
            raise ValueError(f"--sizes must be WxH[,WxH...] or {buckets.PRESET}, got {','.join(self.sizes)!r}")
        if self.sizes and self.sizes != (buckets.PRESET,):
            for name in self.sizes:
                width, height = buckets.parse_size(name)
                check_size("sizes", width), check_size("sizes", height)
            if (self.width, self.height) not in ((None, None), buckets.parse_size(self.sizes[0])):
                given = " ".join(f"--{k} {v}" for k, v in (("width", self.width), ("height", self.height)) if v)
                raise ValueError(f"--sizes {','.join(self.sizes)} and {given}: give one (--width, --height: one size)")
        if self.bucket_batches:
            if len(self.bucket_batches) != len(self.sizes) or self.sizes == (buckets.PRESET,):
                raise ValueError(f"bucket_batches holds one per-device batch per size, got {self.bucket_batches} "
                                 f"for {self.sizes}")
            for batch in self.bucket_batches:
                _check_int("--per-device-batch", batch, 1, MAX_PER_DEVICE_BATCH, "a bucket's images per device")
            if self.bucket_batches[0] != self.per_device_batch:
                raise ValueError(f"bucket_batches {self.bucket_batches} must start with the run's per-device batch "
                                 f"{self.per_device_batch} (the first size's)")
        if self.decode_batch is not None:
            _check_int("--decode-batch", self.decode_batch, 1, MAX_PER_DEVICE_BATCH, "images the VAE decodes at "
                       "once", AUTO)

    def buckets(self) -> list[tuple[int, int, int]]:
        """(width, height, per-device batch) of each of the run's sizes, in order: one for a
        single-size run. Resolved settings only (sizes, width, height and batch are numbers)."""
        sizes = [buckets.parse_size(name) for name in self.sizes] or [(self.width, self.height)]
        batches = list(self.bucket_batches) or [self.per_device_batch] * len(sizes)
        if None in sizes[0] or self.sizes == (buckets.PRESET,) or AUTO in batches:
            raise ValueError("the run's sizes and per-device batch are resolved when planning")
        return [(w, h, b) for (w, h), b in zip(sizes, batches)]

    def for_bucket(self, index: int) -> "Settings":
        """The settings of bucket ``index`` as a single-size run's: its size and per-device
        batch. Every bucket's program, images and metadata are that run's."""
        width, height, batch = self.buckets()[index]
        return self.replace(width=width, height=height, per_device_batch=batch, sizes=(), bucket_batches=())

    def _validate_scores(self) -> None:
        """The scores, their models and the filters: each asked for by what reads it."""
        if tuple(self.scores) != parse_scores(",".join(self.scores)):
            raise ValueError(f"--score must list some of {', '.join(SCORES)}, got {','.join(self.scores)!r}")
        wanted = {"clip_model": ("clip", "aesthetic"), "aesthetic_head": ("aesthetic",), "safety_checker": ("safety",)}
        flags = {"clip_model": "--clip-model", "aesthetic_head": "--aesthetic-head",
                 "safety_checker": "--safety-checker"}
        for name, readers in wanted.items():
            if getattr(self, name) is not None and not set(readers) & set(self.scores):
                raise ValueError(f"{flags[name]} is read only by --score {' or '.join(readers)}, which the run does "
                                 f"not compute ({'--score ' + ','.join(self.scores) if self.scores else 'no --score'})")
        if set(self.scores) & {"clip", "aesthetic"} and not self.clip_model:
            what = " and ".join(s for s in ("clip", "aesthetic") if s in self.scores)
            raise ValueError(f"--score {what} needs --clip-model: a CLIP checkpoint in transformers' format (a "
                             f"local folder, gs://, a hub id such as openai/clip-vit-large-patch14, or a built-in "
                             f"random one)")
        if "aesthetic" in self.scores and not self.aesthetic_head:
            raise ValueError("--score aesthetic needs --aesthetic-head: LAION's improved aesthetic predictor as a "
                             "safetensors file (docs/scores.md says how to make it)")
        for name, score in (("min_clip_similarity", "clip"), ("min_aesthetic", "aesthetic")):
            value = getattr(self, name)
            if value is None:
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number, got {value!r}")
            if score not in self.scores:
                raise ValueError(f"{flag} filters on the {score} score, which the run does not compute: add "
                                 f"--score {','.join(parse_scores(','.join((*self.scores, score))))}")
        if self.min_clip_similarity is not None and not -1 <= self.min_clip_similarity <= 1:
            raise ValueError(f"--min-clip-similarity is a cosine, in [-1, 1], got {self.min_clip_similarity}")
        if self.drop_nsfw not in (True, False):
            raise ValueError(f"drop_nsfw must be true or false, got {self.drop_nsfw!r}")
        if self.drop_nsfw and "safety" not in self.scores:
            raise ValueError(f"--drop-nsfw filters on the safety checker's decision, which the run does not "
                             f"compute: add --score {','.join(parse_scores(','.join((*self.scores, 'safety'))))}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Settings":
        """Settings from ``run.json``'s ``settings``, as this version writes them (a run.json of
        another settings version is refused before: ``pipeline.io.runs``): a name this version
        does not know is an error, since ignoring it could change the run's outputs; one left
        out (a document written by hand) takes its default."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown run setting(s) {', '.join(unknown)}: the run was planned by another "
                             f"promptmill version")
        values = dict(data)
        for name in ("formats", "loras", "scores", "sizes", "bucket_batches"):  # JSON has lists
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


AUTO = "auto"  # --per-device-batch auto, --batches-per-slice auto, ...


def parse_lora(spec: str) -> tuple[str, float]:
    """``PATH[@SCALE]`` (``--lora``) -> (PATH, SCALE), SCALE 1.0 when left out; ValueError
    naming a bad spec. SCALE is what follows the last '@', unless that holds a '/' (an '@'
    in a folder's name); a file whose own name has an '@' takes an explicit ``@SCALE``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--lora takes PATH[@SCALE], got {spec!r}")
    path, at, tail = spec.rpartition("@")
    if not at or "/" in tail:
        return spec, 1.0
    try:
        scale = float(tail)
    except ValueError:
        raise ValueError(f"--lora {spec}: the scale after '@' must be a number, got {tail!r} (a file whose name "
                         f"holds '@' takes an explicit scale: {spec}@1.0)") from None
    if not math.isfinite(scale):
        raise ValueError(f"--lora {spec}: the scale must be finite, got {tail!r}")
    if not path:
        raise ValueError(f"--lora {spec}: no path before '@'")
    return path, scale


def lora_spec(path: str, scale: float = 1.0) -> str:
    """The canonical ``PATH@SCALE`` that ``parse_lora`` reads back."""
    return f"{path}@{float(scale)!r}"


def check_size(name: str, value: int, multiple: int = 1) -> int:
    """``value`` if a positive whole number of pixels (of ``multiple``) up to ``MAX_SIZE``, else ValueError;
    a run's sizes are checked against its model's unit and largest when planned (``families.size_problem``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < multiple or value % multiple:
        kind = "whole number of pixels" if multiple == 1 else f"multiple of {multiple}"
        raise ValueError(f"--{name} must be a positive {kind}, got {value}")
    if value > MAX_SIZE:
        raise ValueError(f"--{name} must be at most {MAX_SIZE} pixels, got {value}")
    return value


def _check_int(flag: str, value, low: int, high: int, what: str, *also) -> None:
    """ValueError naming ``flag`` and its bounds unless ``value`` is a whole number in
    [low, high] (or one of ``also``)."""
    if value in also and isinstance(value, str):
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{flag} must be a whole number from {low} to {high} ({what}), got {value!r}")


# Bounds of the run settings that no family changes (the family's own are ``Described``'s)
MAX_STEPS = 1000  # the training schedules' timesteps: more steps only repeat them
MAX_SIZE = 8192  # pixels each way; each family has its own, lower, maximum
MAX_PER_DEVICE_BATCH = 256
MAX_BATCHES_PER_SLICE = 4096
MAX_DEVICES_PER_HOST = 64
MAX_DEVICE_MEMORY = 4096  # GiB


# The version of the settings' meaning that run.json records (``Run.settings_version``): a run
# of another is refused, never carried (``pipeline.io.runs``). 2: guidance rules registered by
# families; no earlier run's guidance, filter, key-name or attention modes.
SETTINGS_VERSION = 2
MAX_SEQUENCE_LENGTH = 512  # the longest text sequence any family takes; each family may allow less


def fingerprint(settings: Settings, model_fingerprint: str, scorers: dict | None = None) -> str:
    """Hash of everything that decides the bytes of the outputs. ``scorers``: the
    fingerprints of the scorer models the run reads ({"clip", "aesthetic", "safety"}: what
    ``Run.scorers`` holds); they stand in for the settings naming where those models are,
    as ``model_fingerprint`` stands in for the model's path."""
    decisive = settings.to_dict()
    decisive.pop("out")
    for name in ("clip_model", "aesthetic_head", "safety_checker"):
        decisive.pop(name)  # where a scorer model is does not matter: its bytes are in ``scorers``
    decisive.pop("unet")  # where the --unet file is does not matter: its bytes are in the model fingerprint
    decisive.pop("device_memory")  # it only chose per_device_batch, which is here
    decisive.pop("loras")  # likewise the --lora files: their bytes and scales are in the model fingerprint
    decisive["model"] = model_fingerprint
    if scorers:
        decisive["scorers"] = dict(sorted(scorers.items()))
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Lora:
    """One ``--lora`` of a planned run: the path as given, its scale, and the sha256 of its
    file's bytes (which, with the scale, the model fingerprint pins)."""
    path: str
    scale: float
    sha256: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Run:
    """``run.json``: a planned run's resolved settings and what pins its outputs' bytes.

    Written once by the plan and read back by every later stage (``pipeline.io.runs``).
    ``created_at`` is when the run was first planned: metadata rows carry it, so a
    redone slice gets the same bytes.
    """
    settings: Settings
    model_fingerprint: str
    settings_fingerprint: str
    created_at: str
    versions: tuple[tuple[str, str], ...] = ()  # (package, version), sorted
    loras: tuple[Lora, ...] = ()  # the settings' --lora files, in order, with their sha256
    license: str | None = None  # the licence the checkpoint states (its model card), if any
    # with --fsdp > 1: where each component's weights live ({component: {weights_gib, placement}},
    # ``pipeline.generate.sharding``'s rule), as the plan found it
    sharding: dict | None = None
    # the scorer models' fingerprints, by score ("clip" for clip and aesthetic's CLIP, "aesthetic"
    # for the head, "safety" for the checker): (score, fingerprint), sorted
    scorers: tuple[tuple[str, str], ...] = ()
    # the fingerprint of the environment its images are made in (OUT/environment.json,
    # ``pipeline.generate.environment``): set by the hosts once they have checked it, written
    # into every metadata row; not part of run.json
    environment: str = ""
    # the output layout the run was made with (``naming.LAYOUT``; a run.json without one: 1)
    layout: int = naming.LAYOUT
    # the version of its settings' meaning (``SETTINGS_VERSION``; a run.json without one: 1)
    settings_version: int = SETTINGS_VERSION

    def __post_init__(self):
        asked = [parse_lora(spec) for spec in self.settings.loras]
        recorded = [(lora.path, lora.scale) for lora in self.loras]
        if asked != recorded:
            raise ValueError(f"run.json records the LoRA adapters {recorded}, but its settings ask for {asked}")
        needed = set(scorer_models(self.settings))
        if needed != {name for name, _ in self.scorers}:
            raise ValueError(f"run.json records scorer models {sorted(name for name, _ in self.scorers)}, but its "
                             f"settings read {sorted(needed)} (--score {','.join(self.settings.scores)})")

    @classmethod
    def create(cls, settings: Settings, model_fingerprint: str, created_at: str, versions: dict, *,
               loras: tuple[Lora, ...] = (), license: str | None = None, sharding: dict | None = None,
               scorers: dict | None = None) -> "Run":
        scorers = dict(scorers or {})
        return cls(settings, model_fingerprint, fingerprint(settings, model_fingerprint, scorers), created_at,
                   tuple(sorted(versions.items())), tuple(loras), license, sharding, tuple(sorted(scorers.items())))

    def fingerprint_of(self, settings: Settings) -> str:
        """The settings fingerprint ``settings`` would have with this run's model and scorer models."""
        return fingerprint(settings, self.model_fingerprint, dict(self.scorers))

    def with_settings(self, settings: Settings) -> "Run":
        """The same run with ``settings`` (a plan's decision) and their fingerprint."""
        return dataclasses.replace(self, settings=settings, settings_fingerprint=self.fingerprint_of(settings))

    @property
    def scheduler(self) -> str | None:
        return self.settings.scheduler

    def to_dict(self) -> dict:
        return {"settings": self.settings.to_dict(), "model_fingerprint": self.model_fingerprint,
                "scheduler": self.settings.scheduler, "settings_fingerprint": self.settings_fingerprint,
                "versions": dict(self.versions), "created_at": self.created_at,
                "loras": [lora.to_dict() for lora in self.loras], "scorers": dict(self.scorers),
                "layout": self.layout, "settings_version": self.settings_version,
                **({"license": self.license} if self.license is not None else {}),
                **({"sharding": self.sharding} if self.sharding is not None else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "Run":
        """A run from its ``run.json`` document (``pipeline.io.runs`` refuses one of another
        layout or settings version first)."""
        settings = Settings.from_dict(data["settings"])
        if data.get("scheduler") not in (None, settings.scheduler):
            raise ValueError(f"run.json names scheduler {data['scheduler']!r} but its settings say "
                             f"{settings.scheduler!r}")
        scorers = data.get("scorers") or {}
        return cls(settings=settings, model_fingerprint=data["model_fingerprint"],
                   settings_fingerprint=data.get("settings_fingerprint") or fingerprint(
                       settings, data["model_fingerprint"], scorers),
                   created_at=data["created_at"], versions=tuple(sorted(data.get("versions", {}).items())),
                   loras=tuple(Lora(**lora) for lora in data.get("loras", ())), license=data.get("license"),
                   sharding=data.get("sharding"), scorers=tuple(sorted(scorers.items())),
                   layout=data.get("layout", 1), settings_version=data.get("settings_version", 1))


def scorer_models(settings: Settings) -> tuple[str, ...]:
    """The scorer models a run reads, by the name ``Run.scorers`` records them under:
    "clip" (clip or aesthetic), "aesthetic" (the head), "safety" (the checker)."""
    scores = set(settings.scores)
    return tuple(name for name, needs in (("clip", {"clip", "aesthetic"}), ("aesthetic", {"aesthetic"}),
                                          ("safety", {"safety"})) if scores & needs)


def guided_by_records_line(asked: dict) -> str:
    """The one line for people when records asking for guidance made a run guided whose
    own --guidance-scale does not ask for it (pure): ``asked`` is the manifest's
    ``guided_by_records``, {"records": N, "first": "SOURCE line L"}."""
    return (f"{asked['records']} record(s) ask for guidance (the first: {asked['first']}) while the run's own "
            f"--guidance-scale does not: the whole run is guided and pays for classifier-free guidance on every "
            f"image (about twice the denoiser's work)")
