"""``promptmill bench status``: how long ``promptmill status`` takes on a big run that is
partly generated, on a local folder and on a GCS emulator.

1. **A planned run.** ``--out`` names a planned OUT (e.g. the one ``promptmill bench plan
   --workdir W`` keeps in ``W/out``), or the bench plans one in ``WORKDIR/out``: the plan
   bench's synthetic prompts (``pipeline.bench.plan.generate``), then ``promptmill plan``
   in a subprocess, as that bench runs it.
2. **Some slices committed.** The first ``committed`` share of the slices, as ``hosts``
   hosts commit them (slice i by host i % hosts), get what a commit leaves under
   ``OUT/shards``: the commit marker (the stats a host writes), and the metadata shard
   and WebDataset tar as small placeholders (status never reads them: the test through
   the recording proxy shows it, and only their names are listed). Each host gets a
   progress object. Locally, the markers' times are spread over the last
   ``SPREAD_S`` seconds, so the rate and ETA are computed from a real spread. Images and
   thumbnails are not written: status neither lists nor reads them.
3. **Timed.** ``python -m jobs.cli status OUT --json`` (``STATUS_COMMAND``) in a fresh
   process, ``repeats`` times: the wall time of the whole command (interpreter start and
   imports included), and status's own ``seconds`` (its reads and listings). First on
   the local OUT, then on a GCS emulator the bench starts, holding a copy of run.json,
   the manifest, the rejects and the committed slices' objects and progress objects
   (not the plan's slice files: status never lists ``plan/``).
"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from pipeline.core import naming
from pipeline.io import storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATUS_COMMAND = ("-m", "jobs.cli", "status")  # a name in a command line: nothing of jobs/ is imported
BUCKET = "promptmill-status-bench"
SPREAD_S = 1800.0
PLACEHOLDER = b"placeholder: status lists this object's name and never reads it\n"


class BenchError(RuntimeError):
    pass


def commit_share(out: str, share: float, hosts: int, now: float) -> dict:
    """Commit the first ``share`` of the planned slices of ``out`` as ``hosts`` hosts
    would leave them under shards/ (see the module's docstring); returns what was written."""
    manifest = storage.read_json(naming.manifest(out))
    slices, size = manifest["slices"], manifest["slice_size"]
    count = max(1, round(slices * share))
    local = not storage.is_gcs(out)
    for index in range(count):
        images = size if index < slices - 1 else manifest["images"] - (slices - 1) * size
        committed_ts = now - SPREAD_S * (1 - (index + 1) / count)
        stats = {"slice": index, "host": index % hosts, "images": images, "padding": size - images,
                 "seconds": 60.0, "images_per_s": round(images / 60.0, 3), "started_ts": round(committed_ts - 60, 3),
                 "committed_ts": round(committed_ts, 3), "compiles_after_warmup": 0, "thumbnails": images}
        storage.write_bytes(naming.shard_metadata(out, index), PLACEHOLDER)
        storage.write_bytes(naming.shard_tar(out, index), PLACEHOLDER)
        storage.write_json(naming.shard_stats(out, index), stats)
        if local:
            os.utime(naming.shard_stats(out, index), (committed_ts, committed_ts))
    for host in range(hosts):
        mine = [i for i in range(count) if i % hosts == host]
        storage.write_json(naming.progress_file(out, naming.progress_name(host)), {
            "name": naming.progress_name(host), "host": host, "hosts": hosts, "pid": 0, "machine": f"host-{host}",
            "state": "generating", "started_at": now - SPREAD_S, "updated_at": now, "last_event": "slice_committed",
            "last_event_at": now, "last_slice": mine[-1] if mine else None, "slices": len(mine),
            "images": size * len(mine), "images_per_s": round(size / 60.0, 3), "skipped": 0, "redone": 0,
            "redone_slices": [], "padding_slots": 0, "failure": None})
    return {"slices": slices, "slice_size": size, "images": manifest["images"], "committed_slices": count,
            "objects_under_shards": 3 * count, "progress_objects": hosts}


def copy_to(out: str, target: str, committed: int, hosts: int) -> int:
    """Copy what status reads or lists of ``out`` to ``target``; returns how many objects."""
    names = ["run.json", "plan/manifest.json"]
    names += [os.path.relpath(p, out) for p in sorted(storage.files(naming.rejects_dir(out)))]
    for index in range(committed):
        names += [os.path.relpath(path, out) for path in (naming.shard_stats(out, index),
                                                           naming.shard_metadata(out, index),
                                                           naming.shard_tar(out, index))]
    names += [os.path.relpath(naming.progress_file(out, naming.progress_name(h)), out) for h in range(hosts)]
    for name in names:
        storage.write_bytes(naming.join(target, name), storage.read_bytes(os.path.join(out, name)))
    return len(names)


def time_status(out: str, repeats: int, env: dict) -> dict:
    """Wall seconds of ``promptmill status OUT --json`` in fresh processes, and its own ``seconds``."""
    walls, own, report = [], [], None
    command = [sys.executable, *STATUS_COMMAND, out, "--json"]
    for _ in range(repeats):
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        walls.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise BenchError(f"`{shlex.join(command)}` exited with {done.returncode}: {done.stderr[-2000:]}")
        report = json.loads(done.stdout)
        own.append(report["seconds"])
    return {"command": shlex.join(command[1:]), "wall_s": [round(w, 3) for w in walls],
            "median_wall_s": round(statistics.median(walls), 3), "status_seconds": own,
            "median_status_s": round(statistics.median(own), 3),
            "reported": {"state": report["state"], "committed": report["committed"], "planned": report["planned"],
                         "rate": report["rate"], "hosts": len(report["hosts"])}}


def _plan(workdir: str, prompts: int, shards: int, plan_flags: list[str]) -> str:
    from pipeline.bench import plan as plan_bench
    from pipeline.model import load as model_lib

    prompts_dir, out = os.path.join(workdir, "prompts"), os.path.join(workdir, "out")
    model_lib.resolve("tiny")
    plan_bench.generate(prompts_dir, prompts, shards)
    command = [sys.executable, *plan_bench.PLAN_COMMAND, "--prompts", os.path.join(prompts_dir, "*.jsonl"),
               "--out", out, "--model", "tiny", *plan_flags]
    with open(os.path.join(workdir, "plan.stderr"), "w") as err:
        if subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err).returncode != 0:
            raise BenchError(f"the plan failed: see {os.path.join(workdir, 'plan.stderr')}")
    return out


