"""Fixed-size slices and their assignment to hosts (pure functions).

A slice is the unit of work, output, retry and resume. There is one slice size per
run: local devices x per-device batch x batches per slice. Host ``h`` of ``H`` takes
slices ``h, h+H, h+2H, ...``; every host gets the same number of slots, and a slot
past the last slice is a padding slot (``None``), so all hosts run the same number
of device steps.
"""
from __future__ import annotations

import math


def slice_size(devices_per_host: int, per_device_batch: int, batches_per_slice: int) -> int:
    for name, value in (("devices_per_host", devices_per_host),
                        ("per_device_batch", per_device_batch),
                        ("batches_per_slice", batches_per_slice)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return devices_per_host * per_device_batch * batches_per_slice


def num_slices(num_items: int, size: int) -> int:
    """Slices needed for ``num_items`` items; the last one may be partly padding."""
    if size < 1:
        raise ValueError(f"slice size must be >= 1, got {size}")
    return math.ceil(num_items / size) if num_items > 0 else 0


def slots_per_host(total_slices: int, num_hosts: int) -> int:
    """How many slice slots every host runs (the same for all hosts)."""
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
    return math.ceil(total_slices / num_hosts)


def host_slots(host: int, num_hosts: int, total_slices: int) -> list[int | None]:
    """The slices host ``host`` runs, in order; ``None`` marks a padding slot."""
    if not 0 <= host < num_hosts:
        raise ValueError(f"host must be in [0, {num_hosts}), got {host}")
    slots = []
    for k in range(slots_per_host(total_slices, num_hosts)):
        index = host + k * num_hosts
        slots.append(index if index < total_slices else None)
    return slots


def batches_per_slice(size: int, local_devices: int, per_device_batch: int) -> int:
    """Device steps per slice on a host; the slice size must split evenly."""
    step = local_devices * per_device_batch
    if size % step:
        raise ValueError(
            f"slice size {size} is not a multiple of local devices ({local_devices}) x "
            f"per-device batch ({per_device_batch}); re-plan with --devices-per-host {local_devices}")
    return size // step


def most_per_device(images: int, hosts: int, devices_per_host: int) -> int:
    """The most images per device step that a run of ``images`` images can fill on
    ``hosts`` hosts of ``devices_per_host`` devices: ceil(images / (hosts x devices)),
    at least 1. A larger per-device batch only adds padding rows: every device would run
    rows that are never written."""
    for name, value in (("hosts", hosts), ("devices_per_host", devices_per_host)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return max(1, math.ceil(images / (hosts * devices_per_host)))


# --batches-per-slice auto (``auto_batches_per_slice``)
SMALL_RUN_BATCHES_PER_SLICE = 2  # the slices a small run has always had (64 images at 4 chips x batch 8)
LARGE_RUN_IMAGES = 1_000_000  # from here slices hold about LARGE_RUN_SLICE_IMAGES
LARGE_RUN_SLICE_IMAGES = 1024


def auto_batches_per_slice(images: int, devices_per_host: int, per_device_batch: int, most: int) -> int:
    """``--batches-per-slice auto`` for a run of ``images`` images: 2 under a million images,
    where small slices spread a small run over many hosts; from a million, the batches
    that make about 1,024 images a slice (at least 2, at most ``most``), so a billion
    images make a million slices, not 16 million, and every per-slice object and listing
    is 16 times fewer."""
    if images < LARGE_RUN_IMAGES:
        return SMALL_RUN_BATCHES_PER_SLICE
    step = slice_size(devices_per_host, per_device_batch, 1)
    return max(SMALL_RUN_BATCHES_PER_SLICE, min(most, round(LARGE_RUN_SLICE_IMAGES / step)))
