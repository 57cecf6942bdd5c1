"""What the TPU check reads in XLA's text, pure: sizes and the figures of an out-of-memory
refusal, the bytes a compiled program's all-gathers write, the HBM total of a buffer
assignment's memory-usage report."""
from __future__ import annotations

import os
import re

import numpy as np

from pipeline.generate.tpu_check.errors import TpuCheckError

_SIZE = re.compile(r"([0-9.]+)\s*([KMGT]?)(i?B?)?")
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _bytes(text: str) -> int:
    number, unit, _ = _SIZE.fullmatch(text.strip()).groups()
    return int(float(number) * _UNITS[unit])


def out_of_memory(message: str) -> dict | None:
    """{"temp", "available"} bytes from XLA's out-of-HBM compile error, e.g. "the total
    memory required for HLO temporaries (8.07T) exceeds available HBM (15.75G)", or, from
    the whole program's refusal (``CompileTimeHbmOom``), "Used 15.75G of 15.75G hbm ...
    Program hbm requirement 9.26G" (what the program needs beyond its arguments); None for
    another error (pure)."""
    if "Ran out of memory" not in message and "RESOURCE_EXHAUSTED" not in message:
        return None
    found = {}
    for key, patterns in (("temp", (r"required for HLO temporaries \(([^)]+)\)",
                                    r"Program hbm requirement ([0-9.]+[KMGT]?)")),
                          ("available", (r"available HBM \(([^)]+)\)",
                                         r"Used [0-9.]+[KMGT]? of ([0-9.]+[KMGT]?) hbm"))):
        for pattern in patterns:
            match = re.search(pattern, message)
            if match:
                found[key] = _bytes(match.group(1))
                break
    return found or None


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


def all_gather_bytes(hlo_text: str) -> int:
    """Bytes the all-gathers of a compiled program write, summed over its HLO text: each
    all-gather (or its async start) counted once with its result's size, so one inside a
    loop's body counts once whatever the trip count (pure)."""
    total = 0
    for line in hlo_text.splitlines():
        if " all-gather(" not in line and " all-gather-start(" not in line:
            continue
        result = line.split("=", 1)[1].split("all-gather", 1)[0]
        shapes = [(kind, dims) for kind, dims in _SHAPE.findall(result) if kind in _DTYPE_BYTES]
        if not shapes:
            continue
        kind, dims = shapes[-1]  # an async start's result is (operand, result): the last
        total += _DTYPE_BYTES[kind] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


_REPORT = re.compile(r"Memory Space: default \(color=0\)\s+Total bytes: (\d+)")


def memory_report(folder: str, complete: bool = False) -> int | None:
    """The HBM bytes of the memory-usage report XLA dumped into ``folder`` (its default
    memory space: parameters, outputs, temporaries and constants as buffer assignment
    placed them), once the dump written after it exists (or ``complete``: the compile
    ended); None before. Pure but for reading ``folder``."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    reports = sorted(n for n in names if n.endswith("-memory-usage-report.txt"))
    if not reports or not (complete or any(n.endswith("_after_buffer_assignment.txt") for n in names)):
        return None
    with open(os.path.join(folder, reports[-1]), encoding="utf-8", errors="replace") as f:
        found = _REPORT.search(f.read())
    if found is None:
        raise TpuCheckError(f"XLA's memory-usage report {reports[-1]} names no default memory space")
    return int(found.group(1))
