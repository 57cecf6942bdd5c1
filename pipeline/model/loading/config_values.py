"""A network's ``config.json`` read against its class's defaults: each check refuses with
one ValueError naming the key and the value the file gave."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ConfigValues:
    """``values``: every key of ``defaults``, from ``config`` where it has it."""

    def __init__(self, what: str, config: Mapping[str, Any], defaults: Mapping[str, Any]):
        self.what, self.config = what, config
        self.values = {key: config.get(key, default) for key, default in defaults.items()}

    def __getitem__(self, key: str):
        return self.values[key]

    def refuse(self, key: str, why: str):
        raise ValueError(f"{self.what}: {key}={self.config.get(key)!r} {why}")

    def class_name(self, expected: str) -> None:
        if self.config.get("_class_name", expected) != expected:
            self.refuse("_class_name", f"is not {expected}")

    def ints(self, keys, least: int = 1) -> None:
        """Each of ``keys`` an integer >= ``least``."""
        for key in keys:
            if not is_int(self.values[key]) or self.values[key] < least:
                self.refuse(key, "must be a positive integer" if least == 1 else f"must be an integer >= {least}")

    def optional_int(self, key: str) -> None:
        value = self.values[key]
        if value is not None and (not is_int(value) or value < 1):
            self.refuse(key, "must be a positive integer or null")

    def positive_numbers(self, keys) -> None:
        for key in keys:
            if not is_number(self.values[key]) or not self.values[key] > 0:
                self.refuse(key, "must be a positive number")

    def boolean(self, key: str) -> None:
        if not isinstance(self.values[key], bool):
            self.refuse(key, "must be true or false")

    def rope_axes(self, key: str, head_dim_key: str) -> tuple[int, ...]:
        """RoPE's channels per position axis: positive even integers that sum to the head's width."""
        axes = self.values[key]
        if (not isinstance(axes, (list, tuple)) or not axes
                or not all(is_int(a) and a > 0 and a % 2 == 0 for a in axes)):
            self.refuse(key, "must be a list of positive even integers")
        if sum(axes) != self.values[head_dim_key]:
            self.refuse(key, f"sums to {sum(axes)}, not {head_dim_key} {self.values[head_dim_key]}")
        return tuple(axes)
