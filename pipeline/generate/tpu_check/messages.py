"""What the TPU check says of a run: the run in a few words (``describe_settings``,
``describe_run``), and ``submit``'s refusal of a program that does not fit (pure)."""
from __future__ import annotations

from pipeline.generate import fit


def describe_settings(settings) -> str:
    """``describe_run`` of settings not yet checked (no report to read)."""
    size = f" {settings.width}x{settings.height}" if settings.width and settings.height else ""
    return f"{settings.model}{size} {settings.dtype} ({settings.steps} steps, --attention {settings.attention})"


def describe_run(report: dict) -> str:
    fsdp = f", --fsdp {report['fsdp']}" if report.get("fsdp", 1) != 1 else ""
    fsdp += f", --score {','.join(report['scores'])}" if report.get("scores") else ""
    return (f"{report['model']} {report['width']}x{report['height']} {report['dtype']} "
            f"({'guided' if report['guided'] else 'guidance-free'}, {report['steps']} steps, --attention "
            f"{report['attention']}{fsdp})")


def refusal(report: dict, fitting: int | None, estimated: bool = False) -> str:
    """What ``submit`` says of a program that does not fit: its figures, and what would
    (``estimated``: from the parts' growth, not compiled whole)."""
    if report.get("crashed"):
        return (f"{describe_run(report)} at {report['per_device_batch']} image(s) per chip does not compile for a "
                f"{report['tpu_type']} chip: libtpu's compiler crashed ({report['crashed']}) on it, as it would on "
                f"the TPU host; another --per-device-batch may compile (auto searches the ones that do"
                f"{f', and about {fitting} per chip fit' if fitting else ''})")
    needs = f"needs {report['total_gib']:.2f} GiB" if report["compiled"] else \
        f"needs {report['total_gib']:.2f} GiB ({report['temp_gib']:.2f} of temporaries, by XLA's refusal to " \
        f"compile it)"
    text = (f"{describe_run(report)} at {report['per_device_batch']} image(s) per chip {needs} of a "
            f"{report['tpu_type']} chip's {report['hbm_gib']:g} GiB ({report['usable_gib']:.2f} GiB usable, "
            f"{report['limit_gib']:.2f} GiB with {round((1 - fit.HEADROOM) * 100)}% headroom)")
    if fitting is None:
        return text + "; not even one image per chip fits: use a larger TPU type, a smaller size, bf16 or --fsdp"
    if estimated:
        return text + f"; about {fitting} per chip fit (estimated from the step's parts: --per-device-batch auto " \
                      f"finds and confirms the largest)"
    return text + f"; {fitting} per chip fit{'s' if fitting == 1 else ''}"
