"""Stopping real runs, and watching them: the tiny model, two local hosts of two CPU
devices, one OUT taken through a stop of ``promptmill run``, then a SIGTERM to one host
of a GKE-style pair (hosts that find their cluster from TPU_WORKER_ID and
TPU_WORKER_HOSTNAMES, as the JobSet's pods do), then ``promptmill run`` again, which must
end with the bytes of an uninterrupted generation of the same plan.

Waits are for log events and files, with generous deadlines; the only time bound checked
is the issue's: no process of a stopped run is left 15 s after the signal."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipeline.collect import status
from pipeline.core import crashpoints, logs, naming
from pipeline.engines.local import host_env
from pipeline.generate import cluster, compile_cache, stopping
from pipeline.io import runs, storage
from pipeline.output import writer
from tests import trees
from tests.conftest import ROOT

RECORDS = 95  # and one bad row: 95 images in 24 slices of 4, the last one of 3
SLICES = 24
STEPS = "1"
# The runs to stop pause after each batch (pipeline.core.crashpoints), so that they last
# seconds after their first commit on any machine: the stop reaches the hosts 0.5-1.3 s
# after the SIGTERM (pipeline.generate.stopping), later on a busy machine, and a 1-step
# tiny run once finished its remaining slices in 1.6 s, before the stop reached it. Each
# host runs 24 batches: 10 s of pauses, without computing more than the images.
PAUSE = {crashpoints.PAUSE_ENV: "0.4"}
DEADLINE_S = 300  # for anything that should take seconds, on a busy machine
NO_PROCESS_AFTER_S = 15  # the bound


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stop-prompts")
    rows = [json.dumps({"id": f"r{n:03d}", "prompt": f"prompt number {n}, a {'red' if n % 2 else 'blue'} object"})
            for n in range(RECORDS)]
    rows.insert(7, json.dumps({"id": "empty", "prompt": ""}))
    (folder / "p.jsonl").write_text("\n".join(rows) + "\n")
    return str(folder / "p.jsonl")


def run_command(prompts, out, progress=False):
    return [sys.executable, "-m", "jobs.cli", "run", "--prompts", prompts, "--out", out, "--model", "tiny",
            "--hosts", "2", "--devices-per-host", "2", "--steps", STEPS, "--per-device-batch", "1",
            "--batches-per-slice", "2", *([] if progress else ["--no-progress"])]


def _bar_segments(stderr: str) -> list[str]:
    """What a terminal shows of stderr, one piece per line or carriage return."""
    return [seg for line in stderr.split("\n") for seg in line.split("\r") if seg.strip()]


def _no_event_in_a_bar(stderr: str) -> None:
    for seg in _bar_segments(stderr):
        assert '{"ts"' not in seg or seg.startswith('{"ts"'), f"a log line broke the progress bar: {seg!r}"


class Terminal:
    """A pseudo-terminal for a process's stderr, as a user's: what it shows, read on a thread
    (a progress bar is drawn on a terminal only)."""

    def __init__(self):
        import pty

        self.master, self.slave = pty.openpty()
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # every writer is gone
                return
            if not data:
                return
            self.chunks.append(data)

    def text(self) -> str:
        """What it showed, once its process has ended."""
        os.close(self.slave)
        self.reader.join(timeout=30)
        return b"".join(self.chunks).decode("utf-8", "replace").replace("\r\n", "\n")


def _env(cache, **extra):
    return dict(os.environ, PROMPTMILL_CACHE=cache, **extra)


def _events(text: str, name: str) -> list[dict]:
    return [e for e in map(logs.parse, text.splitlines()) if e and e["event"] == name]


def _host_log_events(out: str, name: str) -> list[dict]:
    return [e for path in storage.glob(naming.join(out, "logs", "host-*.log"))
            for e in _events(storage.read_text(path), name)]


def _wait_for(condition, what: str, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _processes_of(out: str) -> list[str]:
    """The command lines of the running processes that name ``out`` (launcher, hosts, workers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().split(") ", 1)[1].startswith("Z")
        except OSError:
            continue
        if out in command and not zombie:
            found.append(command)
    return found


def _sha256s(out: str) -> dict[str, str]:
    """{key: sha256} of every committed slice's metadata rows."""
    return {row["key"]: row["sha256"] for index in sorted(runs.committed(out))
            for row in writer.read_parquet_rows(naming.shard_metadata(out, index))}


@pytest.fixture(scope="module")
def stopped_run(prompts, tmp_path_factory, model_cache):
    """``promptmill run``, sent SIGTERM once a host has committed a slice."""
    out = str(tmp_path_factory.mktemp("stop") / "out")
    err = Terminal()
    launcher = subprocess.Popen(run_command(prompts, out, progress=True), cwd=ROOT, env=_env(model_cache, **PAUSE),
                                stderr=err.slave)
    _wait_for(lambda: _host_log_events(out, "slice_committed") or launcher.poll() is not None, "a commit")
    second = _second_launcher(prompts, out)  # while the first one's hosts commit
    signalled = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=DEADLINE_S)
    hosts = list(storage.read_json(naming.join(out, "logs", "hosts.json")).values())
    while _processes_of(out) and time.monotonic() - signalled < NO_PROCESS_AFTER_S:
        time.sleep(0.05)
    left = _processes_of(out)
    return {"out": out, "prompts": prompts, "code": code, "stderr": err.text(), "left": left, "hosts": hosts,
            "committed": sorted(runs.committed(out)), "second": second}


