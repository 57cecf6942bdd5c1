"""``promptmill status``: the report from what a run wrote (pure), and what it reads.

Real runs, stopped and finished, are in tests/generate/test_stop.py; a gs:// run read through a
recording proxy is in tests/e2e/test_e2e_gcs.py."""
import json
import os

import pytest

from jobs import cli
from pipeline.collect import status
from pipeline.core import naming
from pipeline.core.settings import Run, Settings
from pipeline.io import ledgers, runs, storage

MANIFEST = {"slices": 5, "slice_size": 4, "images": 17, "records": 15, "rejects": 2,
            "rejects_by_reason": {"empty_prompt": 1, "invalid_json": 1}, "input_rows": 17}
NOW = 10_000.0


def _run(**changes):
    settings = Settings(out="o", model="tiny", width=32, height=32, steps=3, scheduler="ddim", devices_per_host=2,
                        guided=True, **changes)
    return Run.create(settings, "f" * 64, "2025-01-01T00:00:00+00:00", {})


def _host(host, state, updated, **fields):
    return {"name": naming.progress_name(host), "host": host, "state": state, "updated_at": updated,
            "last_event": "slice_committed", "last_event_at": updated, "slices": 1, "images": 4,
            "images_per_s": 2.0, "redone_slices": [], **fields}


def _found(times):
    """What status counts from the markers' times {slice: unix seconds} of ``MANIFEST``'s plan."""
    return ledgers.from_times(times, MANIFEST)


def test_a_committed_slice_holds_slice_size_images_and_the_last_one_the_rest():
    assert [status.slice_images(i, MANIFEST) for i in range(5)] == [4, 4, 4, 4, 1]


def test_the_rate_counts_the_images_after_the_windows_first_commit_up_to_now():
    assert status.commit_rate([NOW - 100, NOW - 50, NOW - 20], [4, 4, 4], NOW) == 8 / 100
    assert status.commit_rate([NOW - 5000, NOW - 20], [4, 4], NOW) is None  # one commit in the window
    assert status.commit_rate([], [], NOW) is None


def test_report_counts_committed_out_of_planned_and_gives_a_rate_and_an_eta():
    committed = {0: NOW - 100, 2: NOW - 60, 4: NOW - 10}  # 4 + 4 + 1 images
    hosts = [_host(0, "generating", NOW - 3, redone_slices=[2]), _host(1, "failed", NOW - 400, failure="OSError: x")]
    r = status.report("gs://b/o", _run(), MANIFEST, _found(committed), hosts, dataset_stats=None, now=NOW,
                      host_logs=frozenset({1}))
    assert r["state"] == "generating"
    assert [h["log"] for h in r["hosts"]] == [None, "gs://b/o/logs/host-1.log"]
    assert r["planned"] == {"slices": 5, "images": 17, "records": 15}
    assert (r["committed"]["slices"], r["committed"]["images"]) == (3, 9)
    assert r["rejects"] == {"count": 2, "by_reason": {"empty_prompt": 1, "invalid_json": 1}}
    assert r["rate"]["images_per_s"] == 0.05 and r["rate"]["eta_s"] == 160.0  # 5 images / 100 s; 8 left
    assert [(h["host"], h["state"], h["stale"]) for h in r["hosts"]] == [(0, "generating", False), (1, "failed", False)]
    assert r["redone_slices"] == [2]
    assert r["failed_hosts"] == [{"name": "host-00001", "failure": "OSError: x"}]
    assert r["collect"] == {"ran": False, "verified": None, "images": None, "dropped": None, "problems": {}}
    text = status.format_text(r)
    for line in ("state     generating", "slices    3/5 committed (60%); images 9/17",
                 "rejects   2 (empty_prompt: 1, invalid_json: 1)", "0.05 images/s over the last 10 min; ETA 3 min",
                 "host 0: generating; slice_committed 3 s ago", "redone    slices 2", "failed    host-00001: OSError: x",
                 "collect   not run", "model=tiny 32x32 steps=3 scheduler=ddim"):
        assert line in text, (line, text)


@pytest.mark.parametrize("hosts,committed,stats,state", [
    ([_host(0, "stopped", NOW - 5)], {0: NOW - 9}, None, "stopped"),
    ([_host(0, "generating", NOW - 3600)], {0: NOW - 9}, None, "idle"),  # stale: its host stopped writing
    ([_host(0, "failed", NOW - 5), _host(1, "stopped", NOW - 5)], {0: NOW - 9}, None, "failed"),
    ([_host(0, "done", NOW - 5)], dict.fromkeys(range(5), NOW - 9), None, "generated"),
    ([], dict.fromkeys(range(5), NOW - 9), {"verified": True, "images": 17}, "collected"),
    ([], dict.fromkeys(range(5), NOW - 9), {"verified": False, "problems": {"missing": {"count": 2}}},
     "collected_unverified"),
])
def test_the_runs_state(hosts, committed, stats, state):
    r = status.report("o", _run(), MANIFEST, _found(committed), hosts, dataset_stats=stats, now=NOW)
    assert r["state"] == state
    assert r["rate"]["eta_s"] is None or state == "generating"
    if state == "idle":
        assert r["hosts"][0]["stale"] and "(stale: no update 60 min ago)" in status.format_text(r)
    if state == "collected_unverified":
        assert "collect   ran, NOT verified (missing: 2)" in status.format_text(r)


