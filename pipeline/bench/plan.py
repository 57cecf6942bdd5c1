"""``promptmill bench plan``: wall time and peak memory of ``promptmill plan`` on many prompts.

Three steps, each plan-side measurement in a fresh process:

1. **Input.** ``shards`` JSONL files holding ``prompts`` synthetic prompts in all, made
   deterministically from the word lists below (fixed seed): 40-200 characters, a few
   non-ASCII words; some rows carry an ``id`` (string or integer), a ``seed``,
   ``num_images`` 1, a ``negative_prompt``, a ``guidance_scale`` or an extra field. One
   row in ``DIRTY_EVERY`` is bad in one of four ways (invalid JSON, empty prompt,
   ``num_images`` 0, no prompt), so the rejects path runs too and the expected counts
   are known exactly.
2. **Plan.** ``python -m jobs.cli plan --prompts DIR/*.jsonl --out OUT --model tiny``
   (``PLAN_COMMAND``, a name in a command line: this module imports nothing of ``jobs/``)
   in a subprocess, started by a small launcher process (``_launch``) and timed from
   start to exit. Its memory is measured twice: ``peak_rss_mib`` is the kernel's
   high-water mark (``os.wait4``'s ``ru_maxrss``: the largest RSS any single process of
   the tree reached, exact); ``tree_peak_rss_mib`` is the largest sum of ``VmRSS`` over
   the process and all its descendants, sampled from ``/proc`` every ``POLL_S`` (it
   counts shared pages once per process, and can miss a peak shorter than the
   interval); ``rss_timeline_mib`` is that sum over time, [seconds, MiB] pairs, thinned
   to ``TIMELINE_POINTS``. With Beam's default in-memory DirectRunner the tree is one
   process. The tiny model is built (once, into the cache) before the clock starts, so
   the plan only reads its configs.
3. **Held in memory.** Another fresh process imports what the plan process imports
   (``BASELINE_MODULES``: ``apache_beam``, ``jobs.cli``, ``pipeline.plan.transforms``,
   by name): its RSS then is ``baseline_rss_mib``. It then reads every shard and keeps every row as
   ``records.parse_jsonl_line`` returns it (the ``Record`` objects planning works on)
   in one list; the RSS increase is ``held_in_memory_rss_mib``, the memory that
   holding all the prompts at once costs. (Every record of a file shares one ``source``
   string here, so this is if anything an underestimate.) ``prompt_bytes_mib`` is the
   plain sum of the prompts' UTF-8 bytes.

The plan's output is then checked against what was generated: the manifest's records,
rejects by reason, images and slice count, the slice files and the items in them. Any
difference is a ``BenchError``.

Linux only (``/proc``, ``ru_maxrss`` in KiB).
"""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

SEED = 20240611
DIRTY_EVERY = 9973  # one bad row in this many (global row index % DIRTY_EVERY == DIRTY_OFFSET)
DIRTY_OFFSET = 17
MIN_CHARS, MAX_CHARS = 40, 200
POLL_S = 0.2
TIMELINE_POINTS = 100  # of the plan's RSS over time, in the report
MARKER = ".promptmill-plan-bench"  # a workdir holding this file is ours to clear
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
# How the bench runs `promptmill plan` (after `python`), and what that process imports: module
# names, not imports, so that nothing in pipeline/ imports jobs/.
PLAN_COMMAND = ("-m", "jobs.cli", "plan")
BASELINE_MODULES = ("apache_beam", "jobs.cli", "pipeline.plan.transforms")
MIB = 1 << 20

# --- the prompt generator ---------------------------------------------------------

_ARTICLES = ("a", "an old", "a small", "a lonely", "a giant", "two", "three", "a family of", "a pair of", "the last")
_ADJECTIVES = ("weathered", "glowing", "ancient", "tiny", "rusty", "crystal", "mechanical", "sleepy", "majestic",
               "forgotten", "neon", "wooden", "golden", "moss-covered", "translucent", "paper", "clockwork",
               "feathered", "frozen", "velvet")