def _second_launcher(prompts, out) -> dict:
    """Another ``promptmill run`` with other settings and --overwrite on the same OUT, in
    this process: refused while the first run holds OUT, whose run.json it leaves alone."""
    import contextlib
    import io

    from jobs import cli

    before = storage.read_bytes(naming.run_json(out))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["run", "--prompts", prompts, "--out", out, "--model", "tiny", "--steps", "2", "--overwrite"])
    return {"code": code, "stderr": err.getvalue(), "run_json_kept": storage.read_bytes(naming.run_json(out)) == before}


def test_a_second_launcher_is_refused_while_the_first_holds_the_out(stopped_run):
    """Two launchers on one OUT: the second, --overwrite and all, is refused by the first's
    lease, naming it; the first run's files are left alone."""
    second = stopped_run["second"]
    assert second["code"] == 1 and second["run_json_kept"]
    assert f"promptmill run: error: {stopped_run['out']} is in use by promptmill run (owner" in second["stderr"]
    assert not storage.exists(naming.lease(stopped_run["out"]))  # the stopped launcher gave it back


def test_sigterm_to_promptmill_run_stops_every_host_and_leaves_no_process(stopped_run):
    r = stopped_run
    assert r["code"] == 143, r["stderr"][-3000:]
    assert r["left"] == []  # launcher, hosts and anything they started: gone within 15 s of the signal
    assert "promptmill run: stopped by SIGTERM" in r["stderr"]
    [stopped] = _events(r["stderr"], "run_stopped")
    assert stopped["committed"] == f"{len(r['committed'])}/{SLICES}" and "run the same command" in stopped["resume"]
    # the hosts stopped themselves at the same batch, and what they committed is kept
    events = _host_log_events(r["out"], "host_stopped")
    assert sorted(e["host"] for e in events) == [0, 1]
    assert len({e["step"] for e in events}) == 1 and events[0]["step"] >= 2
    assert sorted(i for e in events for i in e["slices"]) == r["committed"]
    assert 0 < len(r["committed"]) < SLICES


def test_every_line_of_a_stopped_hosts_log_is_json(stopped_run):
    """Host logs are JSON lines, the C++ libraries' lines too (XLA's preemption notifier
    says it caught the SIGTERM): those are wrapped as ``native_log`` events."""
    lines = [line for path in sorted(storage.files(naming.logs_dir(stopped_run["out"]), "host-*.log"))
             for line in storage.read_text(path).splitlines()]
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)
    native = [json.loads(line) for line in lines if json.loads(line)["event"] == "native_log"]
    assert any("SIGTERM" in e["line"] for e in native), native


def test_the_stopped_runs_events_are_written_above_its_progress_bar_never_into_it(stopped_run):
    stderr = stopped_run["stderr"]
    assert "img" in stderr and _events(stderr, "run_stopped"), stderr[-3000:]
    _no_event_in_a_bar(stderr)


def test_status_of_a_run_stopped_midway_reads_no_image_and_no_metadata(stopped_run, monkeypatch):
    out = stopped_run["out"]
    read = []
    real = storage.read_bytes
    monkeypatch.setattr(storage, "read_bytes", lambda path: read.append(path) or real(path))
    r = status.status(out)
    committed = stopped_run["committed"]
    assert r["state"] == "stopped"
    assert r["planned"] == {"slices": SLICES, "images": RECORDS, "records": RECORDS}
    assert r["committed"]["slices"] == len(committed)
    assert r["committed"]["images"] == 4 * len(committed) - (SLICES - 1 in committed)  # the last slice holds 3
    assert r["rejects"] == {"count": 1, "by_reason": {"empty_prompt": 1}}
    assert [(h["host"], h["state"], h["last_event"]) for h in r["hosts"]] == [(0, "stopped", "host_stopped"),
                                                                               (1, "stopped", "host_stopped")]
    assert sum(h["slices"] for h in r["hosts"]) == len(committed)
    assert [h["log"] for h in r["hosts"]] == [naming.join(out, "logs", f"host-{i}.log") for i in range(2)]
    assert not r["collect"]["ran"]
    assert sorted(os.path.relpath(p, out) for p in read) == [
        "ledger/host-00000.json", "ledger/host-00001.json", "plan/manifest.json", "progress/host-00000.json",
        "progress/host-00001.json", "run.json"]