def test_before_the_manifest_the_run_is_planning():
    r = status.report("o", _run(), None, ledgers.from_times({}, None), [], dataset_stats=None, now=NOW)
    assert r["state"] == "planning" and "plan      not written yet" in status.format_text(r)


def test_while_planning_status_shows_no_fingerprint_the_plan_may_still_change(tmp_path, capsys):
    """The plan rewrites run.json (guidance decided, a batch capped) before it writes its
    manifest; the fingerprint shown is the one the planned run keeps."""
    out = str(tmp_path / "out")
    planning = _run(max_sequence_length=512)
    planning = planning.with_settings(planning.settings.replace(guided=None))
    runs.write(out, planning)
    assert cli.main(["status", out]) == 0
    text = capsys.readouterr().out
    assert "[fingerprint: once planned]" in text and planning.settings_fingerprint[:12] not in text
    assert cli.main(["status", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings_fingerprint"] is None
    planned = planning.with_settings(planning.settings.replace(guided=True))
    runs.write(out, planned)
    storage.write_json(naming.manifest(out), MANIFEST)
    assert cli.main(["status", out]) == 0
    text = capsys.readouterr().out
    assert f"[fingerprint {planned.settings_fingerprint[:12]}]" in text
    assert "text_tokens=512" in text and "t5" not in text.lower()  # T5's for FLUX.1, Qwen3's for others


def test_status_words_one_commit_one_slice_and_one_image_right():
    one = dict(MANIFEST, slices=1, images=1)
    r = status.report("o", _run(), one, ledgers.from_times({0: NOW - 1}, one), [_host(0, "done", NOW - 1, slices=1, images=1)],
                      dataset_stats={"verified": True, "images": 1}, now=NOW)
    text = status.format_text(r)
    assert "too few commits in the last 10 min to measure a rate (last commit 1 s ago)" in text
    assert "1 slice, 1 image this attempt" in text and "verified: 1 image" in text
    r = status.report("o", _run(), one, ledgers.from_times({0: NOW - 4000}, one), [], dataset_stats=None, now=NOW)
    assert "rate      no commits in the last 10 min (last commit 67 min ago)" in status.format_text(r)


def _planned_out(tmp_path):
    out = str(tmp_path / "out")
    runs.write(out, _run())
    storage.write_json(naming.manifest(out), MANIFEST)
    for index in (0, 1, 4):
        storage.write_json(naming.shard_stats(out, index), {"slice": index})
        storage.write_bytes(naming.shard_metadata(out, index), b"PAR1 not read")
        storage.write_bytes(naming.join(out, naming.image_name(index, f"k{index}")), b"PNG not read")
    storage.write_json(naming.join(out, "shards", "sub", "00003_stats.json"), {})  # not a marker of OUT
    storage.write_json(naming.progress_file(out, "host-00000"), _host(0, "stopped", 1.0))
    storage.write_text(naming.progress_file(out, "host-00001"), '{"name": "host-0')  # caught half-written
    return out


def test_status_reads_only_run_json_the_manifest_and_progress_objects(tmp_path, monkeypatch):
    out = _planned_out(tmp_path)
    read = []
    real = storage.read_bytes
    monkeypatch.setattr(storage, "read_bytes", lambda path: read.append(path) or real(path))
    r = status.status(out)
    assert (r["committed"]["slices"], r["committed"]["images"]) == (3, 9)
    assert [h["name"] for h in r["hosts"]] == ["host-00000"]
    assert sorted(os.path.relpath(p, out) for p in read) == [
        "plan/manifest.json", "progress/host-00000.json", "progress/host-00001.json", "run.json"]


def test_cli_status_text_json_and_watch(tmp_path, capsys):
    out = _planned_out(tmp_path)
    assert cli.main(["status", out]) == 0
    assert "slices    3/5 committed (60%); images 9/17" in capsys.readouterr().out
    assert cli.main(["status", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["committed"]["slices"] == 3
    printed, naps = [], []
    status.watch(out, 2.5, as_json=True, emit=printed.append, sleep=naps.append, rounds=2)
    assert [json.loads(p)["committed"]["slices"] for p in printed] == [3, 3] and naps == [2.5]
    assert cli.main(["status", out, "--watch", "0"]) == 1
    assert "--watch takes a positive number of seconds, got 0" in capsys.readouterr().err


def test_status_of_an_out_without_a_run_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path / "nothing")]) == 1
    assert "run.json does not exist: run 'promptmill plan' for this --out first" in capsys.readouterr().err


def test_the_status_bench_measures_status_and_a_starting_host_from_ledgers_and_from_a_listing(tmp_path):
    """``promptmill bench status`` on a small run, locally: from the ledgers, status reads
    O(hosts) objects and lists no marker, and a starting host reads a few objects; with
    the ledgers put aside both list every marker (the 1,000,000-slice figures are in
    docs/benchmarks.md)."""
    from pipeline.bench import status_scale as status_bench

    report = status_bench.run((40,), hosts=4, repeats=1, workdir=str(tmp_path))
    [found] = report["runs"]
    assert (found["committed_slices"], found["planned_slices"]) == (40, 41)  # 99% committed
    ledgers_, listing = found["ledgers"], found["listing"]
    assert ledgers_["status"]["counted_from"] == "ledgers" and ledgers_["status"]["committed"] == 40
    assert ledgers_["status"]["objects_listed"] <= 2 * 4 + 4  # the ledgers' and progress objects' names
    assert listing["status"]["counted_from"] == "listing" and listing["status"]["objects_listed"] >= 40
    assert ledgers_["host"]["committed"] == listing["host"]["committed"] == 10
    assert ledgers_["host"]["objects_read"] <= 6 and ledgers_["host"]["objects_listed"] <= 2  # ledger, 2 markers
    assert listing["host"]["objects_listed"] >= 40
    assert len(ledgers_["status"]["wall_s"]) == 1 and "gcs" not in ledgers_
    assert "ledgers" in status_bench.table(report)
    assert storage.glob(naming.join(str(tmp_path), "40", "ledger", "*.json"))  # put back


def test_status_names_hosts_that_never_started_and_one_stopped_before_its_first_event():
    starting = {**_host(0, "starting", NOW - 600, hosts=3), "last_event": None, "last_event_at": None}
    r = status.report("o", _run(), MANIFEST, _found({}), [starting], dataset_stats=None, now=NOW,
                      host_logs=frozenset({1}))
    assert r["never_started"] == [{"host": 1, "log": "o/logs/host-1.log"}, {"host": 2, "log": None}]
    text = status.format_text(r)
    assert "None" not in text and "never;" not in text
    assert "host 0: stopped while starting, before its first event (no update 10 min ago); no event yet" in text
    assert "host 1: never started (see its log o/logs/host-1.log)" in text
    assert "host 2: never started (no progress object: it never reached its first step)" in text


def test_status_counts_dropped_images_and_its_settings_line_has_scores_and_filters():
    settings = Settings(out="o", model="tiny", width=32, height=32, steps=3, scheduler="ddim", devices_per_host=2,
                        guided=True, scores=("clip", "aesthetic"), clip_model="tiny-clip",
                        aesthetic_head="tiny-aesthetic", min_clip_similarity=0.0, min_aesthetic=-1.5)
    run = Run.create(settings, "f" * 64, "2025-01-01T00:00:00+00:00", {},
                     scorers={"clip": "c" * 64, "aesthetic": "a" * 64})
    r = status.report("o", run, MANIFEST, _found(dict.fromkeys(range(5), NOW - 9)), [],
                      dataset_stats={"verified": True, "images": 13, "dropped": {"images": 4}}, now=NOW)
    text = status.format_text(r)
    assert "collect   verified: 13 images, 4 dropped by filters" in text
    assert "scores=clip,aesthetic filters=clip_similarity>=0,aesthetic>=-1.5" in text  # a threshold of 0 shows
    assert "filters=" not in status.settings_line(_run())


def test_watch_waits_for_a_run_that_has_not_planned_yet(tmp_path):
    out = str(tmp_path / "out")
    printed, naps = [], []

    def nap(seconds):
        naps.append(seconds)
        if len(naps) == 2:  # the run plans while status waits
            runs.write(out, _run())
            storage.write_json(naming.manifest(out), MANIFEST)

    status.watch(out, 1.0, as_json=False, emit=printed.append, sleep=nap, rounds=3)
    assert "not planned yet: no run.json; waiting for a run" in printed[0] and "not planned yet" in printed[1]
    assert "slices    0/5 committed" in printed[2]
    printed.clear()
    status.watch(str(tmp_path / "other"), 1.0, as_json=True, emit=printed.append, sleep=naps.append, rounds=1)
    assert json.loads(printed[0])["state"] == "not_planned"
