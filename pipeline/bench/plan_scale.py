"""``promptmill bench plan``: wall time and peak memory of ``promptmill plan`` on many prompts.

Each plan-side measurement runs in a fresh process:

1. **Input.** ``shards`` JSONL files holding ``prompts`` synthetic prompts in all
   (``pipeline.bench.prompts``): the same bytes every run, a known share of bad rows
   and, with ``duplicates``, of rows repeating an earlier row's id.
2. **Plan.** ``python -m jobs.cli plan --prompts DIR/*.jsonl --out OUT --model tiny``
   (``PLAN_COMMAND``, a name in a command line: this module imports nothing of ``jobs/``)
   in a subprocess, measured by ``pipeline.bench.process_memory.run_measured``: its wall
   and CPU time, ``peak_rss_mib`` (the kernel's high-water mark of its largest process),
   ``tree_peak_rss_mib`` (the largest sum over its process tree, sampled every
   ``POLL_S``) and ``rss_timeline_mib`` (that sum over time, [seconds, MiB] pairs). With
   Beam's default in-memory DirectRunner the tree is one
   process. The tiny model is built (once, into the cache) before the clock starts, so
   the plan only reads its configs. Optionally, the same command again on the finished
   plan (``again``: it keeps the plan, and no plan object may change), and the same
   input planned by another checkout (``reference``: the same ``plan/`` bytes, measured
   side by side).
3. **Held in memory.** Another fresh process imports what the plan process imports
   (``BASELINE_MODULES``: ``apache_beam``, ``jobs.cli``, ``pipeline.plan.transforms``,
   by name): its RSS then is ``baseline_rss_mib``. It then reads every shard and keeps
   every row as ``records.parse_jsonl_line`` returns it (the ``Record`` objects planning
   works on) in one list; the RSS increase is ``held_in_memory_rss_mib``, the memory that
   holding all the prompts at once costs (if anything an underestimate: the records of
   a file share one ``source`` string). ``prompt_bytes_mib`` is the plain sum of the
   prompts' UTF-8 bytes.

The plan's output is then checked against what was generated (``verify``). ``sweep``
runs the bench at several sizes and gives the peak's growth per record between them.
Linux only (``/proc``, ``ru_maxrss`` in KiB).
"""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time

from pipeline.bench import prompts as prompts_lib
from pipeline.bench.process_memory import MIB, POLL_S, mib, run_measured, status_kib, tail

MARKER = ".promptmill-plan-bench"  # a workdir holding this file is ours to clear
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
# How the bench runs `promptmill plan` (after `python`), and what that process imports: module
# names, not imports, so that nothing in pipeline/ imports jobs/.
PLAN_COMMAND = ("-m", "jobs.cli", "plan")
BASELINE_MODULES = ("apache_beam", "jobs.cli", "pipeline.plan.transforms")
HOLD_UP_TO = 1_000_000  # prompts the held-in-memory process holds by default (10M would take ~6 GB)


class BenchError(RuntimeError):
    pass

# --- the held-in-memory process (``python -m pipeline.bench.plan_scale hold MODULES FILE...``) ---

def _hold(modules: list[str], paths: list[str]) -> dict:
    """In a fresh process: import ``modules`` (what the plan process imports), then hold every
    row as ``parse_jsonl_line`` returns it; RSS before and after, in KiB."""
    import gc
    import importlib

    start = time.perf_counter()
    for module in modules:  # the plan process's imports: the baseline
        importlib.import_module(module)
    from pipeline.core import records

    import_s = time.perf_counter() - start
    gc.collect()
    before = status_kib("self", "VmRSS")
    start = time.perf_counter()
    held, prompt_bytes = [], 0
    for path in paths:
        name = os.path.basename(path)  # auto ids as the plan makes them for DIR/*.jsonl: FILE:LINE
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                row = records.parse_jsonl_line(raw.rstrip(b"\r\n"), path, number, 0, f"{name}:{number}")
                if row is None:
                    continue
                held.append(row)
                if isinstance(row, records.Record):
                    prompt_bytes += len(row.prompt.encode("utf-8"))
    load_s = time.perf_counter() - start
    gc.collect()
    after = status_kib("self", "VmRSS")
    valid = sum(isinstance(r, records.Record) for r in held)
    return {"baseline_rss_kib": before, "held_rss_kib": after, "held_increase_kib": after - before,
            "peak_rss_kib": status_kib("self", "VmHWM"), "rows": len(held), "records": valid,
            "rejects": len(held) - valid, "prompt_bytes": prompt_bytes, "import_s": import_s, "load_s": load_s}


