"""The keys of the TPU programs that docs/tpu-checks/ holds figures for, lowered by this
version: a refactor that must not change a TPU program checks that each key is still
there (a key is ``compile_cache.figures_key``: the sha256 of the lowered program's text
and the target's devices). Lowering needs libtpu (the test extra) and no TPU; nothing is
compiled.

    python tests/tpu_program_keys.py [NAME ...]

Each line: the program's name, its key, and whether docs/tpu-checks/ has it.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(ROOT, "docs", "tpu-checks")
# name -> (settings' fields, TPU type, chips per host, per-device batch); the SDXL programs measured
# before --decode-batch decode the whole batch at once (decode_batch None)
PROGRAMS = {
    "tiny-128-v5e-auto-1": (dict(model="tiny", width=128, height=128, steps=1, attention="auto", dtype="bf16",
                                 guidance_scale=1.0), "v5e", 4, 1),
    "sdxl-1024-v5e-xla-2": (dict(model="random-sdxl", width=1024, height=1024, steps=20, attention="xla",
                                 dtype="bf16", decode_batch=None), "v5e", 4, 2),
    "sdxl-1024-v6e-xla-6": (dict(model="random-sdxl", width=1024, height=1024, steps=20, attention="xla",
                                 dtype="bf16", decode_batch=None), "v6e", 4, 6),
}


def key_of(fields: dict, tpu_type: str, chips: int, per_device_batch: int) -> str:
    from pipeline.core.settings import Settings
    from pipeline.generate import compile_cache, tpu_check

    settings = Settings(**fields, devices_per_host=chips, per_device_batch=per_device_batch)
    target = tpu_check.Target(tpu_type, chips, 16.0)
    lowered, _ = tpu_check.lowered_sampler(tpu_check.Context.of(settings, target), per_device_batch)  # as it checks
    return compile_cache.figures_key(lowered, tpu_check.host_devices(target))


def main(names: list[str]) -> int:
    missing = 0
    for name in names or PROGRAMS:
        key = key_of(*PROGRAMS[name])
        found = os.path.exists(os.path.join(CHECKS, f"{key}.json"))
        missing += not found
        print(f"{name} {key} {'in docs/tpu-checks' if found else 'NOT in docs/tpu-checks'}", flush=True)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
