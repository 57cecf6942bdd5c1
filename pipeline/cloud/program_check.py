"""Before a submission launches anything: the TPU check of the program its hosts will run.

``submit gke`` and ``submit dataflow`` compile, here and from shapes alone, the program
one host of the target TPU slice will run (``pipeline.generate.tpu_check``), log it as
one ``tpu_program`` event, and refuse a program that does not compile or does not fit
the chip, with the figures and the per-device batch that would fit. ``--per-device-batch
auto`` resolves against the target chip the same way: the most images per chip that fit,
which the plan then lowers to what the run fills on the slice's hosts. ``--no-tpu-check``
skips all of it, and says so in the log.

Before the plan, whether the run is guided is taken from ``--guidance-scale``; a plan
whose records make it guided (a record's own guidance above 1) is checked again
(``check_planned``) before the generate step launches.
"""
from __future__ import annotations

import math

from pipeline.cloud import tpu
from pipeline.core import buckets, logs
from pipeline.core.settings import AUTO
from pipeline.generate import tpu_check


def target(s: tpu.TpuSlice, device_memory: float | None = None) -> tpu_check.Target:
    """The chips of one host of the TPU slice ``s``, as the check compiles for them;
    ``device_memory`` (``--device-memory``, GiB): a chip's memory as the user states it,
    instead of the TPU table's HBM and what XLA reports usable of it."""
    shape = dict(dims=tpu.TYPES[s.tpu_type].dims, devices_per_chip=tpu.TYPES[s.tpu_type].devices_per_chip)
    if device_memory is not None:
        return tpu_check.Target(s.tpu_type, s.chips_per_host, device_memory, s.topology, s.machine_type,
                                usable_gib=device_memory, **shape)
    return tpu_check.Target(s.tpu_type, s.chips_per_host, s.device_hbm_gib, s.topology, s.machine_type, **shape)


def check_submission(settings, s: tpu.TpuSlice, skip: bool = False) -> tuple[object, dict | None]:
    """(settings with ``--per-device-batch auto`` resolved against ``s``'s chips, the
    ``tpu_program`` report or None when ``skip``); ValueError, with the figures, for a
    program that does not fit or cannot be checked."""
    if skip:
        for flag, value in (("--per-device-batch", settings.per_device_batch), ("--fsdp", settings.fsdp)):
            if value == AUTO:
                raise ValueError(f"{flag} auto is resolved by the TPU check against the target chip: give a number "
                                 f"with --no-tpu-check")
        logs.event("tpu_check_skipped", reason="--no-tpu-check", tpu_type=s.tpu_type, topology=s.topology)
        return settings, None
    chip = target(s, settings.device_memory)
    if settings.sizes:
        return _check_sizes(settings, chip)
    try:
        tpu_check.require_libtpu()
        if settings.fsdp == AUTO:
            settings = settings.replace(fsdp=smallest_fsdp(settings, chip)).validate()
        if settings.per_device_batch == AUTO:
            chosen, _ = tpu_check.largest_batch(settings, chip)
            logs.event("per_device_batch_chosen", per_device_batch=chosen, platform="tpu", tpu_type=s.tpu_type,
                       chips_per_host=s.chips_per_host)
            settings = settings.replace(per_device_batch=chosen).validate()
        report = tpu_check.check(settings, chip)
    except tpu_check.DoesNotFit as e:
        raise ValueError(f"the TPU check refuses this submission: {e}") from None
    except tpu_check.TpuCheckError as e:
        raise ValueError(str(e)) from None
    logs.event("tpu_program", **report)
    if not report["fits"]:
        fitting = tpu_check.estimated_fit(settings, chip, report) \
            if report["per_device_batch"] > 1 and not report["crashed"] else None
        raise ValueError(f"the TPU check refuses this submission: "
                         f"{tpu_check.refusal(report, fitting, estimated=fitting is not None)}")
    return settings, report


def _check_sizes(settings, chip: tpu_check.Target) -> tuple[object, dict]:
    """``check_submission`` of a run of several sizes: every size's program
    (``tpu_check.sizes.check_sizes``), one ``tpu_program`` event each; the report is the
    first size's, with ``sizes``: each size's figures."""
    from pipeline.generate import fit
    from pipeline.generate.tpu_check import sizes as size_check

    try:
        tpu_check.require_libtpu()
        settings = fit.resolve_sizes(settings)
        if settings.fsdp == AUTO:  # one for the run: the size of the most pixels decides
            largest = max(settings.sizes, key=lambda name: math.prod(buckets.parse_size(name)))
            settings = settings.replace(fsdp=smallest_fsdp(size_check.size_settings(settings, largest), chip))
        settings, reports = size_check.check_sizes(settings, chip)
    except tpu_check.DoesNotFit as e:
        raise ValueError(f"the TPU check refuses this submission: {e}") from None
    except tpu_check.TpuCheckError as e:
        raise ValueError(str(e)) from None
    for report in reports:
        logs.event("tpu_program", **report)
    return settings, {**reports[0], "sizes": [{k: r[k] for k in ("size", "per_device_batch", "total_gib", "fits",
                                                                  "confirmed")} for r in reports]}


