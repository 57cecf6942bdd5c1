import pytest

from pipeline.core import crashpoints


def test_crash_spec_parsing():
    assert crashpoints.parse("1:mid_slice:2") == (1, "mid_slice", 2)
    assert crashpoints.parse("0:ready") == (0, "ready", 0)
    for bad in ("x:ready:0", "0:nowhere:0", "0:ready:-1", "0", "0:ready:1:2"):
        with pytest.raises(ValueError, match="PROMPTMILL_CRASH_AT"):
            crashpoints.parse(bad)


def test_unset_means_never(monkeypatch):
    monkeypatch.delenv(crashpoints.ENV, raising=False)
    crashpoints.reached("ready", 0)  # would kill this test process otherwise


def test_only_the_named_host_point_and_count_fire(monkeypatch):
    fired = []
    monkeypatch.setenv(crashpoints.ENV, "1:committed:1")
    monkeypatch.setattr(crashpoints, "_reached", crashpoints.collections.Counter())
    monkeypatch.setattr(crashpoints.os, "kill", lambda pid, sig: fired.append(sig))
    crashpoints.reached("committed", 0)  # another host: never fires
    crashpoints._reached.clear()
    crashpoints.reached("committed", 1)  # the 0th time
    crashpoints.reached("ready", 1)
    assert fired == []
    crashpoints.reached("committed", 1, before=lambda: fired.append("before"))
    assert fired == ["before", crashpoints.signal.SIGKILL]


def test_the_pause_after_each_batch(monkeypatch):
    slept = []
    monkeypatch.setattr(crashpoints.time, "sleep", slept.append)
    monkeypatch.delenv(crashpoints.PAUSE_ENV, raising=False)
    crashpoints.batch_dispatched()
    monkeypatch.setenv(crashpoints.PAUSE_ENV, "0.25")
    crashpoints.batch_dispatched()
    assert slept == [0.25]
    assert crashpoints.pause_seconds(None) == 0 and crashpoints.pause_seconds("2") == 2
    for bad in ("soon", "-1", "60", "nan"):
        with pytest.raises(ValueError, match="PROMPTMILL_PAUSE_AFTER_BATCH must be seconds, at least 0 and below 60"):
            crashpoints.pause_seconds(bad)
