"""Integrity against hostile or careless input: a run's inputs are part of its identity,
a compressed input that ends early is an error, and every bad row of a battery is a
reject with its reason (checked in-process row by row, then once through one Beam plan
over a single file that holds them all, with conservation of rows)."""
import collections
import gzip
import json
import logging
import os
import zlib

import pytest

from jobs import cli
from pipeline.core import naming, records
from pipeline.core.settings import Run, Settings
from pipeline.io import storage
from pipeline.plan import input_table, inputs, layout
from pipeline.plan import transforms as plan
from tests import trees


def _rows(count, word="test prompt number"):
    return "".join(json.dumps({"prompt": f"{word} {n}"}) + "\n" for n in range(count))


@pytest.fixture
def planned(tmp_path, model_cache):
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "a.jsonl").write_text(_rows(3))
    (folder / "b.jsonl").write_text(_rows(2, "other prompt"))
    settings = Settings(prompts=str(folder / "*.jsonl"), out=str(tmp_path / "out"), steps=2)
    plan.run_plan(settings)
    return settings, folder


def test_the_plan_records_every_input_file_with_its_size_and_checksum(planned):
    settings, folder = planned
    table = storage.read_json(naming.plan_inputs(settings.out))
    assert table["pattern"] == settings.prompts
    assert sorted(table["files"]) == [str(folder / "a.jsonl"), str(folder / "b.jsonl")]
    assert table["files"][str(folder / "a.jsonl")] == storage.checksum(str(folder / "a.jsonl"))
    plan.run_plan(settings)  # the same inputs resume


def _plan_objects(out):
    """{path: (mtime in ns, bytes)} of every object under OUT/plan."""
    return {path: (os.stat(path).st_mtime_ns, storage.read_bytes(path)) for path in storage.glob(naming.join(out, "plan"))}


def test_a_resume_keeps_the_finished_plan_and_reads_again_only_an_input_whose_size_or_time_changed(planned, caplog):
    """The same command again keeps the plan: no plan object is written again (mtimes and
    bytes unchanged), and ``plan_kept`` says so. A local input's checksum is read again
    only when its size or modification time changed (``plan/input_cache.json``)."""
    settings, folder = planned
    before = _plan_objects(settings.out)
    assert naming.input_cache(settings.out) in before
    with caplog.at_level(logging.INFO, logger="promptmill"):
        manifest = plan.run_plan(settings)
    assert [r.fields["slices"] for r in caplog.records if r.getMessage() == "plan_kept"] == [manifest["slices"]]
    assert _plan_objects(settings.out) == before
    a = folder / "a.jsonl"
    stat = a.stat()
    a.write_text(_rows(3).replace("number 1", "number 7"))  # another prompt, the same size ...
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and time: the cached checksum is trusted
    plan.run_plan(settings)
    assert _plan_objects(settings.out) == before
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # its time moved: read again, and refused
    with pytest.raises(layout.PlanError, match="a.jsonl: its content changed"):
        plan.run_plan(settings)
    a.write_text(_rows(3))  # the planned bytes again, at a new time: read, found the same, and cached
    plan.run_plan(settings)
    cached = storage.read_json(naming.input_cache(settings.out))[str(a)]
    assert (cached["mtime_ns"], cached["checksum"]) == (a.stat().st_mtime_ns, storage.checksum(str(a)))
    assert {path: found for path, found in _plan_objects(settings.out).items()
            if path != naming.input_cache(settings.out)} == {path: found for path, found in before.items()
                                                            if path != naming.input_cache(settings.out)}


