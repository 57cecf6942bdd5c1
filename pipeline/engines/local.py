"""``run`` on one machine: plan, then H local host processes, then collect.

Each host is ``promptmill generate`` in its own process with D CPU devices
(``--xla_force_host_platform_device_count``) and an explicit coordinator on a free
127.0.0.1 port. The launcher follows the hosts' JSON log lines for progress, keeps each
host's log under ``OUT/logs`` (or a temporary folder when OUT is remote), and, as soon
as one host fails or dies, stops the others and raises ``HostFailure`` naming it.

Stopping: when the launcher is interrupted (Ctrl-C, or SIGTERM through
``pipeline.core.interrupts``), or leaves for any other reason, it sends every host
SIGTERM, and the hosts stop together at their next batch (``pipeline.generate.stopping``);
those still running ``STOP_GRACE_S`` later, or at a second signal, are killed. Each host
knows the launcher's pid and stops by itself once the launcher is gone, so even a
SIGKILLed launcher leaves no host behind. A host that exits 143 was stopped (a SIGTERM
reached a host of the run): the others stop at the same batch, and ``HostsStopped`` says so.
"""
from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from pipeline.core import buckets, children, logs, naming
from pipeline.generate import cluster, compile_cache as compile_cache_lib, environment, progress as progress_lib, stopping
from pipeline.io import runs, storage
from pipeline.model.layers.attention import check_platform

STOP_GRACE_S = 10.0  # at least: hosts stop at their next batch, then commit what is whole
UNMEASURED_GRACE_S = 60.0  # before any slice was committed, a batch's length is not known yet
POLL_S = 0.1


class HostFailure(RuntimeError):
    pass


class HostsStopped(HostFailure):
    """The hosts stopped before the end, at a SIGTERM to one of them: a re-run resumes."""


HOSTS_PLATFORM = "cpu/cpu"  # what local hosts run on (``environment.current``): CPU devices


def host_env(devices_per_host: int, base: dict | None = None) -> dict:
    """The environment of a local host process: CPU only, with D devices."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_host}"])
    env["JAX_PLATFORMS"] = HOSTS_PLATFORM.split("/")[0]
    return env


def host_command(out: str, coordinator: str, num_hosts: int, host_id: int,
                 compile_cache: str | None = None) -> list[str]:
    command = [*children.python("-m", "jobs.cli"), "generate", "--out", out, "--coordinator", coordinator,
               "--num-hosts", str(num_hosts), "--host-id", str(host_id)]
    if compile_cache:
        command += ["--compile-cache", compile_cache_lib.resolve(compile_cache)]
    return command


def log_dir_for(out: str) -> str:
    return naming.logs_dir(out) if not storage.is_gcs(out) else tempfile.mkdtemp(prefix="promptmill-logs-")


class Host:
    """One host process, in a session of its own (a Ctrl-C in the launcher's terminal
    reaches the launcher only, which stops the hosts itself). Its stderr is ``log_path``
    itself, so the host keeps writing its log after its launcher is gone (a kill -9); the
    launcher follows the file and puts the host's JSON events on ``events`` as (index, event)."""

    def __init__(self, index: int, command: list[str], env: dict, log_path: str, events: queue.Queue):
        self.index = index
        self.tail = collections.deque(maxlen=40)
        self.ready = False  # it logged host_ready: warm, about to generate
        self.progress_path: str | None = None  # its progress object, marked if it has to be killed
        with open(log_path, "w", encoding="utf-8") as log:
            self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log,
                                            start_new_session=True)
        self.log = open(log_path, encoding="utf-8", errors="replace")
        self.reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self.reader.start()

    def _read(self, events: queue.Queue) -> None:
        partial = ""
        while True:
            exited = self.process.poll() is not None  # before reading: what it wrote before exiting is read
            chunk = self.log.readline()
            if not chunk:
                if exited:
                    break
                time.sleep(POLL_S / 2)
                continue
            partial += chunk
            if not partial.endswith("\n") and not exited:
                continue
            line, partial = partial, ""
            self.tail.append(line.rstrip())
            event = logs.parse(line)
            if event is not None:
                self.ready = self.ready or event["event"] == "host_ready"
                events.put((self.index, event))

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the host's process group, if it still runs."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.reader.join(timeout=5)
        self.log.close()


