"""``promptmill bench status``: what ``promptmill status`` and a starting host read, and how
long they take, on runs of 10k, 100k and 1M committed slices.

For each size N (``--committed-slices``):

1. **A run as its hosts leave it.** A run planned in ``N / COMMITTED_SHARE`` slices of
   1,024 images (run.json and the manifest, as the plan writes them; status never reads
   the plan's slice files, so none are written), whose first N slices are committed as
   ``hosts`` pod hosts commit them (slice i by host i % hosts, each host a slice every
   ``SLICE_S`` seconds, the last just now): each slice's commit marker (its stats, and
   its time), each host's progress object and each host's ledger (``pipeline.io.ledgers``: its slices as runs of
   its stride, counts, recent commits). Only the markers are written of each slice's
   objects: a listing of ``shards/`` on GCS asks for the markers alone (``matchGlob``).
2. **status, in a fresh process** (``python -m pipeline.bench.status_scale count OUT``,
   ``repeats`` times): the whole command's wall time, status's own ``seconds``, and the
   storage layer's calls it made (reads, existence checks, listings, and the objects
   the listings returned), counted by wrapping them. Then the same with the ledgers put
   aside, so that status lists the markers, as it did before the ledgers and as it does
   when they cannot be trusted.
3. **A starting host** of the run (host 0), in this process: what it reads to find its
   committed slices (``HostLedger.start``) and to decide its first slot still to do, and
   how long that takes; then the same with the ledgers put aside (a listing of every
   marker).

Optionally (``gcs_up_to``) the same status measurement on a GCS emulator the bench starts,
for the sizes up to that many slices, holding a copy of what status reads or lists.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from pipeline.core import buckets, naming
from pipeline.core.settings import Run, Settings
from pipeline.io import inventory, ledgers, runs, storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = "promptmill-status-bench"
SLICE_S = 60.0  # a host commits a slice of SLICE_SIZE images a minute (17 images/s)
SLICE_SIZE = 1024
COMMITTED_SHARE = 0.99  # of the planned slices: the run is still generating, so status gives a rate and an ETA
# the storage layer's calls that list objects, and all it counts: (module, name)
LISTINGS = ((storage, "files"), (inventory, "modified_times"), (inventory, "listed"))
COUNTED = ((storage, "read_bytes"), (storage, "exists"), *LISTINGS)
LISTING_NAMES = tuple(name for _, name in LISTINGS)


class BenchError(RuntimeError):
    pass


def make_run(out: str, committed: int, hosts: int, now: float) -> dict:
    """The run of step 1 in ``out`` (see the module's docstring); returns what was written."""
    planned = math.ceil(committed / COMMITTED_SHARE)
    settings = Settings(prompts="gs://bench/prompts/*.jsonl", out=out, model="tiny", width=32, height=32, steps=20,
                        scheduler="ddim", devices_per_host=4, per_device_batch=8, batches_per_slice=32, guided=True)
    run = Run.create(settings, "b" * 64, "2026-01-01T00:00:00+00:00", {})
    runs.write(out, run)
    images = planned * SLICE_SIZE - 100
    manifest = {"slices": planned, "slice_size": SLICE_SIZE, "images": images, "records": images, "rejects": 0,
                "rejects_by_reason": {}, "input_rows": images, "input_files": 1000}
    storage.write_json(naming.manifest(out), manifest)
    geometry = buckets.Geometry.of_manifest(manifest, 32, 32, 8)
    os.makedirs(naming.join(out, "shards"), exist_ok=True)
    def when(index: int) -> float:
        return now - (committed - 1 - index) * SLICE_S / hosts

    for index in range(committed):  # plain writes: a million small files, as fast as this machine writes them
        path = naming.shard_stats(out, index)
        with open(path, "w") as f:
            json.dump({"slice": index, "host": index % hosts, "images": SLICE_SIZE, "padding": 0,
                       "started_ts": round(when(index) - SLICE_S, 3), "committed_ts": round(when(index), 3),
                       "thumbnails": SLICE_SIZE}, f)
        os.utime(path, (when(index), when(index)))
    for host in range(hosts):
        mine = range(host, committed, hosts)
        recent = tuple((when(i), SLICE_SIZE) for i in mine if when(i) >= now - ledgers.RECENT_S)[-ledgers.RECENT_MAX:]
        ledger = ledgers.Ledger(host, hosts, run.settings_fingerprint, planned,
                                ((mine[0], mine[-1]),) if len(mine) else (), len(mine), len(mine) * SLICE_SIZE, (),
                                recent, max((t for t, _ in recent), default=None), now)
        storage.write_json(naming.ledger_file(out, host), ledger.to_json())
        storage.write_json(naming.progress_file(out, naming.progress_name(host)), {
            "name": naming.progress_name(host), "host": host, "hosts": hosts, "pid": 0, "machine": f"host-{host}",
            "state": "generating", "started_at": when(0), "updated_at": now, "last_event": "slice_committed",
            "last_event_at": now, "last_slice": mine[-1] if len(mine) else None, "slices": len(mine),
            "images": SLICE_SIZE * len(mine), "images_per_s": round(SLICE_SIZE / 60.0, 3), "skipped": 0,
            "redone": 0, "redone_slices": [], "padding_slots": 0, "failure": None})
    return {"planned_slices": planned, "committed_slices": committed, "slice_size": SLICE_SIZE,
            "images": images, "hosts": hosts, "geometry_slices": geometry.slices}


class Counter:
    """Counts the storage layer's calls (and the objects its listings return) inside a
    ``with`` block."""

    def __enter__(self):
        self.calls = {name: 0 for _, name in COUNTED}
        self.listed = 0
        self.real = {(module, name): getattr(module, name) for module, name in COUNTED}
        for (module, name), real in self.real.items():
            setattr(module, name, self._wrap(name, real))
        return self

    def __exit__(self, *_):
        for (module, name), real in self.real.items():
            setattr(module, name, real)

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            self.calls[name] += 1
            found = real(*args, **kwargs)
            if name == "files":  # a stream of paths: counted as they are taken
                return self._counted(found)
            if name in LISTING_NAMES:
                self.listed += len(found)
            return found
        return call

    def _counted(self, paths):
        for path in paths:
            self.listed += 1
            yield path

    def counts(self) -> dict:
        return {"reads": self.calls["read_bytes"], "exists": self.calls["exists"],
                "objects_read": self.calls["read_bytes"] + self.calls["exists"],
                "listings": sum(self.calls[name] for name in LISTING_NAMES),
                "objects_listed": self.listed}


def _count(out: str) -> dict:
    """In a fresh process (``python -m pipeline.bench.status_scale count OUT``): status, counted."""
    from pipeline.collect import status

    with Counter() as counter:
        found = status.status(out)
    return {"seconds": found["seconds"], **counter.counts(), "counted_from": found["committed"]["counted_from"],
            "committed": found["committed"]["slices"], "state": found["state"]}


def time_status(out: str, repeats: int, env: dict) -> dict:
    """Wall seconds of status in fresh processes, its own ``seconds`` and what it read."""
    walls, found = [], []
    command = [sys.executable, "-m", "pipeline.bench.status_scale", "count", out]
    for _ in range(repeats):
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        walls.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise BenchError(f"`{shlex.join(command)}` exited with {done.returncode}: {done.stderr[-2000:]}")
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"wall_s": [round(w, 3) for w in walls], "median_wall_s": round(statistics.median(walls), 3),
            "median_status_s": round(statistics.median(f["seconds"] for f in found), 3), **found[-1]}