_SUBJECTS = ("lighthouse keeper", "red fox", "astronaut", "tea house", "sailing ship", "owl", "robot gardener",
             "cathedral", "koi pond", "street musician", "dragon", "bicycle", "library", "mountain goat", "violin",
             "submarine", "market stall", "samurai", "greenhouse", "windmill", "jellyfish", "train station",
             "cat", "café terrace", "hot air balloon")
_ACTIONS = ("standing in", "drifting over", "hidden inside", "sleeping beside", "reflected in", "floating above",
            "walking through", "overlooking", "painted on the wall of", "half buried in")
_PLACES = ("a foggy harbour", "a bamboo forest", "the ruins of a city", "a desert at noon", "a snowy village",
           "a flooded library", "a street market in Zürich", "a temple garden in Kyōto", "the old town of Kraków",
           "an alien canyon", "a rainy alley", "a field of sunflowers", "the rings of Saturn", "a coral reef",
           "a quiet suburb", "a night train", "the Fjärden archipelago", "a candle-lit cellar")
_MODIFIERS = ("oil painting", "watercolor", "35mm photograph", "isometric render", "ukiyo-e woodblock print",
              "charcoal sketch", "studio lighting", "golden hour", "volumetric fog", "soft focus", "high detail",
              "8k", "wide angle", "macro shot", "by a Renaissance master", "art nouveau poster", "cinematic",
              "pastel colors", "long exposure", "low poly", "tilt-shift", "dramatic shadows", "film grain",
              "trending on an art forum", "muted palette", "vivid colors", "symmetrical composition",
              "bokeh", "backlit", "morning mist", "storybook illustration", "pixel art", "naïve painting",
              "photorealistic", "matte painting", "hand-drawn", "cyanotype", "stained glass", "double exposure")
_NEGATIVES = ("blurry, low quality", "text, watermark", "extra fingers, deformed", "oversaturated")
_GUIDANCE = ("5.0", "7.5", "9.0", "12")
MAX_MODIFIERS = 7

for _word in (*_ARTICLES, *_ADJECTIVES, *_SUBJECTS, *_ACTIONS, *_PLACES, *_MODIFIERS, *_NEGATIVES):
    # the rows are formatted without json.dumps: no character here may need escaping
    assert not set(_word) & set('"\\') and _word.isprintable(), _word

_DIRTY = (  # (reason the plan gives, the line for global row index i)
    ("invalid_json", lambda i: '{"prompt": "a cut-off line %d' % i),
    ("empty_prompt", lambda i: '{"prompt": "   ", "id": "blank-%d"}' % i),
    ("bad_num_images", lambda i: '{"prompt": "a valid prompt asking for no images %d", "num_images": 0}' % i),
    ("missing_prompt", lambda i: '{"text": "the prompt is under the wrong key %d"}' % i),
)


class BenchError(RuntimeError):
    pass


def is_dirty(index: int) -> bool:
    return index % DIRTY_EVERY == DIRTY_OFFSET


