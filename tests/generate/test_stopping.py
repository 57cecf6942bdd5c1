"""Stopping, without a model: SIGTERM as an exception, the per-batch stop question, the
launcher watch, and the launcher's stop of its hosts, on small real processes.

The same with real hosts (jax.distributed, the tiny model) is in tests/generate/test_stop.py."""
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pipeline.core import interrupts
from pipeline.engines import local
from pipeline.generate import stopping
from tests.conftest import ROOT



def test_sigterm_raises_interrupted_within_the_block_and_its_handler_is_put_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt) as caught:
        with interrupts.raising():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at the next bytecode; never reached
    assert isinstance(caught.value, interrupts.Interrupted)
    assert interrupts.exit_code(caught.value) == 143 and interrupts.signal_name(caught.value) == "SIGTERM"
    assert interrupts.received() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    assert interrupts.exit_code(KeyboardInterrupt()) == 130  # Ctrl-C
    assert interrupts.signal_name(KeyboardInterrupt()) == "SIGINT"


def test_off_the_main_thread_raising_changes_nothing():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_enter_and_read_handler()))
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGTERM)]


def _enter_and_read_handler():
    with interrupts.raising():
        return signal.getsignal(signal.SIGTERM)


def test_sync_stop_counts_batches_from_one_and_says_where_it_stopped():
    asked = []
    stop = stopping.SyncStop(reached=lambda step: asked.append(step) or step == 3)
    assert [stop() for _ in range(3)] == [False, False, True]
    assert asked == [1, 2, 3] and stop.stopped_at == 3 and stop.step == 3
    never = stopping.SyncStop(reached=lambda step: False)
    assert not any(never() for _ in range(5)) and never.stopped_at is None


def test_the_launcher_watch_stops_the_host_then_kills_it_after_the_grace():
    parents = iter([10, 10, 10, 1])  # the launcher (pid 10) is gone at the fourth look: reparented to init
    sent = []
    done = threading.Event()

    def kill(pid, sig):
        sent.append((pid, sig, time.monotonic()))
        if sig == signal.SIGKILL:
            done.set()

    stopping.watch_launcher(10, poll_s=0.001, grace_s=0.05, parent=lambda: next(parents), kill=kill)
    assert done.wait(30)
    assert [(pid, sig) for pid, sig, _ in sent] == [(os.getpid(), signal.SIGTERM), (os.getpid(), signal.SIGKILL)]
    assert sent[1][2] - sent[0][2] >= 0.05


def test_a_bad_launcher_pid_is_named():
    assert stopping.watch_launcher_from_env({}) is None
    with pytest.raises(ValueError, match="PROMPTMILL_LAUNCHER_PID must be the launcher's process id, got 'x'"):
        stopping.watch_launcher_from_env({stopping.LAUNCHER_ENV: "x"})


# A "host" that watches its launcher as promptmill's hosts do, and stops on SIGTERM.
HOST = textwrap.dedent("""
    import os, signal, sys, time
    from pipeline.generate import stopping
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    stopping.watch_launcher_from_env()
    print(os.getpid(), flush=True)
    time.sleep(600)
""")
# A "launcher" that starts the host with its own pid in the host's environment, says the
# host's pid, and waits to be killed.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    env = dict(os.environ, PROMPTMILL_LAUNCHER_PID=str(os.getpid()))
    host = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    print(host.stdout.readline().strip(), flush=True)
    time.sleep(600)
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")  # a zombie has exited
    except FileNotFoundError:
        return True


def test_a_host_whose_launcher_was_sigkilled_stops_by_itself():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, HOST], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        host = int(launcher.stdout.readline())
        launcher.kill()  # SIGKILL: the launcher can do nothing about its host
        launcher.wait()
        deadline = time.monotonic() + 30
        while not _gone(host):
            assert time.monotonic() < deadline, "the host outlived its launcher"
            time.sleep(0.05)
    finally:
        launcher.kill()


def _start(tmp_path, index, program):
    """A local.Host running a small Python program instead of a host, once it has said
    (as a JSON event on stderr) that it is ready for signals."""
    events = queue.Queue()
    host = local.Host(index, [sys.executable, "-c", program], dict(os.environ), str(tmp_path / f"h{index}.log"),
                      events)
    assert events.get(timeout=60)[1]["event"] == "listening"
    return host


# ignores SIGTERM, as a host does while JAX's preemption service holds it
STUBBORN = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('{\"event\": \"listening\"}', file=sys.stderr, flush=True); time.sleep(600)")
OBEDIENT = "import sys, time; print('{\"event\": \"listening\"}', file=sys.stderr, flush=True); time.sleep(600)"


def test_ready_hosts_get_sigterm_and_are_killed_after_the_grace(tmp_path):
    from pipeline.collect import status
    from pipeline.generate import progress
    from pipeline.io import storage

    hosts = [_start(tmp_path, 0, OBEDIENT), _start(tmp_path, 1, STUBBORN)]
    for h in hosts:
        h.ready = True
        h.progress_path = str(tmp_path / f"host-{h.index}.json")
        storage.write_json(h.progress_path, {**progress.initial(f"host-{h.index}", h.index, 2, 0.0),
                                             "state": "generating"})
    started = time.monotonic()
    local.stop_hosts(hosts, grace_s=1.0)
    assert hosts[0].process.returncode == -signal.SIGTERM  # stopped by the SIGTERM
    assert hosts[1].process.returncode == -signal.SIGKILL  # killed after the grace
    # what status reads of the killed host says so at once (the SIGTERMed one writes its own)
    killed = storage.read_json(hosts[1].progress_path)
    assert killed["state"] == "killed" and "still running 1 s after SIGTERM" in killed["failure"]
    assert storage.read_json(hosts[0].progress_path)["state"] == "generating"
    view = status.host_view(killed, time.time())
    assert status.run_state(0, 10, [view], {"ran": False}) == "stopped"
    assert time.monotonic() - started >= 1.0
    for h in hosts:
        h.close()


def test_hosts_not_all_ready_are_killed_at_once(tmp_path):
    hosts = [_start(tmp_path, 0, STUBBORN), _start(tmp_path, 1, STUBBORN)]
    hosts[0].ready = True
    started = time.monotonic()
    local.stop_hosts(hosts, grace_s=60.0)
    assert [h.process.returncode for h in hosts] == [-signal.SIGKILL] * 2
    assert time.monotonic() - started < 30  # well before the grace
    for h in hosts:
        h.close()


def test_a_second_signal_during_the_grace_kills_at_once(tmp_path):
    hosts = [_start(tmp_path, 0, STUBBORN)]
    hosts[0].ready = True
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    with pytest.raises(interrupts.Interrupted):
        with interrupts.raising():
            timer.start()
            local.stop_hosts(hosts, grace_s=60.0)
    assert hosts[0].process.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 30
    hosts[0].close()


def test_the_stop_grace_follows_the_longest_batch_measured():
    """Stopped hosts finish the batch under way, stop together at the next and commit what
    is whole: an 8 s batch gets them 34 s before they are killed, not the 10 s floor, and
    before any batch was measured they get a minute."""
    from pipeline.engines import local

    assert local.stop_grace(None) == local.UNMEASURED_GRACE_S
    assert local.stop_grace(0.05) == pytest.approx(local.STOP_GRACE_S + 0.15)
    assert local.stop_grace(8.0) == 34.0
    progress = local.Progress.__new__(local.Progress)
    progress.batch_s = None
    for stats in ({"seconds": 16.0, "batches": 2}, {"seconds": 3.0, "batches": 1}, {"seconds": 1.0}):
        progress.measured(stats)
    assert progress.batch_s == 8.0
