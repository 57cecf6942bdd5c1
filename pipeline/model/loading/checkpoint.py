"""What every loading module says of a checkpoint that cannot be used: ``ModelError``,
whose message names the missing or bad piece, and ``read_json_file``, which reads a
checkpoint's JSON file (``model_index.json``, a config) or refuses it by name, and
``license_of``, the licence its model card states.
"""
from __future__ import annotations

import json
import os


class ModelError(ValueError):
    """A checkpoint that cannot be used; the message names the missing or bad piece."""


def read_json_file(path: str):
    """A checkpoint's JSON file (``model_index.json``, a config), or ModelError naming the
    file and where it stops being JSON."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ModelError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def license_of(directory: str) -> str | None:
    """The licence a checkpoint states in its model card (README.md's YAML front matter
    ``license:``, as the Hugging Face hub keeps it), or None."""
    path = os.path.join(directory, "README.md")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(65536)
    except OSError:
        return None
    if not text.startswith("---"):
        return None
    front = text[3:].split("\n---", 1)[0]
    for line in front.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "license" and value.strip():
            return value.strip().strip("'\"")
    return None