# --- the bench -------------------------------------------------------------------------

def _prepare_workdir(workdir: str | None) -> tuple[str, bool]:
    """(workdir, whether to delete it after). A given workdir must be empty, new, or ours."""
    if workdir is None:
        return tempfile.mkdtemp(prefix="promptmill-plan-bench-"), True
    workdir = os.path.abspath(workdir)
    if os.path.isdir(workdir) and os.listdir(workdir) and not os.path.exists(os.path.join(workdir, MARKER)):
        raise BenchError(f"--workdir {workdir} is not empty and was not made by this bench; give a new folder")
    os.makedirs(workdir, exist_ok=True)
    for name in ("prompts", "out"):
        shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    with open(os.path.join(workdir, MARKER), "w") as f:
        f.write("made by promptmill bench plan; its prompts/ and out/ are deleted on the next run\n")
    return workdir, False


def verify(out: str, rows: int, slice_size: int, duplicates: int = 0, dedupe: bool = False) -> dict:
    """Check the plan in ``out`` against the generated input; returns what was counted.

    Every count is known exactly (``prompts.expected_rejects``, one ``duplicate_id`` per
    pair of ``duplicates``) but, with ``dedupe``, the prompts that repeat by chance: there
    records + rejects must still be the rows, and every other count exact. Raises
    ``BenchError`` on any difference.
    """
    rejects = prompts_lib.expected_rejects(rows)
    if prompts_lib.expected_duplicate_ids(rows, duplicates):
        rejects = dict(sorted({**rejects, "duplicate_id": prompts_lib.expected_duplicate_ids(rows, duplicates)}.items()))
    with open(os.path.join(out, "plan", "manifest.json")) as f:
        manifest = json.load(f)
    if dedupe:  # the generator's prompts repeat by chance: the plan says how often
        rejects = dict(sorted({**rejects, **{k: v for k, v in manifest["rejects_by_reason"].items()
                                             if k == "duplicate_prompt"}}.items()))
    records = rows - sum(rejects.values())
    slice_dir = os.path.join(out, "plan", "slices")
    slice_files = sorted(os.listdir(slice_dir)) if os.path.isdir(slice_dir) else []
    items = 0
    for name in slice_files:
        with open(os.path.join(slice_dir, name), "rb") as f:
            items += f.read().count(b"\n")
    expected = {"records": records, "rejects": sum(rejects.values()), "rejects_by_reason": rejects,
                "images": records, "slices": math.ceil(records / slice_size), "slice_size": slice_size}
    problems = [f"manifest {k}: {manifest.get(k)!r}, expected {v!r}" for k, v in expected.items()
                if manifest.get(k) != v]
    if manifest.get("records", 0) + manifest.get("rejects", 0) != rows:
        problems.append(f"manifest records + rejects = {manifest.get('records')} + {manifest.get('rejects')}, "
                        f"expected {rows} input rows")
    if len(slice_files) != expected["slices"]:
        problems.append(f"{len(slice_files)} slice files in {slice_dir}, expected {expected['slices']}")
    if items != records:
        problems.append(f"{items} items in the slice files, expected {records}")
    if problems:
        raise BenchError("the plan's output does not match its input:\n  " + "\n  ".join(problems))
    return {"manifest": manifest, "slice_files": len(slice_files), "slice_items": items}


