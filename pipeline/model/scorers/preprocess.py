"""CLIP's image preprocessing, done on the devices: uint8 images in, the model's pixels out.

transformers' ``CLIPImageProcessor`` resizes the shorter side with PIL (bicubic by
default), takes a centre crop, rescales by 1/255 and normalises with CLIP's mean and
std. Scores are meant to be the ones a user gets from that processor on the written
images, so the resize here is PIL's, step for step: PIL resamples in two separable
passes (horizontal, then vertical), each a sum over a few source pixels with integer
weights of 22 fractional bits, rounded and clipped to uint8 (Pillow's
``libImaging/Resample.c``). The weights are computed on the host as PIL computes them
(``pil_weights``) and applied on the device as int32 matrix products, which are exact,
so the device's resized image equals PIL's byte for byte (a test checks it against PIL
for many sizes). Everything after the resize is float32 arithmetic, as in transformers.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' defaults for CLIP processors
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PRECISION_BITS = 32 - 8 - 2  # PIL's fixed point for 8-bit images


def _bicubic(x: float) -> float:
    a = -0.5  # PIL's (and Keys') cubic convolution parameter
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _bilinear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _box(x: float) -> float:
    return 1.0 if -0.5 < x <= 0.5 else 0.0


def _hamming(x: float) -> float:
    x = abs(x)
    if x == 0.0:
        return 1.0
    if x >= 1.0:
        return 0.0
    x *= math.pi
    return math.sin(x) / x * (0.54 + 0.46 * math.cos(x))


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x *= math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    return _sinc(x) * _sinc(x / 3) if -3.0 <= x < 3.0 else 0.0


# PIL's resampling filters by their ``Image.Resampling`` number: (filter, support)
FILTERS = {1: (_lanczos, 3.0), 2: (_bilinear, 1.0), 3: (_bicubic, 2.0), 4: (_box, 0.5), 5: (_hamming, 1.0)}
FILTER_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def pil_weights(in_size: int, out_size: int, resample: int = 3) -> np.ndarray:
    """int32 [out_size, in_size]: PIL's fixed-point weights for resizing one axis of
    ``in_size`` pixels to ``out_size`` with filter ``resample`` (antialiased when
    shrinking: the filter is stretched by the scale), as Pillow's ``precompute_coeffs``
    and ``normalize_coeffs_8bpc`` compute them."""
    if resample not in FILTERS:
        raise ValueError(f"resampling filter {FILTER_NAMES.get(resample, resample)} is not supported "
                         f"(supported: {', '.join(FILTER_NAMES[k] for k in FILTERS)})")
    kernel, support = FILTERS[resample]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = support * filterscale
    ss = 1.0 / filterscale
    weights = np.zeros((out_size, in_size), np.int32)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)  # C's (int) truncates toward zero
        xmax = min(int(center + support + 0.5), in_size) - xmin
        taps = [kernel((x + xmin - center + 0.5) * ss) for x in range(xmax)]
        total = sum(taps)
        for x, w in enumerate(taps):
            w = w / total if total != 0.0 else w
            fixed = w * (1 << PRECISION_BITS)
            weights[xx, x + xmin] = int(fixed - 0.5) if w < 0 else int(fixed + 0.5)
    return weights


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """What ``CLIPImageProcessor`` does to an image, from its ``preprocessor_config.json``."""
    shortest_edge: int | None  # resize the shorter side to this, keeping the aspect ratio
    resize_to: tuple[int, int] | None  # or resize to exactly (height, width)
    resample: int  # PIL's filter number (3: bicubic)
    crop: tuple[int, int] | None  # centre crop (height, width)
    rescale_factor: float | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize, as transformers' ``get_resize_output_image_size``."""
        if self.resize_to is not None:
            return self.resize_to
        if self.shortest_edge is None:
            return height, width
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        return self.crop if self.crop is not None else self.resized_size(height, width)


def _size_dict(value, square: bool) -> dict:
    """transformers' ``get_size_dict`` for the forms preprocessor configs use."""
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": int(value[0]), "width": int(value[1])}
    if isinstance(value, dict):
        return value
    raise ValueError(f"size {value!r} is not a size transformers' CLIP processor reads")