def smallest_fsdp(settings, chip: tpu_check.Target) -> int:
    """``--fsdp auto`` on ``chip``: the smallest N dividing the host's chips whose program fits
    one image per chip; logged as ``fsdp_chosen``. DoesNotFit when none does."""
    from pipeline.model import sharding

    tried = {}
    for n in sharding.divisors(chip.chips):
        report = tpu_check.check(settings.replace(fsdp=n, per_device_batch=1), chip)
        tried[n] = report["total_gib"]
        if report["fits"]:
            logs.event("fsdp_chosen", fsdp=n, platform="tpu", tpu_type=chip.tpu_type, tried_gib=tried)
            return n
    raise tpu_check.DoesNotFit(f"{tpu_check.describe_run(report)}: one image per chip needs "
                               f"{', '.join(f'{v:.2f} GiB at --fsdp {k}' for k, v in tried.items())} of a "
                               f"{chip.tpu_type} chip's {chip.hbm_gib:g} GiB; none fits")


def resolve_submission(settings, s: tpu.TpuSlice, skip: bool = False, overwrite: bool = False,
                       look: bool = True) -> tuple[object, dict | None, int | None]:
    """``check_submission`` for a submission of ``settings`` to ``s``, and the hosts the plan
    caps an ``auto`` per-device batch for (``Plan``'s ``cap_hosts``; None: no cap). A run
    already planned in OUT keeps the per-device batch its slices were cut with (unless
    ``overwrite``); ``look=False`` (a dry run) does not read OUT."""
    from pipeline.io import runs

    cap = None
    if look and not overwrite and settings.decode_batch == AUTO and runs.exists(settings.out):
        # a resumed run decodes as its plan said: the check checks the program its hosts run
        settings = settings.replace(decode_batch=runs.read(settings.out).settings.decode_batch)
    if AUTO in (settings.per_device_batch, settings.fsdp):
        if look and not overwrite and runs.exists(settings.out):  # a resumed run keeps what its slices were made with
            planned = runs.read(settings.out).settings
            kept = {name: getattr(planned, name) for name in ("per_device_batch", "fsdp")
                    if getattr(settings, name) == AUTO}
            if "per_device_batch" in kept:  # and each size's
                kept["bucket_batches"] = planned.bucket_batches
            logs.event("auto_settings_kept", out=settings.out, **kept)
            settings = settings.replace(**kept)
        elif settings.per_device_batch == AUTO:
            cap = s.hosts
    settings, report = check_submission(settings, s, skip)
    return settings, report, cap


def check_planned(out: str, checked, s: tpu.TpuSlice) -> None:
    """After the plan of ``out``: check the run's program again when the plan decided it is
    guided and the check before it assumed not (a guided program runs the UNet on twice
    the rows); ValueError when that one does not fit. ``checked``: the settings checked
    before, or None when the check was skipped."""
    from pipeline.io import runs

    if checked is None or tpu_check.run_guided(checked):
        return
    planned = runs.read(out).settings
    if planned.guided:
        check_submission(planned, s)


def summary(report: dict | None) -> str:
    """One line for a dry run: what the check found, or that it was skipped."""
    if report is None:
        return "TPU check: skipped (--no-tpu-check)"
    kernels = sorted({k["kernel"] for k in report["kernels"]})
    if report.get("sizes"):
        return "TPU check: every size's host program fits: " + "; ".join(
            f"{r['size']}: {r['per_device_batch']} image(s) per chip, {r['total_gib']:.2f} GiB per chip "
            f"({'compiled whole' if r['confirmed'] == 'whole program' else 'predicted by the step parts'})"
            for r in report["sizes"]) + " (the tpu_program events have every figure)"
    return (f"TPU check: the host program fits: {report['total_gib']:.2f} GiB per chip ({report['argument_gib']:.2f} "
            f"of arguments, {report['temp_gib']:.2f} of temporaries) of {report['limit_gib']:.2f} GiB allowed on a "
            f"{report['tpu_type']} chip ({report['hbm_gib']:g} GiB), {report['per_device_batch']} image(s) per chip, "
            f"attention kernels: {', '.join(kernels) or 'none'}; compiled with jax {report['jax']}, libtpu "
            f"{report['libtpu']} (the tpu_program event has every figure)")
