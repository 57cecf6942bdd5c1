"""What ``promptmill bench generator`` runs: its parts, the recipes and scorers they time, and
``BenchConfig``, the one config every part reads (``command_line`` gives the command back).
"""
from __future__ import annotations

import dataclasses

from pipeline.core.choices import ATTENTIONS, SCHEDULERS, TIMESTEP_SPACINGS
from pipeline.core.decode_batch import DECODE_BATCH
from pipeline.core.settings import check_size

GUIDANCE = 7.5  # SD's default guidance; above 1 its value does not change the work done
PARTS = ("sweep", "recipes", "attention", "memory", "startup", "scoring", "flops", "fsdp", "models")
# the flops part's default recipes (MODEL, steps, guidance): FLUX.1 [schnell] 4 steps and [dev] 28
# steps, beside SDXL-Lightning's 4 guidance-free steps and SDXL's default 20 guided ones
FLOPS_RECIPES = (("random-flux", 4, 0.0), ("random-flux-dev", 28, 3.5), ("random-sdxl", 4, 0.0),
                 ("random-sdxl", 20, 7.5))
# the scoring part's scorers (--scorers): random ones of the real sizes (CLIP ViT-L/14, SD 1.x's
# safety checker, LAION's head), or the tiny ones; built once into the cache like the random models
SCORERS = {"random": dict(scores=("clip", "aesthetic", "safety"), clip_model="random-clip-vit-l-14",
                          aesthetic_head="random-aesthetic", safety_checker="random-safety-checker"),
           "tiny": dict(scores=("clip", "aesthetic", "safety"), clip_model="tiny-clip", aesthetic_head="tiny-aesthetic",
                        safety_checker="tiny-safety-checker")}
# the sweep compares with the seed notebook's recipe, which needs the notebook extra (diffusers)
DEFAULT_PARTS = ("recipes", "startup")
FEW_STEPS = 4  # the few-step recipe's steps (SD-Turbo, SDXL-Turbo, SDXL-Lightning 4-step)
SD_DEFAULT_STEPS = 20  # the default recipe: SD's default steps (the bench compares SD 1.x/2.x checkpoints)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: str = "tiny"
    width: int | None = None  # None: the model's native size
    height: int | None = None
    steps: int = 4
    per_device_batches: tuple[int, ...] = (1,)
    batches: int = 2
    dtype: str = "fp32"
    devices: int | None = None  # None: every local device
    matmul_size: int | None = None  # None: 4096 on CPU, 8192 on accelerators
    report: str | None = None
    guidance_scale: float = GUIDANCE
    parts: tuple[str, ...] = DEFAULT_PARTS  # which parts of the report to run
    scheduler: str | None = None  # None: the checkpoint's own
    timestep_spacing: str | None = None  # None: the checkpoint's own
    # the attention and memory parts: the implementations compared (the first is the
    # reference: "xla", the whole attention matrix) and the memory part's square sizes
    attentions: tuple[str, ...] = ("xla", "auto")
    memory_sizes: tuple[int, ...] = (512, 1024)
    # the flops part: (model, steps, guidance) of each recipe, costed from shapes at width x height
    flops_recipes: tuple[tuple[str, int, float], ...] = FLOPS_RECIPES
    fsdps: tuple[int, ...] = (1, 2)  # the fsdp part: FSDP degrees timed side by side
    # the models part: other models timed side by side with --model, at its size and steps, each
    # at its own default guidance (a guidance-distilled model takes none)
    compare_models: tuple[str, ...] = ()
    # the VAE decode micro-batch of every sampler timed (--decode-batch): a new run's, by default
    decode_batch: int | None = DECODE_BATCH
    scorers: str = "random"  # the scoring part's scorers (SCORERS)
    startup_against: str | None = None  # the startup part: another source tree timed in turns with this one

    def validate(self) -> "BenchConfig":
        if not self.per_device_batches or min(self.per_device_batches) < 1:
            raise ValueError(f"--per-device-batch needs sizes >= 1, got {self.per_device_batches}")
        if self.batches < 1 or self.steps < 1:
            raise ValueError("--batches and --steps must be >= 1")
        if self.decode_batch is not None and self.decode_batch < 1:
            raise ValueError(f"--decode-batch must be >= 1 or whole, got {self.decode_batch}")
        for name in ("width", "height"):
            value = getattr(self, name)
            if value is not None:
                check_size(name, value, 8)  # every family makes multiples of 8 at real sizes
        if not self.parts or set(self.parts) - set(PARTS):
            raise ValueError(f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {self.parts}")
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise ValueError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if not self.attentions or set(self.attentions) - set(ATTENTIONS):
            raise ValueError(f"--attentions takes a comma-separated subset of {', '.join(ATTENTIONS)}, "
                             f"got {self.attentions}")
        if "models" in self.parts and not self.compare_models:
            raise ValueError("--parts models compares --model with --compare-models MODEL[,MODEL...]: give them")
        if self.scorers not in SCORERS:
            raise ValueError(f"--scorers must be one of {', '.join(SCORERS)}, got {self.scorers!r}")
        if not self.memory_sizes:
            raise ValueError("--memory-sizes needs at least one size")
        for size in self.memory_sizes:
            check_size("memory-sizes", size, 8)
        if self.timestep_spacing is not None and self.timestep_spacing not in TIMESTEP_SPACINGS:
            raise ValueError(f"--timestep-spacing must be one of {', '.join(TIMESTEP_SPACINGS)}, "
                             f"got {self.timestep_spacing!r}")
        return self

    @property
    def guided(self) -> bool:
        return self.guidance_scale > 1


def command_line(config: BenchConfig) -> str:
    """The ``promptmill bench generator`` command that runs ``config``."""
    flags = {"--model": config.model, "--width": config.width, "--height": config.height, "--steps": config.steps,
             "--per-device-batch": ",".join(map(str, config.per_device_batches)), "--batches": config.batches,
             "--dtype": config.dtype, "--devices": config.devices, "--matmul-size": config.matmul_size,
             "--guidance-scale": config.guidance_scale, "--scheduler": config.scheduler,
             "--timestep-spacing": config.timestep_spacing,
             "--parts": ",".join(config.parts) if tuple(config.parts) != DEFAULT_PARTS else None,
             "--attentions": ",".join(config.attentions) if {"attention", "memory"} & set(config.parts) else None,
             "--memory-sizes": ",".join(map(str, config.memory_sizes)) if "memory" in config.parts else None,
             "--fsdp": ",".join(map(str, config.fsdps)) if "fsdp" in config.parts else None,
             "--compare-models": ",".join(config.compare_models) if "models" in config.parts else None,
             "--flops-recipes": ",".join(f"{m}:{s}:{g:g}" for m, s, g in config.flops_recipes)
             if "flops" in config.parts and config.flops_recipes != FLOPS_RECIPES else None,
             "--scorers": config.scorers if "scoring" in config.parts and config.scorers != "random" else None,
             "--startup-against": config.startup_against if "startup" in config.parts else None,
             "--decode-batch": None if config.decode_batch == DECODE_BATCH
             else "whole" if config.decode_batch is None else config.decode_batch,
             "--report": config.report}
    return " ".join(["promptmill bench generator"] + [f"{k} {v}" for k, v in flags.items() if v is not None])