def time_host(out: str, host: int, hosts: int) -> dict:
    """What host ``host`` reads to find its committed slices and its first slot to do."""
    from pipeline.output import writer

    run, manifest = runs.read(out), storage.read_json(naming.manifest(out))
    geometry = buckets.Geometry.of_manifest(manifest, run.settings.width, run.settings.height,
                                            run.settings.per_device_batch)
    with Counter() as counter:
        started = time.perf_counter()
        committed = ledgers.HostLedger(out, run, geometry, host, hosts).start()
        first = next((slot for _, slot in buckets.host_slots(host, hosts, geometry)
                      if slot is None or slot not in committed), None)
        if first is not None and not writer.is_committed(out, first):  # what the host loop asks of that slot
            writer.leftovers(out, run.settings, first)
        seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 4), "committed": len(committed), "first_slot": first, **counter.counts()}


def _aside(out: str) -> str:
    """Put the ledgers aside (status and hosts then list the markers); returns where."""
    aside = naming.join(out, "ledger-aside")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(naming.ledger_dir(out), aside)
    return aside


def copy_to(out: str, target: str) -> int:
    """Copy what status reads or lists of ``out`` to ``target``; returns how many objects."""
    names = [os.path.relpath(path, out) for path in sorted(storage.files(out)) if "ledger-aside" not in path]
    for name in names:
        storage.write_bytes(naming.join(target, name), storage.read_bytes(os.path.join(out, name)))
    return len(names)


