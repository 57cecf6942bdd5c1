"""Integrity against hostile or careless input: a run's inputs are part of its identity,
a compressed input that ends early is an error, and every bad row of a battery is a
reject with its reason (checked in-process row by row, then once through one Beam plan
over a single file that holds them all, with conservation of rows)."""
import gzip
import json
import logging
import zlib

import pytest

from jobs import cli
from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.io import storage
from pipeline.plan import input_table, inputs, layout
from pipeline.plan import transforms as plan


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


@pytest.mark.parametrize("change,what", [
    ("edit", "a.jsonl: its content changed since the run was planned"),
    ("same size", "a.jsonl: its content changed since the run was planned"),
    ("add", "c.jsonl: new: the prompt pattern matches it now"),
    ("remove", "b.jsonl: planned from, but the prompt pattern no longer matches it"),
])
def test_changed_inputs_refuse_resume_and_collect_naming_the_file(planned, change, what, capfd):
    settings, folder = planned
    before = storage.checksums(settings.out)
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
    assert storage.checksums(settings.out) == before  # nothing was re-planned
    assert cli.main(["collect", "--out", settings.out]) == 1
    assert f"cannot collect {settings.out}: its input files changed" in capfd.readouterr().err
    plan.run_plan(settings, overwrite=True)  # starting again is allowed, and records the new inputs
    plan.run_plan(settings)


def test_a_run_planned_without_an_input_table_resumes_with_one_warning(planned, caplog):
    settings, _ = planned
    storage.delete([naming.plan_inputs(settings.out)])
    with caplog.at_level(logging.WARNING, logger="promptmill"):
        plan.run_plan(settings)
    warned = [r for r in caplog.records if r.getMessage() == "inputs_not_recorded"]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert not storage.exists(naming.plan_inputs(settings.out))  # nothing is claimed about what it read


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


@pytest.mark.parametrize("name,data,rows", [
    ("cut-mid-row.jsonl.gz", _jsonl_gz()[:len(_jsonl_gz()) // 2], None),
    ("cut-at-flush.jsonl.gz", _flushed_gz(), 4),
    ("cut.csv.gz", gzip.compress(("prompt\n" + "".join(f"p{n}\n" for n in range(100))).encode())[:-12], None),
    ("cut.txt.gz", gzip.compress("".join(f"p{n}\n" for n in range(40)).encode())[:-5], None),
    ("cut.json.gz", gzip.compress(json.dumps(["a", "b"]).encode())[:-3], 0),
    ("cut.parquet.gz", None, 0),
])
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