@pytest.mark.parametrize("change,what", [
    ("edit", "a.jsonl: its content changed since the run was planned"),
    ("same size", "a.jsonl: its content changed since the run was planned"),
    ("add", "c.jsonl: new: the prompt pattern matches it now"),
    ("remove", "b.jsonl: planned from, but the prompt pattern no longer matches it"),
])
def test_changed_inputs_refuse_resume_and_collect_naming_the_file(planned, change, what, capfd):
    settings, folder = planned
    before = trees.checksums(settings.out)
    if change == "edit":  # the battery's sed -i: another prompt, another size
        (folder / "a.jsonl").write_text(_rows(3).replace("test prompt number", "CHANGED prompt"))
    elif change == "same size":
        (folder / "a.jsonl").write_text(_rows(3).replace("number 1", "number 9"))
    elif change == "add":
        (folder / "c.jsonl").write_text(_rows(1))
    else:
        (folder / "b.jsonl").unlink()
    with pytest.raises(layout.PlanError, match=f"cannot resume .*{what}.*--overwrite"):
        plan.run_plan(settings)
    assert trees.checksums(settings.out) == before  # nothing was re-planned
    assert cli.main(["collect", "--out", settings.out]) == 1
    assert f"cannot collect {settings.out}: its input files changed" in capfd.readouterr().err
    plan.run_plan(settings, overwrite=True)  # starting again is allowed, and records the new inputs
    plan.run_plan(settings)


def test_a_run_whose_input_table_is_gone_is_refused_by_resume_and_collect(planned, capfd):
    """The battery's case: the table and a commit marker deleted, two prompts edited: the
    run is neither resumed nor collected unchecked."""
    settings, folder = planned
    storage.delete([naming.plan_inputs(settings.out)])
    (folder / "a.jsonl").write_text(_rows(3).replace("number 1", "number 9"))
    before = trees.checksums(settings.out)
    with pytest.raises(layout.PlanError, match=r"cannot resume .*plan/inputs.json is missing.*--overwrite"):
        plan.run_plan(settings)
    assert cli.main(["collect", "--out", settings.out]) == 1
    assert "plan/inputs.json is missing" in capfd.readouterr().err
    assert trees.checksums(settings.out) == before


def test_input_table_changes_is_pure_and_ordered():
    before = {"files": {"x": "3:aa", "y": "4:bb"}}
    assert input_table.changes(before, before) == []
    found = input_table.changes(before, {"files": {"x": "3:ab", "z": "1:cc"}})
    assert [line.split(":")[0] for line in found] == ["x", "y", "z"]


# --- compressed inputs that end early ------------------------------------------------

def _jsonl_gz(n=10):
    return gzip.compress(_rows(n).encode())


