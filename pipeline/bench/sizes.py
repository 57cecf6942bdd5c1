"""``promptmill bench sizes``: one run of several sizes against one single-size run per size,
of the same records, one after the other on this machine.

Each arm is a whole ``promptmill run`` (Beam plan, host processes, collect) with a compile
cache of its own, run twice: cold, paying its compiles (the run of several sizes compiles
every size's program, the first while the weights load, the later ones on a thread while
the first size runs; each single-size run its own), then warm (``--overwrite``, the same
cache: what a re-run or a scheduled run pays). Reported for each pass: each arm's wall
time and images/s, the sizes run's images/s over the single-size runs' together, the
hosts' generating seconds, and, at every switch from one size to the next on a host
(``size_switch`` events), how long the devices sat idle against one batch's time. The
images are compared too: each is the same bytes in both arms.

On CPU devices a later size's compile shares the cores with the devices' work, so a cold
run of several sizes slows while it compiles; on TPU and GPU hosts the compile runs on the
host's CPU while the chips work. The warm pass shows the loop itself.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
import time

from pipeline.collect import parts
from pipeline.core import buckets, children, logs, naming
from pipeline.io import storage


@dataclasses.dataclass(frozen=True)
class SizesBenchConfig:
    model: str = "tiny"
    sizes: tuple[str, ...] = ("64x64", "48x64", "64x48")
    records: int = 24  # per size
    workdir: str | None = None
    report: str | None = None
    # what every arm's run takes besides its prompts and sizes (``run_flags``)
    steps: int | None = None  # None: the model's default, as a run takes it
    hosts: int = 2
    devices_per_host: int = 2
    per_device_batch: int = 2
    batches_per_slice: int = 2

    def run_flags(self) -> list[str]:
        """The ``promptmill run`` flags every arm shares: the model, the steps and the layout."""
        layout = {"--hosts": self.hosts, "--devices-per-host": self.devices_per_host,
                  "--per-device-batch": self.per_device_batch, "--batches-per-slice": self.batches_per_slice}
        return ["--model", self.model, *(["--steps", str(self.steps)] if self.steps else []),
                *(word for flag, value in layout.items() for word in (flag, str(value)))]


def _prompts(folder: str, config: SizesBenchConfig) -> tuple[str, dict[str, str]]:
    """(the sizes run's prompt file, {size: the single-size run's file}): the same records."""
    every, alone = [], {}
    for name in config.sizes:
        width, height = buckets.parse_size(name)
        rows = [{"id": f"{name}-{n}", "prompt": f"a picture number {n} at {name}"} for n in range(config.records)]
        every += [{**row, "width": width, "height": height} for row in rows]
        alone[name] = os.path.join(folder, f"{name}.jsonl")
        with open(alone[name], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    path = os.path.join(folder, "sizes.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in every)
    return path, alone


def _run(args: list[str], out: str, cache: str, again: bool = False) -> dict:
    """One ``promptmill run``, timed: {seconds, images, generate_s (the slowest host's loop)};
    ``again``: over the same OUT (``--overwrite``), with the cache the first run filled."""
    command = [*children.python("-m", "jobs.cli"), "run", *args, "--out", out, "--compile-cache", cache,
               "--no-progress", "--quiet", *(["--overwrite"] if again else [])]
    logs.event("bench_run_started", out=out, again=again)  # each arm takes minutes: say where the bench is
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    logs.event("bench_run_done", out=out, seconds=round(seconds, 1), code=done.returncode)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    events = host_events(out)
    hosts = [e for e in events if e["event"] == "host_done"]
    return {"seconds": round(seconds, 3), "images": sum(e["images"] for e in hosts),
            "steps": storage.read_json(naming.run_json(out))["settings"]["steps"],
            "generate_s": round(max(e["seconds"] for e in hosts), 3),
            "switches": [{k: e[k] for k in ("host", "size", "idle_s", "batch_s")}
                         for e in events if e["event"] == "size_switch"],
            "hashes": {r["key"]: r["sha256"] for r in parts.dataset_rows(out)}}


def host_events(out: str) -> list[dict]:
    return [e for path in sorted(storage.files(naming.join(out, "logs"), "host-*.log"))
            for e in map(logs.parse, storage.read_text(path).splitlines()) if e]


def summarize(sized: dict, alone: dict[str, dict]) -> dict:
    """The comparison (pure): images/s of each arm and their ratio, and the longest idle
    at a size switch against that switch's batch time."""
    images, seconds = sum(a["images"] for a in alone.values()), sum(a["seconds"] for a in alone.values())
    generate_s = sum(a["generate_s"] for a in alone.values())
    together = images / seconds
    sizes_rate = sized["images"] / sized["seconds"]
    switches = sized["switches"]
    worst = max(switches, key=lambda s: s["idle_s"] - s["batch_s"], default=None)
    same = {}
    for arm in alone.values():
        same.update(arm["hashes"])
    return {"images": sized["images"], "sizes_seconds": sized["seconds"], "singles_seconds": round(seconds, 3),
            "sizes_images_per_s": round(sizes_rate, 4), "singles_images_per_s": round(together, 4),
            "ratio": round(sizes_rate / together, 4), "ratio_at_least_0_9": sizes_rate / together >= 0.9,
            "steps": sized.get("steps"),
            "sizes_generate_s": sized["generate_s"], "singles_generate_s": round(generate_s, 3),
            "generate_ratio": round((sized["images"] / sized["generate_s"]) / (images / generate_s), 4)
            if generate_s and sized["generate_s"] else None,
            "switches": switches, "worst_switch": worst,
            "no_gap_over_a_batch": all(s["idle_s"] <= s["batch_s"] for s in switches),
            "same_bytes": sized["hashes"] == same}


def run(config: SizesBenchConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="promptmill-bench-sizes-") as scratch:
        folder = config.workdir or scratch
        os.makedirs(folder, exist_ok=True)
        every, alone = _prompts(folder, config)
        common = config.run_flags()
        passes = {}
        for name, again in (("cold", False), ("warm", True)):
            sized = _run(["--prompts", every, "--sizes", ",".join(config.sizes), *common],
                         os.path.join(folder, "sizes"), os.path.join(folder, "cache-sizes"), again)
            singles = {}
            for size in config.sizes:
                width, height = buckets.parse_size(size)
                singles[size] = _run(["--prompts", alone[size], "--width", str(width), "--height", str(height),
                                      *common], os.path.join(folder, f"single-{size}"),
                                     os.path.join(folder, f"cache-{size}"), again)
            passes[name] = {**summarize(sized, singles),
                            "arms": {"sizes": {k: v for k, v in sized.items() if k != "hashes"},
                                     **{size: {k: v for k, v in arm.items() if k not in ("hashes", "switches")}
                                        for size, arm in singles.items()}}}
    report = {"config": dataclasses.asdict(config), **passes}
    if config.report:
        storage.write_json(config.report, report)
    return report


def table(report: dict) -> str:
    lines = []
    for name in ("cold", "warm"):
        found = report[name]
        lines += [f"{name} compile caches", f"  {'arm':<22}{'images':>8}{'seconds':>10}{'images/s':>10}"
                                            f"{'generating s':>14}"]
        for arm_name, arm in found["arms"].items():
            label = f"{len(report['config']['sizes'])} sizes, one run" if arm_name == "sizes" else f"{arm_name} alone"
            lines.append(f"  {label:<22}{arm['images']:>8}{arm['seconds']:>10.2f}"
                         f"{arm['images'] / arm['seconds']:>10.3f}{arm['generate_s']:>14.2f}")
        worst = found["worst_switch"]
        lines += [f"  one run of several sizes / the single-size runs together: {found['ratio']:.3f} in images/s "
                  f"(>= 0.9: {found['ratio_at_least_0_9']}); the same bytes: {found['same_bytes']}",
                  "  size switches: " + (f"{len(found['switches'])}, the longest idle {worst['idle_s']:.3f} s against "
                                         f"a batch of {worst['batch_s']:.3f} s (no gap over a batch: "
                                         f"{found['no_gap_over_a_batch']})" if worst else "none")]
    return "\n".join(lines)
