"""Input rows to records, or to rejects with a reason (pure functions).

A row needs a non-empty string ``prompt`` (or whatever field ``prompt_field`` names).
Optional: ``id``, ``seed``, ``negative_prompt``, ``num_images``, ``guidance_scale``; any
other field passes through to the metadata. Numbers may be given as numeric strings
(``"3"``, ``"7.5"``), as CSV and TSV cells always are. A record without ``id`` gets ``<source relative to the input root>:<line>``;
a record without ``seed`` gets a stable hash of (run seed, id).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import unicodedata

from pipeline.core import buckets, keys, naming, numbers

KNOWN_FIELDS = ("id", "prompt", "negative_prompt", "seed", "num_images", "guidance_scale")
MAX_PROMPT_CHARS = 20_000  # far beyond what any text encoder reads (512 tokens); a bound like every field's
MAX_ID_CHARS = 65_536  # ids of any content are fine (keys are derived safely); only the size is bounded
MIN_GUIDANCE, MAX_GUIDANCE = 0.0, 100.0
_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")


@dataclasses.dataclass(frozen=True)
class Record:
    id: str
    prompt: str
    negative_prompt: str
    seed: int
    num_images: int
    guidance_scale: float | None  # None: the run's default
    source: str
    line: int
    extra: dict = dataclasses.field(default_factory=dict)
    bucket: int = 0  # which of the run's sizes it asked for (``buckets.assign``); 0, the default


@dataclasses.dataclass(frozen=True)
class Reject:
    source: str
    line: int
    reason: str  # a short code, e.g. "invalid_json"
    message: str  # what a person reads
    raw: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Item:
    """One image to generate: a record expanded by image index, placed in a slice."""
    key: str
    id: str
    image_index: int
    prompt: str
    negative_prompt: str
    seed: int
    guidance_scale: float | None
    source: str
    line: int
    position: int  # global position in the plan
    slice: int
    extra: dict = dataclasses.field(default_factory=dict)
    bucket: int = 0  # the index of its size in the run's sizes (0 in a single-size run)

    def to_json(self) -> dict:
        found = dataclasses.asdict(self)
        if not self.bucket:  # a single-size run's slices keep their bytes
            found.pop("bucket")
        return found

    @classmethod
    def from_json(cls, obj: dict) -> "Item":
        return cls(**obj)

    def inputs(self, default_guidance: float) -> tuple[str, str, float, int, int]:
        """(prompt, negative prompt, guidance, seed, image index): what decides its image."""
        guidance = default_guidance if self.guidance_scale is None else self.guidance_scale
        return self.prompt, self.negative_prompt, guidance, self.seed, self.image_index


class _Bad(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def _int_field(row: dict, name: str, lo: int, hi: int, default: int | None) -> int | None:
    """An integer field in [lo, hi); integral floats and digit strings are accepted."""
    given = row.get(name)
    if given is None:
        return default
    value = numbers.whole(given)
    if value is None:
        raise _Bad(f"bad_{name}", f"'{name}' must be an integer, got {given!r}")
    if not lo <= value < hi:
        raise _Bad(f"bad_{name}", f"'{name}' must be in [{lo}, {hi}), got {value}")
    return value


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _check_text(value, field: str | None = None) -> None:
    """``_Bad`` (invalid_text) where a string of the row, at any depth, holds a lone UTF-16
    surrogate (JSON's ``"\\ud800"``): no UTF-8 output (slices, metadata, tar names) can
    hold it."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found:
            raise _Bad("invalid_text", f"{field!r} holds a lone UTF-16 surrogate (\\u{ord(found.group()):04x}), "
                                       f"which is not text: no UTF-8 output can hold it")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, field)
            _check_text(item, key if field is None else field)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_text(item, field)


def visible(text: str) -> bool:
    """Whether ``text`` holds a character that shows: not only spaces, controls and
    invisible format characters (zero-width spaces and joiners, byte-order marks)."""
    return any(not (c.isspace() or unicodedata.category(c) in ("Cc", "Cf", "Zs", "Zl", "Zp")) for c in text)


