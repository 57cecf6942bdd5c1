"""The score filters (pure): which rule an image fails, and the ``dropped`` reason its
metadata row keeps.

A filter never loses a row: an image that fails one is kept out of every image output
(files, webdataset, parquet, zarr, thumbnails), and its metadata row says why, naming
each rule it failed with the value that failed it, e.g.
``min_clip_similarity: clip_similarity 0.1812 < 0.25``. ``rules_of`` reads the rules
back out of a reason (collect counts dropped images by rule).
"""
from __future__ import annotations

import math

# rule -> (the setting that turns it on, the score it reads); the order of a reason's parts
RULES = {"min_clip_similarity": "clip_similarity", "min_aesthetic": "aesthetic", "drop_nsfw": "nsfw"}
SEPARATOR = "; "


def active_rules(settings) -> tuple[str, ...]:
    """The rules ``settings`` turn on, in ``RULES`` order: a threshold whenever it is set,
    0 and negative ones included; ``drop_nsfw`` when true."""
    return tuple(rule for rule in RULES if (getattr(settings, rule) is True if rule == "drop_nsfw"
                                            else getattr(settings, rule) is not None))


def _number(value: float) -> str:
    return f"{value:.6g}"


def failed(settings, scores: dict) -> list[str]:
    """Each rule of ``settings`` the image with ``scores`` ({column: value}) fails, as
    "RULE: what failed it", in ``RULES`` order. A minimum keeps scores >= it; a missing
    or NaN score fails its rule (it could not be shown to pass)."""
    parts = []
    for rule in active_rules(settings):
        column = RULES[rule]
        value = scores.get(column)
        if rule == "drop_nsfw":
            if value is None or bool(value):
                score = scores.get("nsfw_score")
                shown = "" if score is None else f" (nsfw_score {_number(float(score))})"
                parts.append(f"{rule}: flagged by the safety checker{shown}")
            continue
        threshold = float(getattr(settings, rule))
        if value is None or math.isnan(float(value)) or float(value) < threshold:
            shown = "missing" if value is None else _number(float(value))
            parts.append(f"{rule}: {column} {shown} < {_number(threshold)}")
    return parts


def dropped_reason(settings, scores: dict) -> str | None:
    """The ``dropped`` column of an image: None if it passes every filter, else the rules
    it fails (``failed``) joined by ``SEPARATOR``."""
    parts = failed(settings, scores)
    return SEPARATOR.join(parts) if parts else None


def rules_of(reason: str | None) -> list[str]:
    """The rules named by a ``dropped`` reason (``dropped_reason``), in order."""
    if not reason:
        return []
    return [part.split(":", 1)[0].strip() for part in reason.split(SEPARATOR)]
