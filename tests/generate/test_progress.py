"""A host's progress object: the state kept from its log events (pure), and its writer."""
import json
import os
import time

import pytest

from pipeline.core import logs, naming
from pipeline.generate import progress


def _events(p, *events):
    for ts, name, fields in events:
        p = progress.apply(p, name, fields, ts)
    return p


def test_events_move_the_state_and_count_what_the_host_did():
    p = progress.initial("host-00001", 1, 2, now=100.0)
    assert (p["state"], p["slices"], p["images"], p["last_event"]) == ("starting", 0, 0, None)
    p = _events(p, (101.0, "host_started", {"host": 1}), (110.0, "host_ready", {"host": 1}),
                (111.0, "slice_skipped", {"slice": 1}), (111.5, "slice_redone", {"slice": 3}),
                (112.0, "slice_committed", {"slice": 3, "images": 4, "started_ts": 110.0, "committed_ts": 112.0}),
                (114.0, "slice_committed", {"slice": 5, "images": 2, "started_ts": 112.0, "committed_ts": 114.0}),
                (115.0, "padding_slot", {"host": 1}))
    assert p["state"] == "generating"
    assert (p["slices"], p["images"], p["last_slice"], p["skipped"], p["redone"], p["redone_slices"]) == \
        (2, 6, 5, 1, 1, [3])
    assert p["images_per_s"] == 1.5  # 6 images from the first start (110) to the last commit (114)
    assert (p["last_event"], p["last_event_at"], p["padding_slots"]) == ("padding_slot", 115.0, 1)
    stopped = progress.apply(p, "host_stopped", {"step": 9}, 116.0)
    assert (stopped["state"], p["state"]) == ("stopped", "generating")  # a new dict: the old one is unchanged
    failed = progress.apply(p, "host_failed", {"error": "OSError: disk full"}, 117.0)
    assert (failed["state"], failed["failure"]) == ("failed", "OSError: disk full")
    assert progress.apply(p, "host_done", {}, 118.0)["state"] == "done"


def test_the_rate_is_over_the_recent_commits_only():
    assert progress.rate([], now=1000.0) is None
    recent = [[0.0, 10.0, 4], [900.0, 910.0, 4], [910.0, 920.0, 4]]
    assert progress.rate(recent, now=1000.0, window_s=300.0) == 0.4  # 8 images from 900 to 920
    assert progress.rate([[5.0, 5.0, 4]], now=10.0) is None  # no span to divide by


def _read(path):
    """The object, or None while it is missing or half-written (a local file is rewritten in place)."""
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None


def test_the_writer_keeps_the_object_under_out_and_writes_the_last_state_on_close(tmp_path):
    out = str(tmp_path / "out")
    logs.setup()
    tracker = progress.Progress(out, naming.progress_name(0), host=0, hosts=1, interval_s=0.05).start()
    path = naming.progress_file(out, "host-00000")
    logs.event("host_started", host=0)
    deadline = time.monotonic() + 30
    while (_read(path) or {}).get("last_event") != "host_started":
        assert time.monotonic() < deadline, "the progress object was never written"
        time.sleep(0.02)
    first = _read(path)["updated_at"]
    while (_read(path) or {"updated_at": first})["updated_at"] == first:  # written again though nothing happened: a heartbeat
        assert time.monotonic() < deadline, "the progress object was not rewritten"
        time.sleep(0.02)
    logs.event("slice_committed", host=0, slice=0, images=4, started_ts=1.0, committed_ts=2.0)
    logs.event("host_done", host=0)
    tracker.close()
    written = json.load(open(path))
    assert (written["state"], written["slices"], written["images"], written["host"]) == ("done", 1, 4, 0)
    assert "recent" not in written and written["pid"] == os.getpid()
    logs.event("slice_committed", host=0, slice=1, images=4)  # closed: no longer listening
    tracker.close()  # again: nothing more
    assert json.load(open(path))["slices"] == 1


def test_a_failed_write_is_logged_and_the_host_goes_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    tracker = progress.Progress(str(blocker), "host-00000", interval_s=60).start()
    tracker.close()  # its last write fails: OUT is a file
    assert tracker.snapshot()["state"] == "starting"


@pytest.mark.parametrize("event", sorted(progress.STATES))
def test_every_state_event_names_a_known_state(event):
    assert progress.STATES[event] in ("starting", "generating", *progress.FINAL)


def test_the_bar_is_drawn_on_a_terminal_that_reports_no_size():
    """A pseudo-terminal nobody sized says 0 columns and 0 rows, where tqdm would draw an
    empty bar, or none at all."""
    import os
    import pty

    from pipeline.engines import local

    master, slave = pty.openpty()
    try:
        with os.fdopen(os.dup(slave), "w") as stream:
            assert os.get_terminal_size(slave).columns == 0 and local.bar_size(stream) == {"ncols": 100, "nrows": 24}
            from tqdm import tqdm

            bar = tqdm(total=5, unit="img", file=stream, **local.bar_size(stream))
            bar.update(2)
            bar.close()
        assert b"2/5" in os.read(master, 65536)  # drawn
    finally:
        os.close(master)
        os.close(slave)
    with open(os.devnull, "w") as stream:
        assert local.bar_size(stream) == {"ncols": None, "nrows": None}  # not a terminal: tqdm's own choice


def test_a_stopped_runs_bar_counts_the_slices_the_hosts_committed_as_they_stopped(tmp_path, model_cache):
    """After the stop, the hosts' last commits (still on the event queue) move the bar to
    where the run is; the other events stay on the queue."""
    import queue

    from pipeline.core.settings import Settings
    from pipeline.engines import local
    from pipeline.plan import transforms as plan

    (tmp_path / "p.jsonl").write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(6)))
    out = str(tmp_path / "out")
    plan.run_plan(Settings(prompts=str(tmp_path / "p.jsonl"), out=out, per_device_batch=1, batches_per_slice=1,
                           devices_per_host=2))
    count = local.Progress(out, 6)

    class Bar:
        n = 0

        def update(self, k):
            self.n += k

    bar, events = Bar(), queue.Queue()
    for index, event in ((0, {"event": "slice_committed", "slice": 0}), (1, {"event": "host_stopped"}),
                         (1, {"event": "slice_committed", "slice": 1})):
        events.put((index, event))
    local.drain_commits([], events, count, bar)
    assert bar.n == 4 and events.get_nowait() == (1, {"event": "host_stopped"}) and events.empty()
