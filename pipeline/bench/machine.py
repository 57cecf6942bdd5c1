"""What a benchmark's numbers were measured on: the machine, its CPU and its devices."""
from __future__ import annotations

import os
import platform


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def machine(devices) -> dict:
    """What the numbers were measured on."""
    import jax

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return {"platform": devices[0].platform, "device_kind": devices[0].device_kind, "devices": len(devices),
            "local_devices": jax.local_device_count(), "cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
            "memory_gib": round(memory / 2**30, 1) if memory else None, "machine": platform.machine(),
            "python": platform.python_version(), "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