def _check_finite(value, field: str | None = None) -> None:
    """``_Bad`` (bad_extra) where a pass-through field holds NaN or an infinity at any depth:
    the metadata is JSON, which has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _Bad("bad_extra", f"{field!r} is {value!r}, which JSON cannot hold (the metadata is JSON); give a "
                                f"number, null or text")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, key if field is None else field)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_finite(item, field)


def _unique_keys(pairs):
    """A JSON object's dict, or ``_Bad`` (repeated_field) when it names a field twice: which
    value was meant is not ours to guess (``json`` would keep the last in silence)."""
    row = dict(pairs)
    if len(row) != len(pairs):
        repeated = sorted({key for key, _ in pairs if sum(k == key for k, _ in pairs) > 1})
        raise _Bad("repeated_field", f"the object names {', '.join(map(repr, repeated))} more than once")
    return row


def parse_row(row, source: str, line: int, run_seed: int, auto_id: str, *,
              max_images: int = 100, prompt_field: str = "prompt", sizes: tuple[str, ...] = ()) -> Record:
    """Validate one decoded row; raise ``_Bad`` with a reason code.

    ``prompt_field`` names the prompt's field. When it is not ``prompt``, a field
    called ``prompt`` is not the prompt and passes through like any other. ``sizes``:
    the run's buckets (``--sizes``), of which the row may ask for one by ``width`` and
    ``height`` (read, not passed through) or ``aspect_ratio`` (passed through beside the
    size it was given); without them, those fields pass through like any other.
    """
    if not isinstance(row, dict):
        raise _Bad("not_an_object", f"a row must be a JSON object, got {type(row).__name__}")
    _check_text(row)
    if prompt_field not in row or row[prompt_field] is None:
        raise _Bad("missing_prompt", f"the row has no {prompt_field!r} field")
    prompt = row[prompt_field]
    if not isinstance(prompt, str):
        raise _Bad("prompt_not_string", f"{prompt_field!r} must be a string, got {type(prompt).__name__}")
    if not visible(prompt):
        raise _Bad("empty_prompt", f"{prompt_field!r} is empty" + (" (it holds only invisible characters)"
                                                                  if prompt.strip() else ""))
    if len(prompt) > MAX_PROMPT_CHARS:
        raise _Bad("prompt_too_long", f"{prompt_field!r} has {len(prompt)} characters; at most {MAX_PROMPT_CHARS} "
                                      f"(text encoders read a few hundred tokens of it)")
    negative = row.get("negative_prompt") or ""
    if not isinstance(negative, str):
        raise _Bad("bad_negative_prompt", "'negative_prompt' must be a string")
    if len(negative) > MAX_PROMPT_CHARS:
        raise _Bad("bad_negative_prompt", f"'negative_prompt' has {len(negative)} characters; at most "
                                          f"{MAX_PROMPT_CHARS}")
    record_id = row.get("id", None)
    if record_id is None or record_id == "":
        record_id = auto_id
    elif isinstance(record_id, bool) or not isinstance(record_id, (str, int)):
        raise _Bad("bad_id", f"'id' must be a string or an integer, got {type(record_id).__name__}")
    record_id = str(record_id)
    if len(record_id) > MAX_ID_CHARS:
        raise _Bad("bad_id", f"'id' must have at most {MAX_ID_CHARS} characters, got {len(record_id)}")
    seed = _int_field(row, "seed", 0, keys.MAX_SEED, None)
    if seed is None:
        seed = keys.record_seed(run_seed, record_id)
    num_images = _int_field(row, "num_images", 1, min(max_images, naming.MAX_IMAGES_PER_RECORD) + 1, 1)
    guidance = row.get("guidance_scale", None)
    if isinstance(guidance, str) and _NUMBER.fullmatch(guidance):
        guidance = float(guidance)
    if guidance is not None:
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance) \
                or not MIN_GUIDANCE <= guidance <= MAX_GUIDANCE:
            raise _Bad("bad_guidance_scale",
                       f"'guidance_scale' must be a number in [{MIN_GUIDANCE}, {MAX_GUIDANCE}], got {guidance!r}")
        guidance = float(guidance)
    known = {name for name in KNOWN_FIELDS if name != "prompt"} | {prompt_field}
    bucket = 0
    if sizes:
        try:
            bucket, _ = buckets.assign(row, sizes)
        except buckets.BadSize as bad:
            raise _Bad(bad.reason, bad.message) from None
        known |= {"width", "height"}
    extra = {k: v for k, v in row.items() if k not in known}
    _check_finite(extra)
    return Record(id=record_id, prompt=prompt, negative_prompt=negative, seed=seed,
                  num_images=num_images, guidance_scale=guidance, source=source, line=line, extra=extra,
                  bucket=bucket)


def _decode_line(raw: bytes, source: str, line: int) -> str | Reject:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Reject(source, line, "invalid_utf8", f"the line is not valid UTF-8 ({e.reason} at byte {e.start})",
                      raw.decode("utf-8", "replace"))


def parse_jsonl_line(raw: bytes, source: str, line: int, run_seed: int, auto_id: str, *,
                     prompt_field: str = "prompt", sizes: tuple[str, ...] = ()) -> Record | Reject | None:
    """One JSONL line to a Record, a Reject, or None for a blank line."""
    text = _decode_line(raw, source, line)
    if isinstance(text, Reject):
        return text
    if not text.strip():
        return None
    try:
        row = json.loads(text, object_pairs_hook=_unique_keys)
        return parse_row(row, source, line, run_seed, auto_id, prompt_field=prompt_field, sizes=sizes)
    except json.JSONDecodeError as e:
        return Reject(source, line, "invalid_json", f"the line is not valid JSON: {e.msg} at column {e.colno}", text)
    except _Bad as bad:
        return Reject(source, line, bad.reason, bad.message, text)


def parse_text_line(raw: bytes, source: str, line: int, run_seed: int, auto_id: str,
                    sizes: tuple[str, ...] = ()) -> Record | Reject | None:
    """One line of a ``.txt`` file (the line is the prompt): a Record, a Reject, or None if blank."""
    text = _decode_line(raw, source, line)
    if isinstance(text, Reject):
        return text
    if not text.strip():
        return None
    return parse_decoded({"prompt": text}, source, line, run_seed, auto_id, sizes=sizes)


def parse_decoded(row, source: str, line: int, run_seed: int, auto_id: str, *,
                  prompt_field: str = "prompt", sizes: tuple[str, ...] = ()) -> Record | Reject:
    """A row some reader already decoded (a CSV row, a JSON array element, a Parquet row)."""
    try:
        return parse_row(row, source, line, run_seed, auto_id, prompt_field=prompt_field, sizes=sizes)
    except _Bad as bad:
        raw = json.dumps(row, ensure_ascii=bad.reason == "invalid_text", default=str)  # a surrogate, escaped
        return Reject(source, line, bad.reason, bad.message, raw)


def expand(record: Record, first_position: int, slice_size: int, labels: dict | None = None,
           bucket_start: tuple[int, int] = (0, 0)) -> list[Item]:
    """The items (one per image) of a record whose first image sits at ``first_position``;
    ``labels``: the run's file labels, for readable keys (``naming.output_key``);
    ``bucket_start``: (first position, first slice) of the record's bucket
    (``buckets.Geometry``), whose slices are ``slice_size`` images each."""
    items = []
    offset, first_slice = bucket_start
    for index in range(record.num_images):
        position = first_position + index
        items.append(Item(key=naming.output_key(record.id, index, labels), id=record.id, image_index=index,
                          prompt=record.prompt, negative_prompt=record.negative_prompt, seed=record.seed,
                          guidance_scale=record.guidance_scale, source=record.source, line=record.line,
                          position=position, slice=first_slice + (position - offset) // slice_size,
                          extra=record.extra, bucket=record.bucket))
    return items
