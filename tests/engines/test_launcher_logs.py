"""The local launcher's logs, without running hosts: earlier attempts' logs are kept, and
events are written above a progress bar, never into its line."""
import io
import logging
import sys

from tqdm import tqdm

from pipeline.core import logs
from pipeline.engines.local import keep_earlier_logs


def test_an_attempts_logs_move_to_the_next_free_attempt_folder(tmp_path):
    assert keep_earlier_logs(str(tmp_path)) is None  # nothing to keep
    for name, text in (("host-0.log", "first 0"), ("host-1.log", "first 1"), ("hosts.json", "{}"),
                       ("notes.txt", "the user's")):
        (tmp_path / name).write_text(text)
    assert keep_earlier_logs(str(tmp_path)) == str(tmp_path / "attempt-1")
    (tmp_path / "host-0.log").write_text("second 0")
    assert keep_earlier_logs(str(tmp_path)) == str(tmp_path / "attempt-2")
    assert (tmp_path / "attempt-1" / "host-0.log").read_text() == "first 0"
    assert (tmp_path / "attempt-1" / "host-1.log").read_text() == "first 1"
    assert sorted(p.name for p in (tmp_path / "attempt-2").iterdir()) == ["host-0.log"]
    assert (tmp_path / "attempt-2" / "host-0.log").read_text() == "second 0"
    assert (tmp_path / "notes.txt").read_text() == "the user's"  # not ours: left where it is
    (tmp_path / "attempt-7").mkdir()
    (tmp_path / "host-0.log").write_text("third")
    assert keep_earlier_logs(str(tmp_path)) == str(tmp_path / "attempt-8")


def test_events_go_above_the_bar_and_straight_to_stderr_without_one(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logs.setup(logging.INFO)
    bar = tqdm(total=10, unit="img", desc="generate", file=sys.stderr, mininterval=0)
    with logs.above(bar):
        bar.update(3)
        logs.event("slice_committed", slice=1)
        bar.update(3)
    bar.close()
    logs.event("after_the_bar")
    lines = [seg for line in err.getvalue().split("\n") for seg in line.split("\r") if seg.strip()]
    events = [seg for seg in lines if '{"ts"' in seg]
    assert len(events) == 2 and all(seg.startswith('{"ts"') for seg in events), lines
    assert any("6/10" in seg for seg in lines)
    quiet = tqdm(total=1, disable=True)
    with logs.above(quiet):  # a disabled bar: events are written as without one
        logs.event("no_bar")
    assert err.getvalue().rstrip().endswith('"event": "no_bar"}')


def test_a_heartbeat_beats_while_inside_and_stops_after(monkeypatch):
    import time

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logs.setup(logging.INFO)
    with logs.heartbeat("still_compiling", 0.02, program="the host program"):
        time.sleep(0.15)
    beats = [logs.parse(line) for line in err.getvalue().splitlines()]
    assert len(beats) >= 2 and all(b["event"] == "still_compiling" and b["program"] == "the host program"
                                   for b in beats)
    assert 0 <= beats[0]["elapsed_s"] <= beats[-1]["elapsed_s"]
    after = len(err.getvalue())
    time.sleep(0.1)
    assert len(err.getvalue()) == after  # it stopped with the block
