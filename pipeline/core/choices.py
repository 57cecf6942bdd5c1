"""The closed sets of values a run setting may take, as plain data.

``Settings`` validates against these tables and the CLI offers them as choices; the
stages that act on a choice (the model loader, the output writers) read them from
here too, so the three can never disagree.
"""
from __future__ import annotations

# --dtype choices -> the jax.numpy dtype name of the networks' weights and compute
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

# --scheduler choices -> what each is (promptmill's own steps run them all:
# pipeline.model.sampling.schedules, as diffusers' PyTorch scheduler of that name)
SCHEDULERS = {
    "ddim": "DDIM (DDIMScheduler)",
    "pndm": "PNDM/PLMS (PNDMScheduler; SD 1.x's own)",
    "euler": "Euler (EulerDiscreteScheduler; SDXL's own)",
    "dpmpp": "DPM-Solver++ of order 2 (DPMSolverMultistepScheduler)",
    "euler_a": "Euler ancestral (EulerAncestralDiscreteScheduler: SD-Turbo, SDXL-Turbo)",
    "lcm": "LCM multistep (LCMScheduler: LCM and LCM-LoRA models)",
    "flow_euler": "flow-matching Euler (FlowMatchEulerDiscreteScheduler: FLUX.1, FLUX.2, Z-Image)",
}
FLOW_SCHEDULERS = ("flow_euler",)  # the rectified-flow families' samplers

# --attention choices: how every network's attention runs (pipeline.model.layers.attention)
ATTENTIONS = ("auto", "xla", "chunked", "flash")

# --timestep-spacing choices (None: the checkpoint's own)
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")

# --format choices, in canonical order
FORMATS = ("files", "webdataset", "parquet", "zarr")

# --score choices, in canonical order: what the scorers compute on the devices that made the
# images (pipeline.generate.scoring), and the metadata columns each one fills
SCORES = ("clip", "aesthetic", "safety")
SCORE_COLUMNS = {"clip": ("clip_similarity",), "aesthetic": ("aesthetic",), "safety": ("nsfw", "nsfw_score")}

# --image-format choices -> (PIL format name, file extension)
IMAGE_FORMATS = {"png": ("PNG", "png"), "jpeg": ("JPEG", "jpg"), "webp": ("WEBP", "webp")}


def parse_formats(text: str) -> tuple[str, ...]:
    """``"files,zarr"`` -> ("files", "zarr"), validated, in canonical order."""
    chosen = {part.strip() for part in text.split(",") if part.strip()}
    unknown = chosen - set(FORMATS)
    if unknown or not chosen:
        raise ValueError(f"--format takes a comma-separated subset of {', '.join(FORMATS)}, got {text!r}")
    return tuple(f for f in FORMATS if f in chosen)


def parse_scores(text: str) -> tuple[str, ...]:
    """``"safety,clip"`` -> ("clip", "safety"), validated, in canonical order; "" -> ()."""
    chosen = {part.strip() for part in text.split(",") if part.strip()}
    unknown = chosen - set(SCORES)
    if unknown:
        raise ValueError(f"--score takes a comma-separated subset of {', '.join(SCORES)}, got {text!r}")
    return tuple(s for s in SCORES if s in chosen)