def run(out: str | None = None, prompts: int = 1_000_000, shards: int = 100, workdir: str | None = None,
        plan_flags: tuple[str, ...] = ("--devices-per-host", "4", "--per-device-batch", "8",
                                       "--batches-per-slice", "2"),
        committed: float = 0.01, hosts: int = 16, repeats: int = 3, gcs: bool = True) -> dict:
    """The bench (see the module's docstring); returns its report."""
    from pipeline.testing import emulator

    if not 0 < committed <= 1:
        raise ValueError(f"--committed must be a share of the slices in (0, 1], got {committed}")
    if hosts < 1 or repeats < 1:
        raise ValueError(f"--hosts and --repeats must be >= 1, got {hosts} and {repeats}")
    planned_here = out is None
    if planned_here:
        workdir = workdir or tempfile.mkdtemp(prefix="promptmill-status-bench-")
        os.makedirs(workdir, exist_ok=True)
        out = _plan(workdir, prompts, shards, list(plan_flags))
    if storage.is_gcs(out) or not os.path.exists(naming.manifest(out)):
        raise BenchError(f"--out {out} must be a local folder holding a planned run (plan/manifest.json)")
    storage.delete_prefix(naming.join(out, "shards"))  # the bench's own commits only
    storage.delete_prefix(naming.progress_dir(out))
    written = commit_share(out, committed, hosts, time.time())
    report = {"bench": "status", "out": out, "planned_here": planned_here, "committed_share": committed,
              "hosts": hosts, "repeats": repeats, **written,
              "machine": {"nproc": os.cpu_count(), "loadavg_before": list(os.getloadavg())},
              "local": time_status(out, repeats, dict(os.environ))}
    if gcs:
        with emulator.running(BUCKET) as url:
            target = f"gs://{BUCKET}/run"
            started = time.perf_counter()
            report["gcs_objects"] = copy_to(out, target, written["committed_slices"], hosts)
            report["gcs_upload_s"] = round(time.perf_counter() - started, 1)
            report["gcs"] = time_status(target, repeats, {**os.environ, **emulator.env_for(url)})
    return report


def table(report: dict) -> str:
    rows = [f"status of a run of {report['images']} planned images in {report['slices']} slices of "
            f"{report['slice_size']}, {report['committed_slices']} committed ({report['committed_share']:.0%}), "
            f"{report['hosts']} progress objects",
            f"{'where':8} {'command wall s (median)':>24} {'status own s (median)':>22}  runs"]
    for where in ("local", "gcs"):
        if where in report:
            r = report[where]
            rows.append(f"{where:8} {r['median_wall_s']:>24.3f} {r['median_status_s']:>22.3f}  {r['wall_s']}")
    return "\n".join(rows)