def run(sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000), hosts: int = 16, repeats: int = 3,
        workdir: str | None = None, gcs_up_to: int = 0) -> dict:
    """The bench (see the module's docstring); returns its report."""
    if hosts < 1 or repeats < 1 or not sizes or min(sizes) < 1:
        raise ValueError(f"--hosts, --repeats and every --committed-slices must be >= 1, got {hosts}, {repeats}, "
                         f"{sizes}")
    workdir = workdir or tempfile.mkdtemp(prefix="promptmill-status-bench-")
    report = {"bench": "status", "hosts": hosts, "repeats": repeats, "workdir": workdir,
              "machine": {"nproc": os.cpu_count(), "loadavg_before": list(os.getloadavg())}, "runs": []}
    for size in sizes:
        out = os.path.join(workdir, str(size))
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        found = {**make_run(out, size, hosts, time.time()), "written_s": round(time.perf_counter() - started, 1)}
        found["ledgers"] = {"status": time_status(out, repeats, dict(os.environ)), "host": time_host(out, 0, hosts)}
        if size <= gcs_up_to:
            found["ledgers"]["gcs"] = _on_gcs(out, repeats)
        aside = _aside(out)
        found["listing"] = {"status": time_status(out, repeats, dict(os.environ)), "host": time_host(out, 0, hosts)}
        if size <= gcs_up_to:
            found["listing"]["gcs"] = _on_gcs(out, repeats)
        shutil.rmtree(naming.ledger_dir(out), ignore_errors=True)  # the fallback wrote host 0's afresh
        os.rename(aside, naming.ledger_dir(out))
        report["runs"].append(found)
    return report


def _on_gcs(out: str, repeats: int) -> dict:
    from pipeline.testing import emulator

    with emulator.running(BUCKET) as url:  # this process points at it while the block runs
        target = f"gs://{BUCKET}/run"
        copied = copy_to(out, target)
        return {"objects_copied": copied, "status": time_status(target, repeats, {**os.environ,
                                                                                  **emulator.env_for(url)})}


def table(report: dict) -> str:
    rows = [f"status and a starting host on runs of {report['hosts']} hosts (slices of {SLICE_SIZE}), "
            f"{report['repeats']} status runs each",
            f"{'committed':>10} {'counted':>8} {'status s':>9} {'wall s':>7} {'read':>6} {'listed':>8} "
            f"{'host s':>8} {'host read':>10} {'host listed':>12}"]
    for r in report["runs"]:
        for how in ("ledgers", "listing"):
            s, h = r[how]["status"], r[how]["host"]
            rows.append(f"{r['committed_slices']:>10,} {how:>8} {s['median_status_s']:>9} {s['median_wall_s']:>7} "
                        f"{s['objects_read']:>6} {s['objects_listed']:>8} {h['seconds']:>8} {h['objects_read']:>10} "
                        f"{h['objects_listed']:>12}")
            if "gcs" in r[how]:
                g = r[how]["gcs"]["status"]
                rows.append(f"{'':>10} {'(gcs)':>8} {g['median_status_s']:>9} {g['median_wall_s']:>7} "
                            f"{g['objects_read']:>6} {g['objects_listed']:>8}")
    return "\n".join(rows)


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "count":
        print(json.dumps(_count(argv[1])))
        return 0
    print("usage: python -m pipeline.bench.status_scale count OUT (a helper of `promptmill bench status`)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