def keep_earlier_logs(log_dir: str) -> str | None:
    """Move an earlier attempt's host logs and ``hosts.json`` from ``log_dir`` into the
    next free ``log_dir/attempt-K/`` (K from 1), so that no attempt's log is overwritten;
    returns that folder, or None when there was nothing to keep."""
    earlier = sorted(n for n in os.listdir(log_dir)
                     if n == "hosts.json" or (n.startswith("host-") and n.endswith(".log")))
    if not earlier:
        return None
    k = 1 + max([int(n.split("-", 1)[1]) for n in os.listdir(log_dir)
                 if n.startswith("attempt-") and n.split("-", 1)[1].isdigit()], default=0)
    folder = naming.attempt_logs(log_dir, k)
    os.makedirs(folder)
    for name in earlier:
        os.replace(os.path.join(log_dir, name), os.path.join(folder, name))
    return folder


def stop_grace(batch_s: float | None) -> float:
    """How long stopped hosts get before they are killed (pure): they finish the batch under
    way, stop together at the next one and commit what is whole, so a few batches' time,
    from the longest batch measured so far (``batch_s``; None: none measured yet)."""
    if batch_s is None:
        return UNMEASURED_GRACE_S
    return max(STOP_GRACE_S, 3 * batch_s + STOP_GRACE_S)