def plan_state(out: str) -> dict:
    """{"digest": sha256 of every plan/ object's name and bytes but the input and model
    tables (which hold times and sizes), "written": {name: mtime in ns} of those objects,
    "objects": {name: sha256 of its bytes}}."""
    import hashlib

    digest, written, objects = hashlib.sha256(), {}, {}
    root = os.path.join(out, "plan")
    for folder, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, out)
            if relative in ("plan/inputs.json", "plan/input_cache.json", "plan/model_files.json"):
                continue
            with open(path, "rb") as f:
                data = f.read()
            digest.update(relative.encode() + b"\0" + data + b"\0")
            written[relative] = os.stat(path).st_mtime_ns
            objects[relative] = hashlib.sha256(data).hexdigest()
    return {"digest": digest.hexdigest(), "written": written, "objects": objects}


def compare_plans(ours: dict, theirs: dict) -> dict:
    """Two ``plan_state``s' objects side by side: "same_plan_bytes" when every object the
    other plan wrote is ours too, byte for byte; "differ" and "missing" name those that are
    not (at most 10 each); "only_ours": {folder: count} of what this version writes besides
    (an earlier version may not write a newer object, e.g. the key index ``plan/keys/``)."""
    ours, theirs = ours["objects"], theirs["objects"]
    differ = sorted(name for name in theirs if name in ours and ours[name] != theirs[name])
    missing = sorted(name for name in theirs if name not in ours)
    only_ours = {}
    for name in ours:
        if name not in theirs:
            folder = os.path.dirname(name)
            only_ours[folder] = only_ours.get(folder, 0) + 1
    return {"same_plan_bytes": not differ and not missing, "objects_compared": len(theirs),
            "differ": differ[:10], "missing": missing[:10], "only_ours": dict(sorted(only_ours.items()))}


def _machine() -> dict:
    import apache_beam

    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    except (OSError, StopIteration):
        pass
    return {"nproc": os.cpu_count(), "mem_total_mib": mib(mem), "loadavg_before": list(os.getloadavg()),
            "python": platform.python_version(), "apache_beam": apache_beam.__version__,
            "platform": platform.platform()}