def from_config(config: dict, image_size: int) -> Preprocessing:
    """The preprocessing a ``preprocessor_config.json`` describes (``config``; {} for a
    model without one: CLIP's defaults at the vision model's ``image_size``)."""
    size = _size_dict(config.get("size", {"shortest_edge": image_size}), square=False)
    crop = _size_dict(config.get("crop_size", {"height": image_size, "width": image_size}), square=True)
    shortest = resize_to = None
    if config.get("do_resize", True):
        if "shortest_edge" in size:
            shortest = int(size["shortest_edge"])
        elif "height" in size and "width" in size:
            resize_to = (int(size["height"]), int(size["width"]))
        else:
            raise ValueError(f"size {size!r} has neither shortest_edge nor height and width")
    mean = tuple(config.get("image_mean") or OPENAI_CLIP_MEAN)
    std = tuple(config.get("image_std") or OPENAI_CLIP_STD)
    return Preprocessing(
        shortest_edge=shortest, resize_to=resize_to, resample=int(config.get("resample", 3)),
        crop=(int(crop["height"]), int(crop["width"])) if config.get("do_center_crop", True) else None,
        rescale_factor=float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None,
        mean=mean if config.get("do_normalize", True) else None, std=std if config.get("do_normalize", True) else None)


def read(folder: str, image_size: int, fallbacks: tuple[str, ...] = ()) -> tuple[Preprocessing, str | None]:
    """(the preprocessing of a model folder, the config file it came from or None): its
    ``preprocessor_config.json``, else the first of ``fallbacks`` (paths) that exists,
    else CLIP's defaults at ``image_size``."""
    for path in (os.path.join(folder, "preprocessor_config.json"), *fallbacks):
        if os.path.isfile(path):
            with open(path) as f:
                return from_config(json.load(f), image_size), path
    return from_config({}, image_size), None


def check(pre: Preprocessing, image_size: int, height: int, width: int, where: str) -> None:
    """ValueError naming ``where`` unless images of ``height`` x ``width`` come out of
    ``pre`` at the model's ``image_size`` square, without padding."""
    if pre.resample not in FILTERS:
        raise ValueError(f"{where}: its resampling filter {FILTER_NAMES.get(pre.resample, pre.resample)} is not "
                         f"supported (supported: {', '.join(FILTER_NAMES[k] for k in FILTERS)})")
    resized = pre.resized_size(height, width)
    out = pre.output_size(height, width)
    if out != (image_size, image_size):
        raise ValueError(f"{where}: {width}x{height} images come out of its preprocessing at {out[1]}x{out[0]}, "
                         f"but the model takes {image_size}x{image_size}")
    if pre.crop is not None and (pre.crop[0] > resized[0] or pre.crop[1] > resized[1]):
        raise ValueError(f"{where}: its centre crop {pre.crop[1]}x{pre.crop[0]} is larger than the resized "
                         f"{resized[1]}x{resized[0]} image (padding is not supported)")


def _resample(images, weights: np.ndarray, axis: int):
    """One PIL pass along ``axis`` (1: rows' height, 2: width) of int32 images [B, H, W, C]."""
    import jax.numpy as jnp
    from jax import lax

    w = jnp.asarray(weights)
    spec = "bhwc,oh->bowc" if axis == 1 else "bhwc,ow->bhoc"
    total = jnp.einsum(spec, images, w, preferred_element_type=jnp.int32, precision=lax.Precision.HIGHEST)
    total = total + (1 << (PRECISION_BITS - 1))
    return jnp.clip(jnp.right_shift(total, PRECISION_BITS), 0, 255)


def resize_uint8(images, height: int, width: int, resample: int = 3):
    """uint8 images [B, H, W, C] -> uint8 [B, height, width, C], as PIL's ``Image.resize``
    (horizontal pass first; a pass whose size does not change is skipped, as PIL skips it)."""
    import jax.numpy as jnp

    in_h, in_w = images.shape[1], images.shape[2]
    out = images.astype(jnp.int32)
    if width != in_w:
        out = _resample(out, pil_weights(in_w, width, resample), axis=2)
    if height != in_h:
        out = _resample(out, pil_weights(in_h, height, resample), axis=1)
    return out.astype(jnp.uint8)


def apply(pre: Preprocessing, images):
    """float32 pixels [B, S, S, 3] (channels last, as the Flax CLIP modules take them) from
    uint8 images [B, H, W, 3]: resize, centre crop, rescale, normalise."""
    import jax.numpy as jnp

    height, width = images.shape[1], images.shape[2]
    rh, rw = pre.resized_size(height, width)
    if (rh, rw) != (height, width):
        images = resize_uint8(images, rh, rw, pre.resample)
    if pre.crop is not None:
        ch, cw = pre.crop
        top, left = (rh - ch) // 2, (rw - cw) // 2  # transformers' center_crop
        images = images[:, top:top + ch, left:left + cw]
    pixels = images.astype(jnp.float32)
    if pre.rescale_factor is not None:
        pixels = pixels * jnp.float32(pre.rescale_factor)
    if pre.mean is not None:
        pixels = (pixels - jnp.asarray(pre.mean, jnp.float32)) / jnp.asarray(pre.std, jnp.float32)
    return pixels
