"""A command measured in a fresh process: its wall and CPU time, and its peak memory.

``run_measured`` starts the command from a small launcher process (``python
pipeline/bench/process_memory.py launch RESULT ARGV...``) and times it from start to exit.
Its memory is measured twice: ``peak_rss_kib`` is the kernel's high-water mark
(``os.wait4``'s ``ru_maxrss``: the largest RSS any single process of the tree reached,
exact); ``tree_peak_rss_kib`` is the largest sum of ``VmRSS`` over the process and all its
descendants, sampled from ``/proc`` every ``POLL_S`` (it counts shared pages once per
process, and can miss a peak shorter than the interval); ``timeline`` is that sum over
time, thinned to ``TIMELINE_POINTS``. ``bench plan`` and ``bench collect`` measure their
commands with it. Linux only (``/proc``, ``ru_maxrss`` in KiB).
"""
from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time

POLL_S = 0.2
TIMELINE_POINTS = 100  # of a command's RSS over time, in the report
MIB = 1 << 20


class MeasureError(RuntimeError):
    """The launcher failed: the command's own exit code is in the result, not here."""


def status_kib(pid: int | str, field: str) -> int:
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
    """In a small process (``python pipeline/bench/process_memory.py launch RESULT ARGV...``): run
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
              "launcher_rss_kib": status_kib("self", "VmHWM")}
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
    # this file by its path (it imports the standard library alone): ``cwd`` may be another
    # checkout, whose own package the command imports (``bench plan --reference``)
    launcher = [sys.executable, os.path.abspath(__file__), "launch", result_path, *argv]
    with open(log_prefix + ".stdout", "wb") as out, open(log_prefix + ".stderr", "wb") as err:
        proc = subprocess.Popen(launcher, env=env, cwd=cwd, stdout=out, stderr=err)
        start = time.perf_counter()
        hwm_kib, seen, timeline = 0, set(), []
        while proc.poll() is None:
            tree = [pid for pid in _descendants(proc.pid) if pid != proc.pid]  # not the launcher itself
            seen.update(tree)
            timeline.append((time.perf_counter() - start, sum(status_kib(p, "VmRSS") for p in tree)))
            hwm_kib = max([hwm_kib, *(status_kib(p, "VmHWM") for p in tree)])
            time.sleep(POLL_S)
    if proc.returncode != 0 or not os.path.exists(result_path):
        raise MeasureError(f"the launcher of {shlex.join(argv[:4])}... exited with {proc.returncode}:\n"
                         f"{tail(log_prefix + '.stderr')}")
    with open(result_path) as f:
        result = json.load(f)
    return {**result, "tree_peak_rss_kib": max((kib for _, kib in timeline), default=0), "sampled_hwm_kib": hwm_kib,
            "processes_seen": len(seen), "samples": len(timeline), "timeline": _thin(timeline)}


def _thin(timeline: list[tuple[float, int]], points: int = TIMELINE_POINTS) -> list[list[float]]:
    """At most ``points`` [seconds, tree RSS in MiB] pairs: the sample with the most RSS
    of each of ``points`` equal runs of samples, so no peak is lost."""
    step = max(1, math.ceil(len(timeline) / points))
    return [[round(t, 1), mib(kib)] for t, kib in
            (max(timeline[k:k + step], key=lambda sample: sample[1]) for k in range(0, len(timeline), step))]


def tail(path: str, chars: int = 3000) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")[-chars:]


def mib(kib: int) -> float:
    return round(kib / 1024, 1)


def _main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "launch":
        return _launch(argv[1], argv[2:])
    print("usage: python -m pipeline.bench.process_memory launch RESULT ARGV... (a helper of `promptmill bench "
          "plan` and `promptmill bench collect`)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