def run(prompts: int = 1_000_000, *, shards: int = 100, workdir: str | None = None, devices_per_host: int = 4,
        per_device_batch: int = 8, batches_per_slice: int = 32, beam_args: list[str] | None = None,
        model: str = "tiny", plan_command: tuple[str, ...] = PLAN_COMMAND,
        baseline_modules: tuple[str, ...] = BASELINE_MODULES, dedupe: bool = False, duplicates: float = 0.0,
        hold: bool | None = None, again: bool = False, reference: str | None = None) -> dict:
    """Generate the input, plan it in a fresh process, hold it in another; returns the report.

    ``workdir``: where the prompts, the plan's OUT and its logs go, kept after the run
    (default: a temporary folder, deleted after a successful run). The slice size is
    ``devices_per_host x per_device_batch x batches_per_slice``, as for ``plan``.
    ``plan_command``: the arguments after ``python`` that run ``promptmill plan``;
    ``baseline_modules``: what that process imports, imported by the held-in-memory process.
    ``dedupe``: plan with ``--dedupe``; ``duplicates``: the share of rows that repeat an
    earlier row's id (``prompts.generate``); ``hold``: measure the held-in-memory process
    (default: up to ``HOLD_UP_TO`` prompts); ``again``: then run the same plan command
    again on the finished plan, which keeps it: timed, and no plan object may be written
    again; ``reference``: the root of another promptmill checkout (an earlier version),
    whose plan of the same input, in its own fresh process right after, is measured the
    same way and must write the same ``plan/`` bytes.
    """
    from pipeline.core import slicing
    from pipeline.model import load as model_lib

    beam_args = list(beam_args or [])
    every = round(1 / duplicates) if duplicates > 0 else 0
    hold = prompts <= HOLD_UP_TO if hold is None else hold
    slice_size = slicing.slice_size(devices_per_host, per_device_batch, batches_per_slice)
    workdir, temporary = _prepare_workdir(workdir)
    prompts_dir, out = os.path.join(workdir, "prompts"), os.path.join(workdir, "out")
    machine = _machine()
    model_lib.resolve(model)  # build the tiny model into the cache now, not inside the timed plan
    generated = prompts_lib.generate(prompts_dir, prompts, shards, duplicates=every)
    env = dict(os.environ)

    plan_argv = [sys.executable, *plan_command, "--prompts", os.path.join(prompts_dir, "*.jsonl"),
                 "--out", out, "--model", model, "--devices-per-host", str(devices_per_host),
                 "--per-device-batch", str(per_device_batch), "--batches-per-slice", str(batches_per_slice),
                 *(["--dedupe"] if dedupe else []), *beam_args]
    measured = _plan(plan_argv, env, ROOT, workdir, "plan")
    checked = verify(out, prompts, slice_size, every, dedupe)
    planned = plan_state(out)
    report = {
        "bench": "plan",
        "settings": {"prompts": prompts, "shards": shards, "model": model, "devices_per_host": devices_per_host,
                     "per_device_batch": per_device_batch, "batches_per_slice": batches_per_slice,
                     "slice_size": slice_size, "beam_args": beam_args, "generator_seed": prompts_lib.SEED,
                     "dirty_every": prompts_lib.DIRTY_EVERY, "poll_s": POLL_S, "dedupe": dedupe,
                     "duplicate_ids_every": every},
        "machine": machine, "command": shlex.join(plan_argv[1:]), "rows": prompts, "input_bytes": generated["bytes"],
        "input_mib": round(generated["bytes"] / MIB, 1), "generate_s": round(generated["seconds"], 2),
        **_figures(measured, prompts), "plan_digest": planned["digest"], **checked, "verified": True}
    if again:
        kept = _plan(plan_argv, env, ROOT, workdir, "again")
        if plan_state(out) != planned:
            raise BenchError(f"the same plan again wrote plan objects again (in {out})")
        report["again"] = {**_figures(kept, prompts), "over_first": round(kept["wall_s"] / measured["wall_s"], 4),
                           "stage_over_first": round(kept["stage_s"] / measured["stage_s"], 4),
                           "plan_objects_unchanged": len(planned["written"])}
    if reference:
        other = os.path.join(workdir, "out-reference")
        shutil.rmtree(other, ignore_errors=True)
        argv = [*plan_argv[:plan_argv.index("--out") + 1], other, *plan_argv[plan_argv.index("--out") + 2:]]
        theirs = _plan(argv, env, os.path.abspath(reference), workdir, "reference")
        verify(other, prompts, slice_size, every, dedupe)
        compared = compare_plans(planned, plan_state(other))
        report["reference"] = {"root": os.path.abspath(reference), **_figures(theirs, prompts), **compared,
                               "wall_ratio": round(measured["wall_s"] / theirs["wall_s"], 3),
                               "peak_rss_ratio": round(measured["peak_rss_kib"] / theirs["peak_rss_kib"], 3)}
        if not compared["same_plan_bytes"]:
            raise BenchError(f"{out} and {other}: the same input planned by {reference} wrote other plan/ bytes "
                             f"(differ: {compared['differ']}; not written here: {compared['missing']})")
    if hold:
        report.update(_held(generated["paths"], baseline_modules, env, workdir, prompts, measured["peak_rss_kib"]))
    report["workdir"] = None if temporary else workdir
    if temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def _plan(argv: list[str], env: dict, cwd: str, workdir: str, name: str) -> dict:  # one measured plan command
    measured = run_measured(argv, env, cwd, os.path.join(workdir, name))
    if measured["exit_code"] != 0:
        raise BenchError(f"{name} exited with {measured['exit_code']} (logs in {workdir}):\n"
                         f"{tail(os.path.join(workdir, name + '.stderr'))}")
    with open(os.path.join(workdir, name + ".stderr"), errors="replace") as f:  # the plan stage, without start-up
        done = [json.loads(line) for line in f if '"event": "plan_done"' in line]
    return {**measured, "stage_s": done[-1]["seconds"] if done else None}


