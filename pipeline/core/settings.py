"""The one settings object of a run.

CLI flags and Beam options are translated into ``Settings``; nothing else is a source
of truth. ``run.json`` holds the resolved settings, and every later stage reads them
from there.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from pipeline.core import keys
from pipeline.core import slicing
from pipeline.core.choices import DTYPES, FORMATS, IMAGE_FORMATS, SCHEDULERS, parse_formats


@dataclasses.dataclass(frozen=True)
class Settings:
    prompts: str = "examples/prompts.jsonl"
    out: str = "promptmill-out"
    model: str = "tiny"
    width: int | None = None  # None: the model's native size
    height: int | None = None
    steps: int = 20
    scheduler: str | None = None  # None: the checkpoint's own (resolved when planning)
    guidance_scale: float = 7.5
    seed: int = 0  # the run seed, hashed with a record's id when it has no seed
    per_device_batch: int = 1
    batches_per_slice: int = 2
    devices_per_host: int = 1
    dtype: str = "fp32"
    formats: tuple[str, ...] = ("files",)
    image_format: str = "png"
    quality: int = 95  # jpeg and webp
    save_latents: bool = False  # zarr: also OUT/zarr/latents, the final latents before VAE decoding
    prompt_field: str = "prompt"  # the prompt's column / key in jsonl, json, csv, tsv and parquet inputs
    dedupe: bool = False  # plan: a record whose prompt an earlier record has is rejected (duplicate_prompt)

    @property
    def slice_size(self) -> int:
        return slicing.slice_size(self.devices_per_host, self.per_device_batch, self.batches_per_slice)

    def validate(self) -> "Settings":
        """Return self, or raise ValueError naming the bad setting."""
        for name in ("width", "height"):
            value = getattr(self, name)
            if value is not None and (value < 8 or value % 8):
                raise ValueError(f"--{name} must be a positive multiple of 8, got {value}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
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
        if not isinstance(self.prompt_field, str) or not self.prompt_field:
            raise ValueError(f"--prompt-field must be a non-empty name, got {self.prompt_field!r}")
        self.slice_size  # validates the three slice factors
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Settings":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        if "formats" in values:  # JSON has lists
            values["formats"] = tuple(values["formats"])
        return cls(**values)

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


# Settings added after runs were first planned, with the value those runs had.
_NEWER_SETTINGS = {"save_latents": False, "prompt_field": "prompt", "dedupe": False}


def fingerprint(settings: Settings, model_fingerprint: str) -> str:
    """Hash of everything that decides the bytes of the outputs."""
    decisive = settings.to_dict()
    decisive.pop("out")
    for name, default in _NEWER_SETTINGS.items():  # runs planned before a setting existed keep their fingerprint
        if decisive[name] == default:
            decisive.pop(name)
    decisive["model"] = model_fingerprint
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()