def _flushed_gz(n=10):
    """A gzip stream flushed after 4 rows and cut right there: zlib itself reports no error."""
    z = zlib.compressobj(6, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    return z.compress(_rows(4).encode()) + z.flush(zlib.Z_FULL_FLUSH)


@pytest.mark.parametrize("name,data,rows", [pytest.param(*case, id=case[0]) for case in [
    ("cut-mid-row.jsonl.gz", _jsonl_gz()[:len(_jsonl_gz()) // 2], None),
    ("cut-at-flush.jsonl.gz", _flushed_gz(), 4),
    ("cut.csv.gz", gzip.compress(("prompt\n" + "".join(f"p{n}\n" for n in range(100))).encode())[:-12], None),
    ("cut.txt.gz", gzip.compress("".join(f"p{n}\n" for n in range(40)).encode())[:-5], None),
    ("cut.json.gz", gzip.compress(json.dumps(["a", "b"]).encode())[:-3], 0),
    ("cut.parquet.gz", None, 0),
]])
def test_a_compressed_input_that_ends_early_fails_the_plan_naming_it(tmp_path, model_cache, capfd, name, data, rows):
    if data is None:  # a parquet file, gzipped, cut
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": [f"p{n}" for n in range(50)]}), tmp_path / "whole.parquet")
        data = gzip.compress((tmp_path / "whole.parquet").read_bytes())[:-20]
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(inputs.TruncatedFile, match=r"ends early") as e:
        list(inputs.read_rows(str(path)))
    if rows is not None:
        assert f"{rows} row(s) read before the cut" in str(e.value)
    out = tmp_path / "out"
    assert cli.main(["plan", "--prompts", str(path), "--out", str(out)]) == 1
    err = capfd.readouterr().err
    assert str(path) in err and "ends early" in err
    assert not storage.exists(naming.manifest(str(out)))


def test_whole_gzip_inputs_still_read_including_several_members(tmp_path):
    rows = _rows(5).encode()
    (tmp_path / "two.jsonl.gz").write_bytes(gzip.compress(rows[:30]) + gzip.compress(rows[30:]))
    assert b"\n".join(raw for _, _, raw in inputs.read_rows(str(tmp_path / "two.jsonl.gz"))) + b"\n" == rows
    (tmp_path / "empty.txt.gz").write_bytes(b"")
    assert list(inputs.read_rows(str(tmp_path / "empty.txt.gz"))) == []
    (tmp_path / "junk.txt.gz").write_bytes(gzip.compress(b"a\n") + b"not gzip")
    with pytest.raises(OSError, match="not gzip"):
        list(inputs.read_rows(str(tmp_path / "junk.txt.gz")))


def test_a_csv_header_without_the_prompt_column_is_one_reject_naming_its_columns(tmp_path):
    (tmp_path / "p.csv").write_text("text,seed\na cat,1\na dog,2\n")
    [(_, line, reject)] = list(inputs.read_rows(str(tmp_path / "p.csv")))
    assert (line, reject.reason) == (0, "bad_header")
    assert "no 'prompt' column" in reject.message and "'text', 'seed'" in reject.message


# --- the bad-row battery: input -> reject reason, in-process, then once through Beam ---

LONG_ID = "x" * 65_537
BATTERY = [  # (a JSONL line, the reason it is rejected for; None: it is a record)
    (b'{"prompt": ""}', "empty_prompt"),
    (b'{"prompt": "  \\t "}', "empty_prompt"),
    (b'not json', "invalid_json"),
    (b'{"prompt": "a"} trailing', "invalid_json"),
    (b'[1, 2]', "not_an_object"),
    (b'"just a string"', "not_an_object"),
    (b'{"prompt": 5}', "prompt_not_string"),
    (b'{"prompt": null}', "missing_prompt"),
    (b'{"text": "no prompt field"}', "missing_prompt"),
    (b'{"prompt": "a", "num_images": 0}', "bad_num_images"),
    (b'{"prompt": "a", "num_images": 101}', "bad_num_images"),
    (b'{"prompt": "a", "num_images": 1.5}', "bad_num_images"),
    (b'{"prompt": "a", "num_images": true}', "bad_num_images"),
    (b'{"prompt": "a", "num_images": 1e400}', "bad_num_images"),
    (b'{"prompt": "a", "seed": -1}', "bad_seed"),
    (b'{"prompt": "a", "seed": 9223372036854775808}', "bad_seed"),
    (b'{"prompt": "a", "seed": "x"}', "bad_seed"),
    (b'{"prompt": "a", "guidance_scale": 1e300}', "bad_guidance_scale"),
    (b'{"prompt": "a", "guidance_scale": -5}', "bad_guidance_scale"),
    (b'{"prompt": "a", "guidance_scale": NaN}', "bad_guidance_scale"),
    (b'{"prompt": "a", "guidance_scale": Infinity}', "bad_guidance_scale"),
    (b'{"prompt": "a", "guidance_scale": true}', "bad_guidance_scale"),
    (b'{"prompt": "a", "negative_prompt": 5}', "bad_negative_prompt"),
    (b'{"prompt": "a", "id": ["list"]}', "bad_id"),
    (('{"prompt": "a", "id": "%s"}' % LONG_ID).encode(), "bad_id"),
    (b'\xff\xfe{"prompt": "a"}', "invalid_utf8"),
    (b'{"prompt": "\\ud800 half a pair"}', "invalid_text"),
    (b'{"prompt": "a", "tag": {"k": "\\udfff"}}', "invalid_text"),
    (b'{"prompt": "a", "prompt": "b"}', "repeated_field"),
    (b'{"prompt": "a", "seed": 1, "seed": 2}', "repeated_field"),
    # the second battery's rows
    (rb'{"prompt": "\u200b\u200b\u200c\ufeff"}', "empty_prompt"),  # only zero-width characters
    (rb'{"prompt": "\u2028 \u00a0"}', "empty_prompt"),
    (('{"prompt": "%s"}' % ("x" * 20_001)).encode(), "prompt_too_long"),
    (('{"prompt": "a", "negative_prompt": "%s"}' % ("x" * 20_001)).encode(), "bad_negative_prompt"),
    (b'{"prompt": "a", "score": NaN}', "bad_extra"),  # the metadata is JSON, which has no NaN
    (b'{"prompt": "a", "tags": [1, -Infinity]}', "bad_extra"),
    (b'{"prompt": "a", "num_images": "2.0", "seed": " 7 "}', None),  # whole numbers as text, as CSV cells
    (b'{"prompt": "a", "num_images": "2.5"}', "bad_num_images"),
    # hostile but valid: kept as records, their keys derived safely
    (b'{"prompt": "a NUL \\u0000 and an escape \\u001b[31m"}', None),
    (b'{"prompt": "a", "id": "../../etc/passwd"}', None),
    (b'{"prompt": "a", "num_images": "3", "guidance_scale": "5"}', None),
]


@pytest.mark.parametrize("line,reason", BATTERY, ids=[f"{n}-{r}" for n, (_, r) in enumerate(BATTERY)])
def test_the_battery_row_by_row(line, reason):
    result = layout.validate_payload("battery.jsonl", 7, line, 0, "", prompt_field="prompt")
    if reason is None:
        assert isinstance(result, records.Record)
        [item, *_] = records.expand(result, 0, 4)
        json.dumps(item.to_json(), ensure_ascii=False).encode("utf-8")  # every output can hold it
    else:
        assert isinstance(result, records.Reject) and result.reason == reason, result
        assert (result.source, result.line) == ("battery.jsonl", 7) and result.message
        json.dumps(result.to_json(), ensure_ascii=False).encode("utf-8")  # the rejects file can hold it


def test_one_plan_over_every_bad_row_conserves_them(tmp_path, model_cache):
    """One Beam plan of a single file holding the whole battery and a few good rows: every
    row is a record or a reject with its reason, and the counts add up."""
    good = [b'{"prompt": "good %d"}' % n for n in range(3)]
    lines = good[:1] + [line for line, _ in BATTERY] + good[1:]
    (tmp_path / "battery.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = str(tmp_path / "out")
    manifest = plan.run_plan(Settings(prompts=str(tmp_path / "battery.jsonl"), out=out, steps=2))
    expected = collections.Counter(reason for _, reason in BATTERY if reason)
    assert manifest["input_rows"] == len(lines)
    assert manifest["records"] + manifest["rejects"] == manifest["input_rows"]
    assert manifest["rejects_by_reason"] == dict(expected)
    assert manifest["records"] == len(good) + sum(1 for _, reason in BATTERY if reason is None)
    rejected = [json.loads(line) for path in storage.glob(naming.join(out, "plan", "rejects", "*.jsonl"))
                for line in storage.read_text(path).splitlines()]
    assert sorted(r["line"] for r in rejected) == [n + 2 for n, (_, reason) in enumerate(BATTERY) if reason]


# --- run-level settings get the bounds records get, and the family's own --------------

@pytest.mark.parametrize("flags,message", [
    (["--guidance-scale", "1e300"], "--guidance-scale must be a number in [0, 100]"),
    (["--guidance-scale", "-5"], "--guidance-scale must be a number in [0, 100]"),
    (["--guidance-scale", "nan"], "--guidance-scale must be a number in [0, 100]"),
    (["--steps", "10000"], "--steps must be a whole number from 1 to 1000"),
    (["--steps", "0"], "--steps must be a whole number from 1 to 1000"),
    (["--scheduler", "ddim", "--steps", "999"], None),
    # leading spacing with SD's steps_offset 1: 1000 steps would reach timestep 1000, which
    # diffusers' DDIMScheduler would index past its 1000 alphas
    (["--scheduler", "ddim", "--steps", "1000"], "reaches timestep 1000, past the last (999)"),
    (["--scheduler", "pndm", "--steps", "3"], "runs 4 to 1000 steps (the pndm sampler"),
    (["--scheduler", "dpmpp", "--steps", "1000"], "runs 1 to 999 steps"),
    (["--height", "100000"], "--height must be at most 8192 pixels"),
    (["--width", "8192"], "images are at most 4096 pixels each way"),
    (["--per-device-batch", "100000"], "--per-device-batch must be a whole number from 1 to 256"),
    (["--batches-per-slice", "0"], "--batches-per-slice must be a whole number from 1 to 4096"),
    (["--device-memory", "inf", "--per-device-batch", "auto"], "--device-memory must be a number of GiB"),
])
def test_run_level_settings_are_bounded_at_plan_time(tmp_path, model_cache, capfd, flags, message):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    out = tmp_path / "out"
    code = cli.main(["plan", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out), *flags])
    err = capfd.readouterr().err
    if message is None:
        assert code == 0, err
    else:
        assert code == 1 and message in err, err
        assert not storage.exists(naming.run_json(str(out)))


# --- the smaller ones ------------------------------------------------------------------

def test_a_malformed_model_index_is_an_error_naming_the_file(tmp_path, model_cache, capfd):
    import shutil

    from pipeline.model import load as model_lib

    model = tmp_path / "model"
    shutil.copytree(model_lib.resolve("tiny"), model)
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline", bad}')
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    assert cli.main(["plan", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out"),
                     "--model", str(model)]) == 1
    err = capfd.readouterr().err
    assert f"{model / 'model_index.json'} is not valid JSON: Expecting property name" in err


def test_control_characters_are_escaped_in_the_gallery_and_the_card():
    from pipeline.collect import card, gallery
    from tests.collect.test_card import RUN_JSON, STATS

    hostile = "a NUL \x00, an escape \x1b[31m, a DEL \x7f and a C1 \x85"
    row = {"key": "k_0000", "prompt": hostile, "seed": 1, "slice": 0, "path": "images/00000/k_0000.png",
           "dropped": "clip_similarity \x00 < 0.2"}
    page = gallery.render_page([row, dict(row, key="j_0000", dropped=None)], 1, 1, 2, "title \x00")
    assert not any(c in page for c in "\x00\x1b\x7f\x85")
    assert "a NUL \\x00, an escape \\x1b[31m, a DEL \\x7f and a C1 \\x85" in page
    run = Run.from_dict(dict(RUN_JSON, settings=dict(RUN_JSON["settings"], model="/m\x00del\x1b")))
    text = card.render(run, dict(STATS, rejects_by_reason={"bad\x00reason": 1}))
    assert not any(c in text for c in "\x00\x1b") and "/m\\x00del\\x1b" in text


def test_a_local_write_that_fails_leaves_no_file_under_its_final_name(tmp_path, monkeypatch):
    """A full disk mid-write (collect's metadata.parquet, any object): the final name never
    holds a truncated file, and no scratch file is left."""
    import errno

    from pipeline.io import beamio

    target = tmp_path / "dataset" / "metadata.parquet"
    with pytest.raises(OSError, match="No space"):
        with beamio.open_write(str(target)) as f:
            f.write(b"x" * 102_400)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.rglob("*")) == [tmp_path / "dataset"]
    target.write_bytes(b"the old, whole file")
    real_replace = storage.os.replace
    monkeypatch.setattr(storage.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    with pytest.raises(OSError):
        storage.write_bytes(str(target), b"new bytes")
    monkeypatch.setattr(storage.os, "replace", real_replace)
    assert target.read_bytes() == b"the old, whole file" and len(list(target.parent.iterdir())) == 1
    storage.write_bytes(str(target), b"new bytes")
    assert target.read_bytes() == b"new bytes" and oct(target.stat().st_mode & 0o777) == oct(0o666 & ~storage._UMASK)