def _figures(measured: dict, rows: int) -> dict:
    """Wall, CPU and peak RSS of one measured plan, and its peak per record."""
    return {"wall_s": round(measured["wall_s"], 2), "cpu_s": round(measured["cpu_s"], 2), "stage_s": measured["stage_s"],
            "rows_per_s": round(rows / measured["wall_s"], 1), "peak_rss_mib": mib(measured["peak_rss_kib"]),
            "tree_peak_rss_mib": mib(measured["tree_peak_rss_kib"]),
            "peak_rss_bytes_per_record": round(measured["peak_rss_kib"] * 1024 / rows, 1),
            "tree_peak_rss_bytes_per_record": round(measured["tree_peak_rss_kib"] * 1024 / rows, 1),
            "sampled_hwm_mib": mib(measured["sampled_hwm_kib"]), "processes_seen": measured["processes_seen"],
            "rss_timeline_mib": measured["timeline"]}


def _held(paths: list[str], baseline_modules: tuple[str, ...], env: dict, workdir: str, rows: int,
          peak: int) -> dict:
    """The held-in-memory process's figures (see the module's docstring)."""
    hold_argv = [sys.executable, "-m", "pipeline.bench.plan_scale", "hold", ",".join(baseline_modules), *paths]
    held_run = run_measured(hold_argv, env, ROOT, os.path.join(workdir, "hold"))
    if held_run["exit_code"] != 0:
        raise BenchError(f"the held-in-memory process exited with {held_run['exit_code']}:\n"
                         f"{tail(os.path.join(workdir, 'hold.stderr'))}")
    with open(os.path.join(workdir, "hold.stdout")) as f:
        held = json.loads(f.read().strip().splitlines()[-1])
    if held["rows"] != rows:
        raise BenchError(f"the held-in-memory process read {held['rows']} rows, expected {rows}")
    baseline, increase = held["baseline_rss_kib"], held["held_increase_kib"]
    return {"prompt_bytes": held["prompt_bytes"], "prompt_bytes_mib": round(held["prompt_bytes"] / MIB, 1),
            "baseline_rss_mib": mib(baseline), "baseline_import_s": round(held["import_s"], 2),
            "plan_increment_mib": mib(peak - baseline), "held_in_memory_rss_mib": mib(increase),
            "held_in_memory_total_rss_mib": mib(held["held_rss_kib"]),
            "held_in_memory_load_s": round(held["load_s"], 2), "held_records": held["records"],
            "held_rejects": held["rejects"], "baseline_modules": list(baseline_modules),
            "peak_over_held_in_memory": round(peak / increase, 3) if increase > 0 else None,
            "increment_over_held_in_memory": round((peak - baseline) / increase, 3) if increase > 0 else None}


def sweep(sizes: list[int], workdir: str | None = None, **options) -> dict:
    """``run`` at each of ``sizes`` prompts (in ``workdir/N``), and how the plan's peak RSS
    grew per record from each size to the next (bytes a record, largest process and tree)."""
    runs = []
    for prompts in sizes:
        where = None if workdir is None else os.path.join(workdir, str(prompts))
        runs.append(run(prompts, workdir=where, **options))
    per_record = lambda a, b, field: round((b[field] - a[field]) * MIB / (b["rows"] - a["rows"]), 1)  # noqa: E731
    growth = []
    for a, b in zip(runs, runs[1:]):
        growth.append({"from": a["rows"], "to": b["rows"], "peak_rss_bytes_per_record": per_record(a, b, "peak_rss_mib"),
                       "tree_peak_rss_bytes_per_record": per_record(a, b, "tree_peak_rss_mib")})
        if "reference" in a and "reference" in b:  # the other checkout's, planned side by side
            growth[-1]["reference_peak_rss_bytes_per_record"] = per_record(
                {**a["reference"], "rows": a["rows"]}, {**b["reference"], "rows": b["rows"]}, "peak_rss_mib")
    return {"bench": "plan", "sweep": sizes, "runs": runs, "growth": growth}


