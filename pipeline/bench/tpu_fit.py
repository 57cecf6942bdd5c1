"""``promptmill bench tpu``: the TPU check as a sweep, on a machine without a TPU.

For each model size, TPU target (type and host topology), attention implementation and
per-device batch, the host program is compiled for the target's chips by libtpu
(``pipeline.generate.tpu_check.check``), from shapes alone: memory per chip (arguments,
temporaries, total), whether it fits the chip's HBM, FLOPs per image (by parts, every
step counted) and XLA's own count and time estimate, the attention kernels, and the
compile time on this machine; with ``--scorers``, the scoring program too, and what the
two need together (``tpu_check.with_scorer``). ``--per-device-batch auto`` instead finds the largest
batch that fits each target (``tpu_check.largest_batch``: the parts predict it, the whole
program confirms it). Results are kept in the compile cache folder, so a repeated sweep
compiles nothing it compiled before (its rows say ``from_cache``).

The runs of docs/benchmarks.md were, e.g.::

    promptmill bench tpu --model random-sd15 --sizes 512 --steps 20 --per-device-batch auto \\
        --attentions auto,xla --targets v5e:2x2,v6e:2x2 --report docs/bench-tpu-sd15.json
"""
from __future__ import annotations

import dataclasses
import time

from pipeline.core import logs
from pipeline.core.settings import AUTO, Settings


@dataclasses.dataclass(frozen=True)
class TpuBenchConfig:
    model: str = "tiny"
    sizes: tuple[int | None, ...] = (None,)  # square sizes; None: the model's own
    steps: int = 20
    dtype: str = "bf16"
    per_device_batches: tuple = (1,)  # numbers, or AUTO: the largest that fits each target
    attentions: tuple[str, ...] = ("auto",)
    fsdps: tuple = (1,)  # FSDP degrees (each dividing the host's chips), or AUTO: the smallest that fits
    targets: tuple[tuple[str, str, str | None], ...] = (("v5e", "2x2", None),)  # (type, topology, machine type)
    guidance_scale: float | None = None  # None: the model family's
    scorers: str | None = None  # with every score, by these scorers (throughput_config.SCORERS); None: no scores
    report: str | None = None


def parse_target(text: str) -> tuple[str, str, str | None]:
    """``TYPE:TOPOLOGY[:MACHINE]`` -> (type, topology, machine type or None)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"a TPU target is TYPE:TOPOLOGY[:MACHINE_TYPE], e.g. v5e:2x2 or v6e:2x4:ct6e-standard-8t, "
                         f"got {text!r}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def run(config: TpuBenchConfig) -> dict:
    """Every combination of the sweep, compiled (or searched) in turn; the report."""
    import jax

    from pipeline.bench.throughput_config import SCORERS
    from pipeline.cloud import program_check, tpu
    from pipeline.generate import tpu_check

    tpu_check.require_libtpu()
    if config.scorers is not None and config.scorers not in SCORERS:
        raise ValueError(f"--scorers must be one of {', '.join(SCORERS)}, got {config.scorers!r}")
    scoring = SCORERS[config.scorers] if config.scorers else {}
    rows = []
    for size in config.sizes:
        for type_name, topology, machine in config.targets:
            chosen = tpu.lookup(type_name, topology, machine)
            target = program_check.target(chosen)
            for attention, fsdp in [(a, f) for a in config.attentions for f in config.fsdps]:
                if fsdp != AUTO and chosen.devices_per_host % fsdp:
                    continue  # a degree this host cannot have
                settings = Settings(model=config.model, width=size, height=size, steps=config.steps,
                                    dtype=config.dtype, attention=attention, guidance_scale=config.guidance_scale,
                                    devices_per_host=chosen.devices_per_host, fsdp=fsdp, **scoring).validate()
                if fsdp == AUTO:
                    try:
                        settings = settings.replace(fsdp=program_check.smallest_fsdp(settings, target))
                    except tpu_check.DoesNotFit as e:
                        rows.append({"searched": True, "model": config.model, "tpu_type": chosen.tpu_type,
                                     "attention": attention, "fits": False, "refusal": str(e)})
                        continue
                for batch in config.per_device_batches:
                    started = time.perf_counter()
                    row = {"searched": batch == AUTO}
                    if batch == AUTO:
                        try:
                            batch, tried = tpu_check.largest_batch(settings, target)
                            row["tried_gib"] = {b: round(n / tpu_check.GIB, 3) for b, n in sorted(tried.items())}
                        except tpu_check.DoesNotFit as e:
                            rows.append({**row, "model": config.model, "tpu_type": chosen.tpu_type,
                                         "attention": attention, "fits": False, "refusal": str(e)})
                            continue
                    report = tpu_check.check(settings.replace(per_device_batch=batch), target)
                    row.update(report)
                    row["seconds"] = round(time.perf_counter() - started, 2)
                    logs.event("bench_tpu_row", **{k: v for k, v in row.items() if k != "kernels"})
                    rows.append(row)
    return {"config": dataclasses.asdict(config), "jax": jax.__version__, "libtpu": tpu_check.libtpu_version(),
            "rows": rows}


def table(report: dict) -> str:
    """The report as a readable table."""
    head = (f"{'model':>12} {'size':>9} {'tpu':>4} {'host':>5} {'attention':>9} {'fsdp':>4} {'batch':>5} {'fits':>5} "
            f"{'total GiB':>9} {'args GiB':>8} {'temp GiB':>8} {'of GiB':>6} {'gather GiB':>10} {'TFLOP/img':>9} "
            f"{'kernels':>14} {'compile s':>9}")
    lines = [f"TPU programs compiled here (jax {report['jax']}, libtpu {report['libtpu']}); batch: images per chip"
             + (" (searched: the largest that fits)" if any(r["searched"] for r in report["rows"]) else ""), head]
    for row in report["rows"]:
        if "refusal" in row:
            lines.append(f"{row['model']:>12} {row['tpu_type']:>4} {row['attention']:>9}: {row['refusal']}")
            continue
        kernels = ",".join(sorted({k["kernel"] for k in row["kernels"]})) or "-"
        lines.append(f"{row['model']:>12} {row['width']:>4}x{row['height']:<4} {row['tpu_type']:>4} "
                     f"{row['chips_per_host']:>5} {row['attention']:>9} {row['fsdp']:>4} {row['per_device_batch']:>5} "
                     f"{'yes' if row['fits'] else 'no':>5} {row['total_gib']:>9.2f} {row['argument_gib']:>8.2f} "
                     f"{row['temp_gib']:>8.2f} {row['limit_gib']:>6.2f} {row['all_gather_gib']:>10.3f} "
                     f"{row['flops_per_image'] / 1e12:>9.2f} {kernels:>14} {row['compile_s']:>9.1f}"
                     + (f" (with the scorer's {row['scorer_argument_gib']:.2f} GiB of weights and "
                        f"{row['scorer_temp_gib']:.2f} of temporaries)" if "scorer_total_gib" in row else "")
                     + (f" (libtpu crashed: {row['crashed']})" if row.get("crashed") else "")
                     + (" (cached)" if row["from_cache"] else ""))
    return "\n".join(lines)