def gke_hosts(out: str, cache: str, sigterm_to: int | None = None) -> tuple[list[int], list[str]]:
    """``promptmill generate --out OUT`` on two GKE-style hosts, as the JobSet's pods run
    it; with ``sigterm_to``, the hosts pause after each batch and that host gets SIGTERM
    once it has committed a slice. Returns their exit codes and stderr."""
    paused = PAUSE if sigterm_to is not None else {}
    base = {**host_env(2, _env(cache, **paused)), cluster.WORKER_HOSTNAMES: "127.0.0.1,127.0.0.1",
            cluster.COORDINATOR_PORT: str(cluster.free_port())}
    command = [sys.executable, "-m", "jobs.cli", "generate", "--out", out,
               "--compile-cache", compile_cache.local_default()]
    hosts = [subprocess.Popen(command, cwd=ROOT, env={**base, cluster.WORKER_ID: str(i)}, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    lines = [[], []]
    readers = [threading.Thread(target=lambda i=i: lines[i].extend(hosts[i].stderr)) for i in range(2)]
    for reader in readers:
        reader.start()
    try:
        if sigterm_to is not None:
            _wait_for(lambda: any('"slice_committed"' in line for line in list(lines[sigterm_to]))
                      or hosts[sigterm_to].poll() is not None, f"host {sigterm_to}'s first commit")
            hosts[sigterm_to].send_signal(signal.SIGTERM)
        codes = [h.wait(timeout=DEADLINE_S) for h in hosts]
    finally:
        for h in hosts:
            h.kill()
        for reader in readers:
            reader.join()
    return codes, ["".join(l) for l in lines]


@pytest.fixture(scope="module")
def stopped_host(stopped_run, model_cache):
    """The same OUT on two GKE-style hosts; host 1 gets SIGTERM once it has committed a slice."""
    out = stopped_run["out"]
    before = set(runs.committed(out))
    codes, stderr = gke_hosts(out, model_cache, sigterm_to=1)
    return {"out": out, "prompts": stopped_run["prompts"], "codes": codes, "stderr": stderr, "before": before,
            "committed": sorted(runs.committed(out))}


def test_sigterm_to_one_host_stops_both_at_the_same_batch_with_nothing_partial(stopped_host):
    r = stopped_host
    assert r["codes"] == [143, 143], [s[-3000:] for s in r["stderr"]]
    [first], [second] = (_events(s, "host_stopped") for s in r["stderr"])
    assert first["step"] == second["step"] and first["stopped_hosts"] == second["stopped_hosts"] == [0, 1]
    new = sorted(set(r["committed"]) - r["before"])
    assert sorted(first["slices"] + second["slices"]) == new and len(r["committed"]) < SLICES
    assert sorted(e["slice"] for s in r["stderr"] for e in _events(s, "slice_skipped")) == sorted(r["before"])
    planned = {i: [json.loads(line)["key"] for line in storage.read_text(naming.plan_slice(r["out"], i)).splitlines()]
               for i in range(SLICES)}
    for index in range(SLICES):  # a slice is whole and committed, or it has no metadata shard and no marker
        if index in r["committed"]:
            rows = writer.read_parquet_rows(naming.shard_metadata(r["out"], index))
            assert sorted(row["key"] for row in rows) == sorted(planned[index])
            for row in rows:
                data = storage.read_bytes(naming.join(r["out"], row["path"]))
                assert hashlib.sha256(data).hexdigest() == row["sha256"]
        else:
            assert not storage.exists(naming.shard_metadata(r["out"], index)), index


@pytest.fixture(scope="module")
def resumed(stopped_host, model_cache):
    """``promptmill run`` again, as a user resumes, on the OUT both stops left, with its progress bar."""
    out = stopped_host["out"]
    before = trees.checksums(out)
    fast_math = dict(_env(model_cache), XLA_FLAGS=os.environ["XLA_FLAGS"] + " --xla_cpu_enable_fast_math=true")
    refused = subprocess.run(run_command(stopped_host["prompts"], out), cwd=ROOT, env=fast_math, capture_output=True,
                             text=True, timeout=DEADLINE_S)
    untouched = trees.checksums(out) == before
    terminal = Terminal()
    done = subprocess.run(run_command(stopped_host["prompts"], out, progress=True), cwd=ROOT, env=_env(model_cache),
                          stdout=subprocess.PIPE, stderr=terminal.slave, text=True, timeout=DEADLINE_S)
    stats = json.loads(done.stdout) if done.returncode == 0 else None
    return {"out": out, "prompts": stopped_host["prompts"], "code": done.returncode, "stderr": terminal.text(),
            "stats": stats,
            "before": stopped_host["committed"], "refused": refused, "untouched": untouched}


def test_a_resume_under_other_xla_flags_is_refused_naming_them(resumed):
    """The battery's case: the stopped run resumed with XLA's fast math is refused before
    anything is done, naming the flags that differ and what to do; the same command in the
    run's own environment then resumes it."""
    refused = resumed["refused"]
    assert refused.returncode == 1 and resumed["untouched"]
    assert f"promptmill run: error: {resumed['out']} was generated in another environment" in refused.stderr
    assert "XLA_FLAGS: " in refused.stderr and "--xla_cpu_enable_fast_math=true" in refused.stderr
    assert "Finish the run in the environment that started it" in refused.stderr and "--overwrite" in refused.stderr


def test_collect_fails_a_row_made_in_another_environment(resumed, capfd):
    """Each row names the environment it was made in; collect checks it against the run's,
    so a slice made under other libraries fails verification, naming its keys."""
    from jobs import cli
    from pipeline.generate import environment

    out = resumed["out"]
    recorded = environment.recorded(out)
    storage.write_json(naming.environment(out), {**recorded, "jax": "0.0.1"})
    try:
        assert cli.main(["collect", "--out", out]) == 1
        stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    finally:
        storage.write_json(naming.environment(out), recorded)
    assert not stats["verified"] and stats["problems"]["foreign"]["count"] == 95
    assert cli.main(["collect", "--out", out]) == 0  # the run's own: verified again


@pytest.fixture(scope="module")
def uninterrupted(stopped_run, tmp_path_factory, model_cache):
    """{key: sha256} of the same plan generated in one go into another OUT, by two hosts
    (whose programs the runs above compiled already, and which share the two cores)."""
    out = str(tmp_path_factory.mktemp("uninterrupted") / "out")
    for path in [naming.run_json(stopped_run["out"]), *storage.glob(naming.join(stopped_run["out"], "plan"))]:
        storage.write_bytes(naming.join(out, os.path.relpath(path, stopped_run["out"])), storage.read_bytes(path))
    codes, stderr = gke_hosts(out, model_cache)
    assert codes == [0, 0], [s[-3000:] for s in stderr]
    return _sha256s(out)


def test_the_same_command_resumes_to_the_bytes_of_an_uninterrupted_run(resumed, uninterrupted):
    assert resumed["code"] == 0, resumed["stderr"][-3000:]
    done = _host_log_events(resumed["out"], "host_done")
    assert sum(e["slices_skipped"] for e in done) == len(resumed["before"])
    assert sum(e["slices_generated"] for e in done) == SLICES - len(resumed["before"])
    assert resumed["stats"]["verified"] and resumed["stats"]["images"] == RECORDS
    assert len(uninterrupted) == RECORDS and _sha256s(resumed["out"]) == uninterrupted


def test_a_resumed_runs_bar_counts_the_run_not_the_attempt(resumed):
    """The bar starts at the images committed before (not 0), says it is loading and
    compiling until the hosts are warm, ends at N/N with a rate and an ETA, and no event
    breaks it; then a summary for people."""
    before = resumed["before"]
    segments = [seg for seg in _bar_segments(resumed["stderr"]) if "img" in seg and not seg.startswith("{")]
    already = 4 * len(before) - (SLICES - 1 in before)  # the last slice holds 3
    assert segments[0].startswith("loading, compiling") and f" {already}/{RECORDS} " in segments[0], segments[:3]
    assert segments[-1].startswith("generate") and f" {RECORDS}/{RECORDS} " in segments[-1], segments[-3:]
    assert "<" in segments[-1] and "img/s" in segments[-1]  # elapsed<remaining, and a rate
    _no_event_in_a_bar(resumed["stderr"])
    made = RECORDS - already  # what this attempt made, beside what the dataset holds
    assert (f"{made} image(s) made ({already} made before), {RECORDS} in the dataset, 0 dropped by filters, 1 input "
            f"row(s) rejected") in resumed["stderr"] and "images/s generating" in resumed["stderr"]


def test_every_attempts_host_logs_are_kept(resumed):
    """The stopped ``promptmill run``'s host logs (the GKE-style hosts' went to their own
    stderr) are moved aside, not overwritten, by the run that resumed it."""
    out = resumed["out"]
    kept = naming.join(out, "logs", "attempt-1")
    assert _events(resumed["stderr"], "earlier_logs_kept")[0]["folder"] == kept
    assert sorted(os.listdir(kept)) == ["host-0.log", "host-1.log", "hosts.json"]
    for i in range(2):
        assert _events(storage.read_text(naming.join(kept, f"host-{i}.log")), "host_stopped")
        assert _events(storage.read_text(naming.join(out, "logs", f"host-{i}.log")), "host_done")


def test_status_of_a_finished_run(resumed):
    r = status.status(resumed["out"])
    assert r["state"] == "collected"
    assert (r["committed"]["slices"], r["committed"]["images"]) == (SLICES, RECORDS)
    assert r["collect"] == {"ran": True, "verified": True, "images": RECORDS, "dropped": 0, "problems": {}}
    assert [(h["host"], h["state"]) for h in r["hosts"]] == [(0, "done"), (1, "done")]
    assert r["rate"]["eta_s"] is None
    assert "collect   verified: 95 images" in status.format_text(r)


@pytest.mark.slow
def test_the_hosts_of_a_sigkilled_launcher_stop_by_themselves(prompts, tmp_path, model_cache):
    """The launcher cannot handle SIGKILL: its hosts notice they lost their parent and stop
    as at a SIGTERM, at the same batch. (tests/generate/test_stopping.py shows the same watch on
    small processes in the default run.)"""
    out = str(tmp_path / "out")
    launcher = subprocess.Popen(run_command(prompts, out), cwd=ROOT, env=_env(model_cache, **PAUSE),
                                stderr=subprocess.DEVNULL)
    _wait_for(lambda: _host_log_events(out, "slice_committed") or launcher.poll() is not None, "a commit")
    launcher.kill()
    launcher.wait()
    _wait_for(lambda: not _processes_of(out), "the hosts to exit", deadline_s=stopping.ORPHAN_GRACE_S + 30)
    # their logs are their own files, written on after the launcher is gone; so are their progress objects
    assert len(_host_log_events(out, "host_stopped")) == 2 and _host_log_events(out, "launcher_gone")
    r = status.status(out)
    assert [(h["host"], h["state"]) for h in r["hosts"]] == [(0, "stopped"), (1, "stopped")]
    assert r["committed"]["slices"] == sum(h["slices"] for h in r["hosts"]) > 0


def test_the_same_command_on_a_finished_run_starts_no_host(resumed, model_cache, capfd):
    """A finished run is said to be finished, without starting hosts to skip every slice."""
    from jobs import cli

    out = resumed["out"]
    attempts = sorted(storage.files(naming.logs_dir(out), "attempt-*/host-0.log"))
    assert cli.main(run_command(resumed["prompts"], out)[3:]) == 0
    err = capfd.readouterr().err
    assert "finished already: 95 image(s) in the dataset, none made now" in err
    assert _events(err, "run_finished_already") and not _events(err, "hosts_started")
    assert sorted(storage.files(naming.logs_dir(out), "attempt-*/host-0.log")) == attempts  # no host ran


def test_a_torn_shard_and_a_garbage_marker_are_named_with_how_to_redo_them(resumed, capfd):
    """Last of this module (it spoils the finished run): collect names each committed slice
    it cannot read and says how to redo it, and removes what a collect killed midway left."""
    from jobs import cli

    out = resumed["out"]
    marker, shard = naming.shard_stats(out, 3), naming.shard_metadata(out, 5)
    storage.write_bytes(marker, b"\x00garbage")
    storage.write_bytes(shard, storage.read_bytes(shard)[:100])
    leftover = naming.join(out, "dataset", ".promptmill-tmp-killed")
    storage.write_bytes(leftover, b"half a parquet file")
    assert cli.main(["collect", "--out", out]) == 1
    err = capfd.readouterr().err
    for index in (3, 5):
        assert (f"slice {index}'s commit marker or metadata cannot be read" in err
                and f"delete {naming.shard_stats(out, index)} and run the same command again" in err)
    assert not storage.exists(leftover)