def table(report: dict) -> str:
    """The report (``run``'s or ``sweep``'s) for people."""
    if "runs" in report:
        rows = [f"{'prompts':>12} {'wall s':>8} {'CPU s':>8} {'peak RSS MiB':>13} {'tree MiB':>9} "
                f"{'B/record':>9} {'again s':>8}  digest"]
        for r in report["runs"]:
            again = f"{r['again']['wall_s']:>8}" if "again" in r else f"{'':>8}"
            rows.append(f"{r['rows']:>12,} {r['wall_s']:>8} {r['cpu_s']:>8} {r['peak_rss_mib']:>13} "
                        f"{r['tree_peak_rss_mib']:>9} {r['peak_rss_bytes_per_record']:>9} {again}  "
                        f"{r['plan_digest'][:12]}")
        rows += [f"{r['rows']:>12,} reference: {r['reference']['wall_s']} s wall, {r['reference']['cpu_s']} s CPU, "
                 f"{r['reference']['peak_rss_mib']} MiB peak, the same plan/ bytes: {r['reference']['same_plan_bytes']}"
                 for r in report["runs"] if "reference" in r]
        rows += [f"peak RSS grew {g['peak_rss_bytes_per_record']} bytes a record from {g['from']:,} to {g['to']:,} "
                 f"prompts (tree: {g['tree_peak_rss_bytes_per_record']}"
                 + (f"; reference: {g['reference_peak_rss_bytes_per_record']}"
                    if "reference_peak_rss_bytes_per_record" in g else "") + ")" for g in report["growth"]]
        return "plan bench sweep\n" + "\n".join(rows)
    s = report["settings"]
    rows = [
        ("input", f"{report['rows']:,} rows in {s['shards']} jsonl shards, {report['input_mib']} MiB, generated in "
                  f"{report['generate_s']} s" + (f" (one in {s['duplicate_ids_every']} repeating an id)"
                                                 if s["duplicate_ids_every"] else "")),
        ("plan", f"{report['wall_s']} s wall, {report['cpu_s']} s CPU, {report['rows_per_s']:,} rows/s, "
                 f"{report['processes_seen']} process(es){', --dedupe' if s['dedupe'] else ''}"),
        ("plan peak RSS", f"{report['peak_rss_mib']} MiB (largest process), {report['tree_peak_rss_mib']} MiB "
                          f"(tree, sampled every {s['poll_s']} s): {report['peak_rss_bytes_per_record']} bytes a "
                          f"record"),
    ]
    if "again" in report:
        again = report["again"]
        rows.append(("plan again", f"{again['wall_s']} s wall ({again['over_first']} of the first), plan stage "
                                   f"{again['stage_s']} s ({again['stage_over_first']} of the first's "
                                   f"{report['stage_s']} s): the plan kept, {again['plan_objects_unchanged']} plan "
                                   f"objects unchanged"))
    if "reference" in report:
        ref = report["reference"]
        besides = ", ".join(f"{n} in {folder}/" for folder, n in ref["only_ours"].items())
        rows.append(("reference", f"{ref['root']}: {ref['wall_s']} s wall, {ref['peak_rss_mib']} MiB peak; the same "
                                  f"plan/ bytes: {ref['same_plan_bytes']} ({ref['objects_compared']} objects"
                                  + (f"; this version writes besides: {besides}" if besides else "") + ")"))
    if "held_in_memory_rss_mib" in report:
        rows += [
            ("baseline RSS", f"{report['baseline_rss_mib']} MiB after importing "
                             f"{', '.join(report['baseline_modules'])} (plan's increment over it: "
                             f"{report['plan_increment_mib']} MiB)"),
            ("held in memory", f"{report['held_in_memory_rss_mib']} MiB more RSS to hold all {report['rows']:,} "
                               f"parsed rows at once ({report['held_in_memory_total_rss_mib']} MiB in all)"),
            ("peak / held", f"{report['peak_over_held_in_memory']} (increment / held: "
                            f"{report['increment_over_held_in_memory']})")]
    rows.append(("output", f"{report['manifest']['records']:,} records + {report['manifest']['rejects']} rejects, "
                           f"{report['slice_files']} slices of {s['slice_size']}: verified"))
    width = max(len(name) for name, _ in rows)
    return f"plan bench on {report['machine']['nproc']} CPUs\n" + "\n".join(
        f"{name:<{width}}  {text}" for name, text in rows)


def _main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "hold":
        print(json.dumps(_hold([m for m in argv[1].split(",") if m], argv[2:])))
        return 0
    print("usage: python -m pipeline.bench.plan_scale hold MODULE,... FILE... (a helper of `promptmill bench plan`)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
