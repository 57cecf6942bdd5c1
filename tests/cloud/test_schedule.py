"""Scheduled runs: a run is named by its scheduled date (pipeline/schedule.py).

Pure tests of the date rules, then the real CLI: two triggers for one date reuse one run
(the second skips every committed slice), another date makes another run.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import random
import re
import shutil
import string

import pytest

from pipeline.collect import parts
from pipeline.cloud import dates as schedule
from pipeline.core import logs, naming
from pipeline.generate import compile_cache as compile_cache_lib
from pipeline.io import storage
from tests import trees
from tests.conftest import run_cli

DNS_1123_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


# -- run_date ---------------------------------------------------------------------------

@pytest.mark.parametrize("value,expected", [
    ("2026-11-20", "2026-11-20"),
    (" 2026-11-20\n", "2026-11-20"),  # as a shell or a template may pass it
    ("2024-02-29", "2024-02-29"),  # a leap day
    ("2026-11-20T06:00:00Z", "2026-11-20"),  # Cloud Scheduler's and Airflow's form
    ("2026-11-20T06:00:02.412345Z", "2026-11-20"),  # Workflows' time.format(sys.now())
    ("2026-11-20T06:00:00+00:00", "2026-11-20"),
    ("2026-11-20T23:30:00-05:00", "2026-11-21"),  # the UTC date, not the local one
    ("2026-11-21T01:00:00+02:00", "2026-11-20"),
    ("2026-12-31T23:59:59-00:30", "2027-01-01"),  # across a year
    ("2026-11-20T23:59:59", "2026-11-20"),  # naive: taken as UTC
    ("2026-11-20T00:00:00", "2026-11-20"),
])
def test_run_date_is_the_utc_date_of_a_date_or_an_rfc3339_time(value, expected):
    assert schedule.run_date(value) == expected


def test_run_date_without_a_value_is_today_in_utc():
    late_in_new_york = dt.datetime(2026, 11, 20, 22, 0, tzinfo=dt.timezone(dt.timedelta(hours=-5)))
    assert schedule.run_date(None, now=late_in_new_york) == "2026-11-21"
    assert schedule.run_date(None, now=dt.datetime(2026, 11, 20, 0, 0, tzinfo=dt.timezone.utc)) == "2026-11-20"
    today = schedule.run_date()
    assert today in {dt.datetime.now(dt.timezone.utc).date().isoformat(),
                     (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5)).date().isoformat()}


@pytest.mark.parametrize("value", ["", "tomorrow", "2026-13-01", "2026-02-30", "2026-11-20T25:00:00Z",
                                   "2026/11/20", "20-11-2026", "2026-11-20T06:00:00+25:00", "{date}",
                                   "20261120", "2026-W47-5"])  # no Python-version-dependent forms
def test_a_bad_date_is_a_clear_error_naming_the_value_and_the_forms(value):
    with pytest.raises(ValueError) as error:
        schedule.run_date(value)
    message = str(error.value)
    assert "--date" in message and repr(value) in message and "YYYY-MM-DD" in message and "RFC 3339" in message


# -- resolve_out ------------------------------------------------------------------------

@pytest.mark.parametrize("out,date,expected", [
    ("gs://bucket/daily/{date}", "2026-11-20", "gs://bucket/daily/2026-11-20"),
    ("gs://bucket/daily/{date}", "2026-11-20T06:00:00Z", "gs://bucket/daily/2026-11-20"),
    ("gs://bucket/daily/{date}", "2026-11-20T23:30:00-05:00", "gs://bucket/daily/2026-11-21"),
    ("/data/{date}/run-{date}", "2026-11-20", "/data/2026-11-20/run-2026-11-20"),  # every placeholder
    ("gs://bucket/fixed", "2026-11-20", "gs://bucket/fixed"),  # no placeholder: the OUT as it is
    ("gs://bucket/fixed", None, "gs://bucket/fixed"),
])
def test_resolve_out_puts_the_run_date_in_place_of_the_placeholder(out, date, expected):
    assert schedule.resolve_out(out, date) == expected


def test_resolve_out_with_a_placeholder_and_no_date_says_to_give_one():
    with pytest.raises(ValueError, match=r"holds \{date\}: give the run's --date"):
        schedule.resolve_out("gs://bucket/daily/{date}", None)


@pytest.mark.parametrize("out", ["gs://bucket/daily/{date}", "gs://bucket/fixed"])
def test_resolve_out_with_a_bad_date_is_a_clear_error(out):
    with pytest.raises(ValueError, match=r"--date must be YYYY-MM-DD or an RFC 3339 time, got 'yesterday'"):
        schedule.resolve_out(out, "yesterday")  # even where --out has no placeholder


# -- job_name ---------------------------------------------------------------------------

@pytest.mark.parametrize("prefix,date,expected", [
    ("promptmill", "2026-11-20", "promptmill-20261120"),
    ("promptmill", "2026-11-20T23:30:00-05:00", "promptmill-20261121"),  # the UTC date
    ("Prompt_Mill Daily!!", "2026-11-20", "prompt-mill-daily-20261120"),
    ("123-runs", "2026-11-20", "pm-123-runs-20261120"),  # must start with a letter
    ("", "2026-11-20", "promptmill-20261120"),
    ("---", None, "promptmill"),
    ("promptmill", None, "promptmill"),
])
def test_job_name_examples(prefix, date, expected):
    assert schedule.job_name(prefix, date) == expected


def _assert_good_job_name(name: str, date: str | None) -> None:
    assert DNS_1123_LABEL.fullmatch(name), name
    assert len(name) <= 40, name
    if date:
        assert name.endswith("-" + schedule.run_date(date).replace("-", "")), name


def test_job_name_is_dns_1123_safe_short_starts_with_a_letter_and_carries_the_date():
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits + "-_. /:!é{}"
    prefixes = ["x" * 100, "a-" * 30, "-" * 50, "9" * 60, "A" * 39 + "-b", "run-" + "z" * 33 + "---tail"]
    prefixes += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 70))) for _ in range(300)]
    for prefix in prefixes:
        for date in ("2026-11-20", "2026-11-20T06:00:00Z", None):
            _assert_good_job_name(schedule.job_name(prefix, date), date)


def test_job_names_of_two_dates_differ_and_one_date_in_two_forms_agree():
    assert schedule.job_name("promptmill-daily", "2026-11-20") != schedule.job_name("promptmill-daily", "2026-11-21")
    assert schedule.job_name("x" * 80, "2026-11-20") != schedule.job_name("x" * 80, "2026-11-21")  # truncated
    assert schedule.job_name("promptmill", "2026-11-20") == schedule.job_name("promptmill", "2026-11-20T06:00:00Z")


def test_job_name_with_a_bad_date_is_a_clear_error():
    with pytest.raises(ValueError, match="--date must be"):
        schedule.job_name("promptmill", "2026-11-31")


# -- the real CLI -----------------------------------------------------------------------

def _events(text: str, name: str) -> list[dict]:
    return [e for e in map(logs.parse, text.splitlines()) if e and e["event"] == name]


def _host_events(out: str, name: str) -> list[dict]:
    return [e for path in storage.glob(naming.join(out, "logs", "host-*.log"))
            for e in _events(storage.read_text(path), name)]


def _files(out: str) -> dict[str, tuple[str, int]]:
    """{path under OUT: (size and checksum, mtime in ns)} of the images and shards (not
    a slice folder's metadata.jsonl: collect's, rewritten by every collect as dataset/ is)."""
    sums = trees.checksums(out)
    return {name: (digest, os.stat(os.path.join(out, name)).st_mtime_ns)
            for name, digest in sums.items()
            if name.startswith(("images/", "shards/")) and not name.endswith("/metadata.jsonl")}


def test_scheduled_run_two_triggers_of_one_date_reuse_one_run_and_another_date_makes_another(tmp_path,
                                                                                             model_cache,
                                                                                             gcs_emulator):
    """Cloud Scheduler may trigger a date twice (a retry, a manual re-run), with the date
    or with the trigger's RFC 3339 time: both land in one OUT, and the second run skips
    every slice the first committed, rewriting nothing. The next date is a new OUT (its
    plan is enough to show it, and keeps the test short).

    The triggers share a persistent compile cache on gs:// (the emulator), as hosts on
    fresh machines would: the first trigger's host fills it, and the second's, with no
    local mirror, loads its programs from gs:// and compiles nothing. (The host warms up
    before it looks for committed slices, so the second trigger loads them too.)"""
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"a scheduled prompt, number {n}"} for n in range(4)]
    rows[1]["num_images"] = 2  # 5 images, slices of 2: 3 slices, the last padded
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    daily = tmp_path / "daily"
    compile_cache = f"gs://{gcs_emulator}/compile-cache"

    settings = ["--prompts", str(prompts), "--out", str(daily / "{date}"), "--model", "tiny", "--steps", "2",
                "--per-device-batch", "1", "--batches-per-slice", "2", "--devices-per-host", "1"]

    def trigger(date: str):
        result = run_cli(["run", *settings, "--date", date, "--hosts", "1", "--no-progress",
                          "--compile-cache", compile_cache], model_cache)
        assert result.returncode == 0, result.stderr[-4000:]
        assert json.loads(result.stdout.strip().splitlines()[-1]) == {"images": 5, "records": 4, "rejects": 0,
                                                                      "verified": True}
        [generated] = _events(result.stderr, "generated")
        return generated

    first = trigger("2026-11-20")
    out = str(daily / "2026-11-20")
    assert sorted(os.listdir(daily)) == ["2026-11-20"]  # the placeholder became the date
    assert (first["slices_generated"], first["slices_skipped"], first["images"]) == (3, 0, 5)
    before = _files(out)
    assert len([n for n in before if n.startswith("images/")]) == 5
    [ready] = _host_events(out, "host_ready")  # the compile cache on gs:// holds what the host compiled
    # JAX's entries for the small programs, and the host's own serialised sampler and its index entry
    entries = storage.glob(compile_cache + "/*") + storage.glob(compile_cache + "/executables/*") + \
        storage.glob(compile_cache + "/executables/index/*")
    # (a small program that the two threads getting the host ready both compile is written twice)
    assert 0 < len(entries) <= ready["cache_writes"]
    assert any("/executables/index/" in entry for entry in entries)
    shutil.rmtree(compile_cache_lib.folders._mirror(compile_cache))  # as on a fresh machine: entries only from gs://

    again = trigger("2026-11-20T06:00:00Z")  # the same date, as the trigger's time: finished, no host starts
    assert sorted(os.listdir(daily)) == ["2026-11-20"]  # one run, one OUT
    assert (again["slices_skipped"], again["slices_generated"], again["slices_redone"], again["images"]) == \
        (3, 0, 0, 0)
    assert _files(out) == before  # the same objects, none rewritten, none added
    rows_out = parts.dataset_rows(out)
    assert len(rows_out) == len({r["key"] for r in rows_out}) == 5  # no image twice
    assert storage.read_json(naming.dataset_file(out, "stats.json"))["verified"]

    whole_run = trees.checksums(out)
    trigger("2026-11-21")
    assert sorted(os.listdir(daily)) == ["2026-11-20", "2026-11-21"]  # another date, another OUT
    other = str(daily / "2026-11-21")
    assert storage.read_json(naming.run_json(other))["settings"]["out"] == other
    [ready] = _host_events(other, "host_ready")  # its host found every program in the gs:// cache
    assert ready["cache_hits"] > 0 and ready["cache_writes"] == 0
    assert storage.read_json(naming.run_json(out))["settings"]["out"] == out
    assert trees.checksums(out) == whole_run  # the other date's run left this one alone