def stop_hosts(hosts: list[Host], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every host still running (they stop together at their next batch), wait up
    to ``grace_s`` for all of them, then SIGKILL those left. A second Ctrl-C or SIGTERM
    during the wait (a KeyboardInterrupt here) kills them at once, and is raised again.

    Until every host is ready none has run a batch (they start together), and a host
    takes SIGTERM as a preemption notice it answers only at its first batch: then they
    are killed at once, losing nothing, rather than after their warm-up."""
    running = [h for h in hosts if h.process.poll() is None]
    if not running:
        return
    if not all(h.ready for h in hosts):
        _kill(hosts, "not every host was ready: nothing had been generated")
        return
    for h in running:
        h.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        for h in running:
            h.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill(hosts, f"still running {grace_s:g} s after SIGTERM")
    except KeyboardInterrupt:
        _kill(hosts, "a second signal")
        raise


def _kill(hosts: list[Host], reason: str) -> None:
    left = [h.index for h in hosts if h.process.poll() is None]
    for h in hosts:
        h.signal(signal.SIGKILL)
    for h in hosts:
        h.process.wait()
    if left:
        logs.event("hosts_killed", hosts=left, reason=reason)
    for h in hosts:  # what status reads of them says so, not "generating" until it goes stale
        if h.index in left and h.progress_path:
            progress_lib.mark_killed(h.progress_path, reason)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_hosts(out: str, num_hosts: int, devices_per_host: int, total_images: int, progress: bool = True,
              compile_cache: str | None = None) -> list[dict]:
    """Run the local host processes to completion; returns their 'host_done' events.

    ``compile_cache``: a persistent compilation cache folder for every host (``--compile-cache``).
    """
    from tqdm import tqdm

    log_dir = log_dir_for(out)
    os.makedirs(log_dir, exist_ok=True)
    kept = keep_earlier_logs(log_dir)
    if kept:
        logs.event("earlier_logs_kept", folder=kept)
    coordinator = f"127.0.0.1:{cluster.free_port()}"
    env = {**host_env(devices_per_host), stopping.LAUNCHER_ENV: str(os.getpid())}
    events: queue.Queue = queue.Queue()
    hosts = [Host(i, host_command(out, coordinator, num_hosts, i, compile_cache), env,
                   naming.host_log(log_dir, i), events) for i in range(num_hosts)]
    for h in hosts:
        h.progress_path = naming.progress_file(out, naming.progress_name(h.index))
    with open(os.path.join(log_dir, "hosts.json"), "w") as f:
        json.dump({str(h.index): h.process.pid for h in hosts}, f)
    logs.event("hosts_started", hosts=num_hosts, devices_per_host=devices_per_host, coordinator=coordinator,
               logs=log_dir)
    done: dict[int, dict] = {}
    count = Progress(out, total_images)
    # drawn on a terminal only: redirected into a file, its carriage returns would fill it (the
    # events, JSON lines, say the same)
    bar = tqdm(total=total_images, initial=count.images(), unit="img", desc=WARMING,
               disable=not progress or not sys.stderr.isatty(), file=sys.stderr, smoothing=0, **bar_size())
    try:
        with logs.above(bar):
            _follow(hosts, events, done, count, bar, out=out, log_dir=log_dir)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (pipeline.core.interrupts): stop, then say where the run is
        try:
            with logs.above(bar):
                stop_hosts(hosts, stop_grace(count.batch_s))
            drain_commits(hosts, events, count, bar)  # the slices the hosts committed as they stopped
        finally:
            bar.close()
            logs.event("run_stopped", out=out, committed=_committed(out),
                       resume="committed slices are kept: run the same command again to resume")
        raise
    finally:
        bar.close()
        try:
            stop_hosts(hosts)
        finally:
            for h in hosts:
                h.close()
    while not events.empty():
        index, event = events.get()
        if event["event"] == "host_done":
            done[index] = event
    return [done[i] for i in sorted(done)]


WARMING = "loading, compiling"  # the bar's label until every host is ready


def bar_size(stream=None) -> dict:
    """The progress bar's ``ncols`` and ``nrows``: tqdm's own (None) unless ``stream``
    (stderr) is a terminal that reports 0 columns or rows (a pseudo-terminal nobody sized,
    as some CI runners and ``script`` make), where tqdm would draw an empty bar (0 columns)
    or none (0 rows): then 100 columns and 24 rows."""
    stream = sys.stderr if stream is None else stream
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return {"ncols": None, "nrows": None}
    return {"ncols": size.columns or 100, "nrows": size.lines or 24}


class Progress:
    """The images of a run committed so far, the run's and not this attempt's: those of
    the slices committed when it started (one listing) and of every slice committed
    since, each counted once (a slice redone is not counted twice)."""

    def __init__(self, out: str, total_images: int):
        manifest = storage.read_json(naming.manifest(out))
        self.manifest, self.total = manifest, total_images
        self.slices = {i for i in runs.committed(out) if i < manifest["slices"]}
        self.batch_s: float | None = None  # the longest batch a committed slice took, for ``stop_grace``

    def measured(self, stats: dict) -> None:
        """A slice's commit stats: the longest batch so far."""
        if stats.get("batches"):
            self.batch_s = max(self.batch_s or 0.0, stats["seconds"] / stats["batches"])

    def images(self) -> int:
        return sum(buckets.manifest_slice_images(self.manifest, i) for i in self.slices)

    def committed(self, index: int) -> None:
        self.slices.add(index)


def _follow(hosts: list, events: queue.Queue, done: dict, count: Progress, bar, *, out: str, log_dir: str) -> None:
    """Follow the hosts' events until all have finished; the bar counts the run's
    committed images, and its rate (hence its ETA) starts when every host is ready."""
    ready: set[int] = set()
    num_hosts = len(hosts)
    while True:
        try:
            index, event = events.get(timeout=POLL_S)
            if event["event"] == "slice_committed":
                count.committed(event["slice"])
                count.measured(event)
                bar.update(count.images() - bar.n)
            elif event["event"] == "host_ready":
                ready.add(index)
                if len(ready) == num_hosts:
                    _start_rate(bar)
            elif event["event"] == "host_done":
                done[index] = event
        except queue.Empty:
            pass
        failed = [h for h in hosts if h.process.poll() not in (None, 0)]
        if failed:
            first = failed[0]
            code = first.process.returncode
            stop_hosts(hosts)  # a stopped host's peers stop at the same batch: this only waits for them
            if code == stopping.EXIT_STOPPED:
                raise HostsStopped(f"host {first.index} of {num_hosts} stopped (exit {code}: a SIGTERM reached "
                                   f"a host of the run), and every host stopped at the same batch; "
                                   f"{_committed(out)} slices are committed and kept: run the same command "
                                   f"again to resume. Logs: {log_dir}")
            first.reader.join(timeout=5)  # it has exited: its last lines are read
            tail = "\n    ".join(list(first.tail)[-15:])
            raise HostFailure(f"host {first.index} of {num_hosts} failed ({_describe_exit(code)}); "
                              f"stopped the other hosts. Log: {naming.host_log(log_dir, first.index)}"
                              f"\n  last lines of host {first.index}:\n    {tail}")
        if all(h.process.poll() == 0 for h in hosts):
            return


def drain_commits(hosts: list, events: queue.Queue, count: Progress, bar, wait_s: float = 2.0) -> None:
    """After the hosts have exited: count the slices they committed as they stopped (their
    last log lines, read by each host's reader, up to ``wait_s`` each), so that a stopped
    run's bar ends where the run is; other events are left on the queue."""
    for h in hosts:
        reader = getattr(h, "reader", None)
        if reader is not None:
            reader.join(timeout=wait_s)
    kept = []
    while True:
        try:
            index, event = events.get_nowait()
        except queue.Empty:
            break
        if event["event"] == "slice_committed":
            count.committed(event["slice"])
        else:
            kept.append((index, event))
    for item in kept:
        events.put(item)
    bar.update(count.images() - bar.n)


def _start_rate(bar) -> None:
    """Every host is warm: from here the bar's rate and ETA count generated images only,
    not the loading and compiling before them."""
    bar.set_description("generate", refresh=False)
    if not bar.disable:
        bar.start_t = bar.last_print_t = bar._time()
        bar.initial = bar.last_print_n = bar.n
    bar.refresh()


def _committed(out: str) -> str:
    """"K/N": the slices committed in ``out`` of those planned (from a listing)."""
    planned = storage.read_json(naming.manifest(out))["slices"]
    return f"{sum(index < planned for index in runs.committed(out))}/{planned}"


def run_local(settings, num_hosts: int, beam_args: list[str] | None = None, *, progress: bool = True,
              compile_cache: str | None = None, overwrite: bool = False, gallery: dict | None = None) -> dict:
    """plan -> local hosts -> collect; returns the dataset stats. ``gallery``: collect's
    options, ``run_collect``'s keywords (page_size, gallery_max, gallery_order, part_rows).

    ``compile_cache`` is an execution option, like ``num_hosts``: not a setting of the run.
    ``overwrite`` deletes an earlier run in OUT first; without it a re-run resumes.
    """
    from pipeline.collect import transforms as collect
    from pipeline.generate import fit
    from pipeline.plan import transforms as plan

    if num_hosts < 1:
        raise ValueError(f"--hosts must be >= 1, got {num_hosts}")
    check_platform(settings.attention, "cpu")  # the local hosts run on CPU devices (host_env)
    if compile_cache:
        compile_cache_lib.check_before_run(compile_cache)  # a bad or unsafe folder fails here, not in every host
    if not overwrite:  # a resume in another environment is refused before anything is done (as its hosts would)
        environment.check(settings.out, environment.current(HOSTS_PLATFORM))
    watch = logs.Stopwatch()
    # every host's devices are on this machine, and share its memory
    cap = fit.cap_hosts(settings, num_hosts, overwrite)
    settings = fit.resolve_per_device_batch(settings, overwrite, num_hosts * settings.devices_per_host)
    manifest = plan.run_plan(settings, beam_args, overwrite, cap)
    logs.event("planned", records=manifest["records"], images=manifest["images"], rejects=manifest["rejects"],
               slices=manifest["slices"], slice_size=manifest["slice_size"], **buckets.planned_sizes(manifest),
               seconds=round(watch.seconds(), 2))
    committed = sum(index < manifest["slices"] for index in runs.committed(settings.out))
    if committed == manifest["slices"]:  # a finished run: said so, and no host is started to skip every slice
        logs.event("run_finished_already", out=settings.out, slices=committed)
        done = [{"images": 0, "slices_generated": 0, "slices_redone": 0, "slices_skipped": committed}]
        generate_s = 0.0
    else:
        started = logs.Stopwatch()
        done = run_hosts(settings.out, num_hosts, settings.devices_per_host, manifest["images"], progress,
                         compile_cache)
        generate_s = started.seconds()
    attempt = {"images_made": sum(d["images"] for d in done), "generate_s": round(generate_s, 3),
               **{k: sum(d[k] for d in done) for k in ("slices_generated", "slices_redone", "slices_skipped")}}
    logs.event("generated", images=attempt["images_made"],
               **{k: attempt[k] for k in ("slices_generated", "slices_redone", "slices_skipped")},
               seconds=round(watch.seconds(), 2))
    stats = collect.run_collect(settings.out, beam_args, **(gallery or {}))
    logs.event("collected", images=stats["images"], rejects=stats["rejects"], verified=stats["verified"],
               seconds=round(watch.seconds(), 2), dataset=naming.join(settings.out, "dataset"))
    return {**stats, "attempt": attempt}
