"""Numbers as rows give them (pure): CSV and TSV cells are text, JSON has floats and ints; and
numbers as people read them (``counted``)."""
from __future__ import annotations

import re

_WHOLE_TEXT = re.compile(r"\s*[-+]?\d+(\.0*)?\s*")


def whole(value) -> int | None:
    """``value`` as an int when it is a whole number, an int, an integral float (``32.0``) or
    the text of one (``"32"``, ``" 32.0 "``); else None (a bool is not a number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and _WHOLE_TEXT.fullmatch(value):
        return int(float(value)) if "." in value else int(value)
    return None


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, singular for one: "1 slice", "2 slices", "0 images"."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
