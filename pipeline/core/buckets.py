"""Aspect-ratio buckets: the sizes of one run, and which a record asks for (pure functions).

A run declares its buckets with ``--sizes WxH[,WxH...]`` (``Settings.sizes``), or the
``common`` preset: the one-megapixel set that SDXL, FLUX and Z-Image train on, scaled to
the family's native area and rounded to its size multiple. The first size is the default.

When a run declares sizes, a record may ask for one: by ``width`` and ``height`` (they must
be one of the buckets), or by ``aspect_ratio`` ("3:4" is width:height, "16:9", or a
number), assigned to the bucket nearest by |log ratio|, ties to the earlier bucket; a
record that asks for nothing gets the default. Without sizes these fields are not read:
they pass through to the metadata (LAION-style inputs describe a source image with them).

Every slice holds one bucket. The plan orders buckets as declared: bucket ``b``'s images
take the global positions ``[offset_b, offset_b + images_b)`` and its slices the indices
``[first_slice_b, first_slice_b + slices_b)`` (``Geometry``).
"""
from __future__ import annotations

import dataclasses
import math
import re

from pipeline.core import numbers

PRESET = "common"
# (width, height) of the common one-megapixel buckets, square first
COMMON = ((1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768), (768, 1344),
          (1536, 640), (640, 1536))