def dirty_reason(index: int) -> str:
    return _DIRTY[(index // DIRTY_EVERY) % len(_DIRTY)][0]


def expected_rejects(rows: int) -> dict[str, int]:
    """The rejects, by reason, that the first ``rows`` generated rows hold."""
    counts: dict[str, int] = {}
    for index in range(DIRTY_OFFSET, rows, DIRTY_EVERY):
        reason = dirty_reason(index)
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def shard_bounds(rows: int, shards: int, shard: int) -> tuple[int, int]:
    """Global row indices [start, stop) of ``shard``: rows spread evenly over the shards."""
    return rows * shard // shards, rows * (shard + 1) // shards


def shard_name(shard: int, shards: int) -> str:
    return f"prompts-{shard:05d}-of-{shards:05d}.jsonl"


def _prompt(rnd, modifiers: list[str]) -> str:
    head = f"{_ARTICLES[rnd[0]]} {_ADJECTIVES[rnd[1]]} {_SUBJECTS[rnd[2]]} {_ACTIONS[rnd[3]]} {_PLACES[rnd[4]]}"
    text = head
    for k in range(MAX_MODIFIERS):
        if k >= rnd[5] and len(text) >= MIN_CHARS:
            break
        extra = f"{text}, {modifiers[rnd[6 + k]]}"
        if len(extra) > MAX_CHARS:
            break
        text = extra
    return text


# (column of the row's random draws, chance, the field from the row's seed): optional fields, in order
_OPTIONAL_FIELDS = (
    (1, 0.25, lambda seed: f'"seed": {seed}'),
    (2, 0.20, lambda seed: '"num_images": 1'),
    (3, 0.10, lambda seed: f'"negative_prompt": "{_NEGATIVES[seed % len(_NEGATIVES)]}"'),
    (4, 0.05, lambda seed: f'"guidance_scale": {_GUIDANCE[seed % len(_GUIDANCE)]}'),
    (5, 0.05, lambda seed: '"collection": "plan-bench"'),
)


def shard_lines(rows: int, shards: int, shard: int, seed: int = SEED) -> list[str]:
    """The JSONL lines (newline included) of one shard; the same for the same arguments."""
    import numpy as np

    start, stop = shard_bounds(rows, shards, shard)
    n = stop - start
    rng = np.random.default_rng([seed, shard])
    columns = [len(_ARTICLES), len(_ADJECTIVES), len(_SUBJECTS), len(_ACTIONS), len(_PLACES), MAX_MODIFIERS + 1]
    columns += [len(_MODIFIERS)] * MAX_MODIFIERS
    picks = np.stack([rng.integers(0, c, n) for c in columns], axis=1).tolist()
    field = rng.random((n, 6)).tolist()  # chance of each optional field
    seeds = rng.integers(0, 2**31, n).tolist()
    lines = []
    for j in range(n):
        index = start + j
        if is_dirty(index):
            lines.append(_DIRTY[(index // DIRTY_EVERY) % len(_DIRTY)][1](index) + "\n")
            continue
        f = field[j]
        parts = [f'{{"prompt": "{_prompt(picks[j], _MODIFIERS)}"']
        if f[0] < 0.30:
            parts.append(f'"id": "s{shard:05d}-r{index:09d}"')
        elif f[0] < 0.35:
            parts.append(f'"id": {10**12 + index}')
        parts += [field_of(seeds[j]) for column, chance, field_of in _OPTIONAL_FIELDS if f[column] < chance]
        lines.append(", ".join(parts) + "}\n")
    return lines


def generate(folder: str, rows: int, shards: int, seed: int = SEED) -> dict:
    """Write the shards into ``folder``; returns their paths, bytes and the time taken."""
    if rows < 1 or shards < 1:
        raise ValueError(f"need at least one prompt and one shard, got {rows} prompts in {shards} shards")
    os.makedirs(folder, exist_ok=True)
    start, paths, size = time.perf_counter(), [], 0
    for shard in range(shards):
        data = "".join(shard_lines(rows, shards, shard, seed)).encode("utf-8")
        path = os.path.join(folder, shard_name(shard, shards))
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
        size += len(data)
    return {"paths": paths, "bytes": size, "seconds": time.perf_counter() - start}


# --- measuring a process tree --------------------------------------------------------

def _status_kib(pid: int | str, field: str) -> int:
    """``field`` (e.g. VmRSS) of /proc/PID/status in KiB; 0 if gone or absent (a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (from each /proc/PID/stat's parent pid)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # the name, in parentheses, may hold spaces
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _launch(result_path: str, argv: list[str]) -> int:
    """In a small process (``python -m pipeline.bench.plan launch RESULT ARGV...``): run
    ``argv`` and write its exit code, wall and CPU seconds and ``ru_maxrss`` to RESULT.

    Why a launcher: Linux keeps a process's peak RSS across ``execve`` (the kernel
    folds the old address space's high-water mark into it), so a child started from a
    big process (the bench has imported Beam and built the model) would report the
    parent's RSS as its own peak. A child started from this small process starts from
    the launcher's few MiB.
    """
    start = time.perf_counter()
    pid = os.posix_spawnp(argv[0], argv, dict(os.environ))
    _, status, usage = os.wait4(pid, 0)
    result = {"exit_code": os.waitstatus_to_exitcode(status), "wall_s": time.perf_counter() - start,
              "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_kib": usage.ru_maxrss,
              "launcher_rss_kib": _status_kib("self", "VmHWM")}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


def run_measured(argv: list[str], env: dict, cwd: str, log_prefix: str) -> dict:
    """Run ``argv`` to its end through ``_launch``; returns its exit code, wall and CPU
    seconds, the kernel's peak RSS of its largest process (``peak_rss_kib``), and from
    /proc samples every ``POLL_S``: the largest RSS sum over its process tree
    (``tree_peak_rss_kib``) and the largest high-water mark (VmHWM) any of its processes
    showed (``sampled_hwm_kib``, a cross-check of ``peak_rss_kib``).

    stdout and stderr go to ``LOG_PREFIX.stdout`` / ``.stderr``.
    """
    result_path = log_prefix + ".result.json"
    launcher = [sys.executable, "-m", "pipeline.bench.plan", "launch", result_path, *argv]
    with open(log_prefix + ".stdout", "wb") as out, open(log_prefix + ".stderr", "wb") as err:
        proc = subprocess.Popen(launcher, env=env, cwd=cwd, stdout=out, stderr=err)
        start = time.perf_counter()
        hwm_kib, seen, timeline = 0, set(), []
        while proc.poll() is None:
            tree = [pid for pid in _descendants(proc.pid) if pid != proc.pid]  # not the launcher itself
            seen.update(tree)
            timeline.append((time.perf_counter() - start, sum(_status_kib(p, "VmRSS") for p in tree)))
            hwm_kib = max([hwm_kib, *(_status_kib(p, "VmHWM") for p in tree)])
            time.sleep(POLL_S)
    if proc.returncode != 0 or not os.path.exists(result_path):
        raise BenchError(f"the launcher of {shlex.join(argv[:4])}... exited with {proc.returncode}:\n"
                         f"{_tail(log_prefix + '.stderr')}")
    with open(result_path) as f:
        result = json.load(f)
    return {**result, "tree_peak_rss_kib": max((kib for _, kib in timeline), default=0), "sampled_hwm_kib": hwm_kib,
            "processes_seen": len(seen), "samples": len(timeline), "timeline": _thin(timeline)}


def _thin(timeline: list[tuple[float, int]], points: int = TIMELINE_POINTS) -> list[list[float]]:
    """At most ``points`` [seconds, tree RSS in MiB] pairs: the sample with the most RSS
    of each of ``points`` equal runs of samples, so no peak is lost."""
    step = max(1, math.ceil(len(timeline) / points))
    return [[round(t, 1), _mib(kib)] for t, kib in
            (max(timeline[k:k + step], key=lambda sample: sample[1]) for k in range(0, len(timeline), step))]


def _tail(path: str, chars: int = 3000) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")[-chars:]


# --- the held-in-memory process (``python -m pipeline.bench.plan hold MODULES FILE...``) ---

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
    before = _status_kib("self", "VmRSS")
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
    after = _status_kib("self", "VmRSS")
    valid = sum(isinstance(r, records.Record) for r in held)
    return {"baseline_rss_kib": before, "held_rss_kib": after, "held_increase_kib": after - before,
            "peak_rss_kib": _status_kib("self", "VmHWM"), "rows": len(held), "records": valid,
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


def verify(out: str, rows: int, slice_size: int) -> dict:
    """Check the plan in ``out`` against the generated input; returns what was counted.

    Raises ``BenchError`` on any difference.
    """
    rejects = expected_rejects(rows)
    records = rows - sum(rejects.values())
    with open(os.path.join(out, "plan", "manifest.json")) as f:
        manifest = json.load(f)
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


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)


def _machine() -> dict:
    import apache_beam

    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    except (OSError, StopIteration):
        pass
    return {"nproc": os.cpu_count(), "mem_total_mib": _mib(mem), "loadavg_before": list(os.getloadavg()),
            "python": platform.python_version(), "apache_beam": apache_beam.__version__,
            "platform": platform.platform()}


def run(prompts: int = 1_000_000, shards: int = 100, workdir: str | None = None, devices_per_host: int = 4,
        per_device_batch: int = 8, batches_per_slice: int = 32, beam_args: list[str] | None = None,
        model: str = "tiny", plan_command: tuple[str, ...] = PLAN_COMMAND,
        baseline_modules: tuple[str, ...] = BASELINE_MODULES) -> dict:
    """Generate the input, plan it in a fresh process, hold it in another; returns the report.

    ``workdir``: where the prompts, the plan's OUT and its logs go, kept after the run
    (default: a temporary folder, deleted after a successful run). The slice size is
    ``devices_per_host x per_device_batch x batches_per_slice``, as for ``plan``.
    ``plan_command``: the arguments after ``python`` that run ``promptmill plan``;
    ``baseline_modules``: what that process imports, imported by the held-in-memory process.
    """
    from pipeline.core import slicing
    from pipeline.model import load as model_lib

    beam_args = list(beam_args or [])
    slice_size = slicing.slice_size(devices_per_host, per_device_batch, batches_per_slice)
    workdir, temporary = _prepare_workdir(workdir)
    prompts_dir, out = os.path.join(workdir, "prompts"), os.path.join(workdir, "out")
    machine = _machine()
    model_lib.resolve(model)  # build the tiny model into the cache now, not inside the timed plan
    generated = generate(prompts_dir, prompts, shards)
    env = dict(os.environ)

    plan_argv = [sys.executable, *plan_command, "--prompts", os.path.join(prompts_dir, "*.jsonl"),
                 "--out", out, "--model", model, "--devices-per-host", str(devices_per_host),
                 "--per-device-batch", str(per_device_batch), "--batches-per-slice", str(batches_per_slice),
                 *beam_args]
    measured = run_measured(plan_argv, env, ROOT, os.path.join(workdir, "plan"))
    if measured["exit_code"] != 0:
        raise BenchError(f"plan exited with {measured['exit_code']} (logs in {workdir}):\n"
                         f"{_tail(os.path.join(workdir, 'plan.stderr'))}")
    checked = verify(out, prompts, slice_size)

    hold_argv = [sys.executable, "-m", "pipeline.bench.plan", "hold", ",".join(baseline_modules),
                 *generated["paths"]]
    held_run = run_measured(hold_argv, env, ROOT, os.path.join(workdir, "hold"))
    if held_run["exit_code"] != 0:
        raise BenchError(f"the held-in-memory process exited with {held_run['exit_code']}:\n"
                         f"{_tail(os.path.join(workdir, 'hold.stderr'))}")
    with open(os.path.join(workdir, "hold.stdout")) as f:
        held = json.loads(f.read().strip().splitlines()[-1])
    if held["rows"] != prompts:
        raise BenchError(f"the held-in-memory process read {held['rows']} rows, expected {prompts}")

    peak, baseline, increase = measured["peak_rss_kib"], held["baseline_rss_kib"], held["held_increase_kib"]
    report = {
        "bench": "plan",
        "settings": {"prompts": prompts, "shards": shards, "model": model, "devices_per_host": devices_per_host,
                     "per_device_batch": per_device_batch, "batches_per_slice": batches_per_slice,
                     "slice_size": slice_size, "beam_args": beam_args, "generator_seed": SEED,
                     "dirty_every": DIRTY_EVERY, "poll_s": POLL_S},
        "machine": machine,
        "command": shlex.join(plan_argv[1:]),
        "rows": prompts,
        "input_bytes": generated["bytes"],
        "input_mib": round(generated["bytes"] / MIB, 1),
        "prompt_bytes": held["prompt_bytes"],
        "prompt_bytes_mib": round(held["prompt_bytes"] / MIB, 1),
        "generate_s": round(generated["seconds"], 2),
        "wall_s": round(measured["wall_s"], 2),
        "cpu_s": round(measured["cpu_s"], 2),
        "rows_per_s": round(prompts / measured["wall_s"], 1),
        "peak_rss_mib": _mib(peak),
        "tree_peak_rss_mib": _mib(measured["tree_peak_rss_kib"]),
        "sampled_hwm_mib": _mib(measured["sampled_hwm_kib"]),
        "processes_seen": measured["processes_seen"],
        "rss_timeline_mib": measured["timeline"],
        "baseline_rss_mib": _mib(baseline),
        "baseline_import_s": round(held["import_s"], 2),
        "plan_increment_mib": _mib(peak - baseline),
        "held_in_memory_rss_mib": _mib(increase),
        "held_in_memory_total_rss_mib": _mib(held["held_rss_kib"]),
        "held_in_memory_load_s": round(held["load_s"], 2),
        "held_records": held["records"],
        "held_rejects": held["rejects"],
        "baseline_modules": list(baseline_modules),
        "peak_over_held_in_memory": round(peak / increase, 3) if increase > 0 else None,
        "increment_over_held_in_memory": round((peak - baseline) / increase, 3) if increase > 0 else None,
        **checked,
        "verified": True,
        "workdir": None if temporary else workdir,
    }
    if temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def table(report: dict) -> str:
    s = report["settings"]
    rows = [
        ("input", f"{report['rows']:,} rows in {s['shards']} jsonl shards, {report['input_mib']} MiB "
                  f"({report['prompt_bytes_mib']} MiB of prompt text), generated in {report['generate_s']} s"),
        ("plan", f"{report['wall_s']} s wall, {report['cpu_s']} s CPU, {report['rows_per_s']:,} rows/s, "
                 f"{report['processes_seen']} process(es)"),
        ("plan peak RSS", f"{report['peak_rss_mib']} MiB (largest process), {report['tree_peak_rss_mib']} MiB "
                          f"(tree, sampled every {s['poll_s']} s)"),
        ("baseline RSS", f"{report['baseline_rss_mib']} MiB after importing {', '.join(report['baseline_modules'])} "
                         f"(plan's increment over it: {report['plan_increment_mib']} MiB)"),
        ("held in memory", f"{report['held_in_memory_rss_mib']} MiB more RSS to hold all {report['rows']:,} "
                           f"parsed rows at once ({report['held_in_memory_total_rss_mib']} MiB in all)"),
        ("peak / held", f"{report['peak_over_held_in_memory']} (increment / held: "
                        f"{report['increment_over_held_in_memory']})"),
        ("output", f"{report['manifest']['records']:,} records + {report['manifest']['rejects']} rejects, "
                   f"{report['slice_files']} slices of {s['slice_size']}: verified"),
    ]
    width = max(len(name) for name, _ in rows)
    return f"plan bench on {report['machine']['nproc']} CPUs\n" + "\n".join(
        f"{name:<{width}}  {text}" for name, text in rows)


def _main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "launch":
        return _launch(argv[1], argv[2:])
    if len(argv) >= 3 and argv[0] == "hold":
        print(json.dumps(_hold([m for m in argv[1].split(",") if m], argv[2:])))
        return 0
    print("usage: python -m pipeline.bench.plan {launch RESULT ARGV... | hold MODULE,... FILE...} (helpers of "
          "`promptmill bench plan`)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