COMMON_AREA = 1024 * 1024
MAX_BUCKETS = 64
_SIZE = re.compile(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*")
_RATIO = re.compile(r"\s*(\d+(?:\.\d+)?)\s*[:/]\s*(\d+(?:\.\d+)?)\s*")
RECORD_FIELDS = ("width", "height", "aspect_ratio")  # what a record may ask a run with sizes for


class BadSize(ValueError):
    """A record's size request that no bucket answers: ``reason`` is the reject's code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def size_name(width: int, height: int) -> str:
    return f"{int(width)}x{int(height)}"


def parse_size(text: str) -> tuple[int, int]:
    """``"832x1216"`` -> (832, 1216); ValueError otherwise (the sizes' own bounds are the
    settings' and the family's)."""
    found = _SIZE.fullmatch(str(text))
    if not found:
        raise ValueError(f"a size is WIDTHxHEIGHT in pixels, e.g. 832x1216, got {text!r}")
    return int(found.group(1)), int(found.group(2))


def parse_sizes(text: str) -> tuple[str, ...]:
    """``--sizes``: ``common``, or WxH[,WxH...] -> canonical names; ValueError naming a bad
    or repeated size."""
    parts = [part.strip() for part in str(text).split(",")]
    if not any(parts):
        raise ValueError("--sizes takes WxH[,WxH...] or common, got nothing")
    if not all(parts):
        raise ValueError(f"--sizes {text!r} has an empty size between its commas; give WxH[,WxH...]")
    if parts == [PRESET]:
        return (PRESET,)
    names = tuple(size_name(*parse_size(part)) for part in parts)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--sizes names {', '.join(repeated)} more than once")
    if len(names) > MAX_BUCKETS:
        raise ValueError(f"--sizes takes at most {MAX_BUCKETS} sizes, got {len(names)}")
    return names


def preset_sizes(native_size: int, multiple: int) -> tuple[str, ...]:
    """The common buckets scaled to the area of ``native_size`` squared and rounded to
    ``multiple`` (each side at least one multiple); sizes that round alike kept once."""
    scale = native_size / math.sqrt(COMMON_AREA)
    names: list[str] = []
    for width, height in COMMON:
        w, h = (max(multiple, round(side * scale / multiple) * multiple) for side in (width, height))
        if size_name(w, h) not in names:
            names.append(size_name(w, h))
    return tuple(names)


def parse_aspect_ratio(value) -> float:
    """A record's ``aspect_ratio`` (width / height): "3:4", "16/9", or a positive number;
    BadSize otherwise."""
    ratio = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        ratio = float(value)
    elif isinstance(value, str):
        found = _RATIO.fullmatch(value)
        if found:
            w, h = float(found.group(1)), float(found.group(2))
            ratio = w / h if h else None
        else:
            try:
                ratio = float(value)
            except ValueError:
                ratio = None
    if ratio is None or not math.isfinite(ratio) or ratio <= 0:
        raise BadSize("bad_aspect_ratio", f"'aspect_ratio' is width:height (\"3:4\", \"16:9\") or a positive "
                                          f"number, got {value!r}")
    return ratio


def nearest(ratio: float, sizes: tuple[str, ...]) -> int:
    """The bucket whose width/height is nearest ``ratio`` by |log ratio|; ties go to the
    earlier bucket."""
    distances = [abs(math.log(ratio) - math.log(w / h)) for w, h in map(parse_size, sizes)]
    best = min(distances)
    return next(i for i, d in enumerate(distances) if d <= best + 1e-12)


def _whole(row: dict, name: str):
    value = numbers.whole(row[name])
    if value is None:
        raise BadSize("bad_size", f"'{name}' must be a whole number of pixels, got {row[name]!r}")
    return value


def assign(row: dict, sizes: tuple[str, ...]) -> tuple[int, str]:
    """(bucket index, how it was chosen: "size", "aspect_ratio" or "default") of a row of a
    run with ``sizes``; BadSize with the reject's reason when no bucket answers it."""
    has = [name for name in RECORD_FIELDS if row.get(name) is not None]
    if "width" in has or "height" in has:
        if not {"width", "height"} <= set(has):
            given = "width" if "width" in has else "height"
            raise BadSize("bad_size", f"the row gives '{given}' alone: a size needs both width and height")
        name = size_name(_whole(row, "width"), _whole(row, "height"))
        if name not in sizes:
            raise BadSize("size_not_a_bucket", f"{name} is not one of the run's sizes ({', '.join(sizes)})")
        index = sizes.index(name)
        if "aspect_ratio" in has and nearest(parse_aspect_ratio(row["aspect_ratio"]), sizes) != index:
            raise BadSize("conflicting_size", f"the row asks for {name} and for aspect_ratio "
                                              f"{row['aspect_ratio']!r}, which is nearest another size "
                                              f"({sizes[nearest(parse_aspect_ratio(row['aspect_ratio']), sizes)]})")
        return index, "size"
    if "aspect_ratio" in has:
        return nearest(parse_aspect_ratio(row["aspect_ratio"]), sizes), "aspect_ratio"
    return 0, "default"


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One size of a run and where its images and slices are in the plan."""
    width: int
    height: int
    per_device_batch: int
    slice_size: int
    images: int = 0
    records: int = 0
    offset: int = 0  # its first image's global position
    first_slice: int = 0

    @property
    def name(self) -> str:
        return size_name(self.width, self.height)

    @property
    def slices(self) -> int:
        return math.ceil(self.images / self.slice_size) if self.images else 0

    def to_json(self) -> dict:
        return {"size": self.name, "width": self.width, "height": self.height,
                "per_device_batch": self.per_device_batch, "slice_size": self.slice_size, "records": self.records,
                "images": self.images, "offset": self.offset, "first_slice": self.first_slice,
                "slices": self.slices}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The buckets of a plan, in order, with their positions and slices."""
    buckets: tuple[Bucket, ...]

    @classmethod
    def lay_out(cls, sizes: list[tuple[int, int]], batches: list[int], slice_sizes: list[int],
                images: list[int], records: list[int] | None = None) -> "Geometry":
        """Buckets in order, each after the last: offsets and first slices accumulated."""
        out, offset, first = [], 0, 0
        for b, ((w, h), batch, size, n) in enumerate(zip(sizes, batches, slice_sizes, images)):
            bucket = Bucket(w, h, batch, size, n, (records or [0] * len(sizes))[b], offset, first)
            out.append(bucket)
            offset, first = offset + n, first + bucket.slices
        return cls(tuple(out))

    @classmethod
    def of_manifest(cls, manifest: dict, width: int, height: int, per_device_batch: int) -> "Geometry":
        """A plan's geometry: its manifest's ``buckets``, or a single-size plan's one bucket."""
        if manifest.get("buckets"):
            return cls(tuple(Bucket(b["width"], b["height"], b["per_device_batch"], b["slice_size"], b["images"],
                                    b["records"], b["offset"], b["first_slice"]) for b in manifest["buckets"]))
        return cls((Bucket(width, height, per_device_batch, manifest["slice_size"], manifest["images"],
                           manifest.get("records", 0)),))

    @property
    def slices(self) -> int:
        return sum(b.slices for b in self.buckets)

    def bucket_of_slice(self, index: int) -> int:
        for b, bucket in enumerate(self.buckets):
            if bucket.first_slice <= index < bucket.first_slice + bucket.slices:
                return b
        raise ValueError(f"slice {index} is not in the plan ({self.slices} slices)")

    def slice_span(self, index: int) -> tuple[int, int]:
        """[start, stop) global positions of slice ``index`` (the last of a bucket may hold fewer)."""
        b = self.buckets[self.bucket_of_slice(index)]
        start = b.offset + (index - b.first_slice) * b.slice_size
        return start, min(start + b.slice_size, b.offset + b.images)

    def slice_images(self, index: int) -> int:
        start, stop = self.slice_span(index)
        return stop - start


def host_slots(host: int, num_hosts: int, geometry: Geometry) -> list[tuple[int, int | None]]:
    """(bucket, slice or None for a padding slot) that host ``host`` runs, in order: each
    bucket's slices round-robin over the hosts, each bucket padded to the same number of
    slots on every host, so the hosts walk the buckets in one order and in lockstep."""
    from pipeline.core import slicing

    slots = []
    for b, bucket in enumerate(geometry.buckets):
        for slot in slicing.host_slots(host, num_hosts, bucket.slices):
            slots.append((b, None if slot is None else bucket.first_slice + slot))
    return slots


def sizes_to_make(host: int, num_hosts: int, geometry: Geometry, committed) -> tuple[int, ...]:
    """The buckets whose programs host ``host`` needs, in order: those it has a slot of that
    is a padding slot or a slice not in ``committed`` (a resumed run's committed slices are
    skipped). A bucket no record asked for, or whose every slice of this host is committed,
    needs none (pure)."""
    return tuple(sorted({b for b, slot in host_slots(host, num_hosts, geometry)
                         if slot is None or slot not in committed}))


def manifest_slice_images(manifest: dict, index: int) -> int:
    """Images in slice ``index`` of a plan, from its manifest: its size's slice size, the
    last slice of each size the remainder (pure)."""
    return Geometry.of_manifest(manifest, 0, 0, 0).slice_images(index)


def planned_sizes(manifest: dict) -> dict:
    """For a ``planned`` event: {"sizes": {size: {records, images, slices, per_device_batch}}}
    of a plan of several sizes, {} of a single-size plan (pure)."""
    if not manifest.get("buckets"):
        return {}
    return {"sizes": {b["size"]: {k: b[k] for k in ("records", "images", "slices", "per_device_batch")}
                      for b in manifest["buckets"]}}
