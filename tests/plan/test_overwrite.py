"""Re-planning an OUT: the same settings resume, other settings are refused unless
``--overwrite``, which deletes exactly what promptmill wrote there."""
from pathlib import Path

import pytest

from jobs import cli
from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.io import storage
from pipeline.plan import transforms as plan
from tests import trees


@pytest.fixture
def planned(tmp_path, model_cache):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    settings = Settings(prompts=str(tmp_path / "p.jsonl"), out=str(tmp_path / "out"), steps=3)
    plan.run_plan(settings)
    return settings


def test_resuming_keeps_the_first_run_json(planned):
    first = storage.read_json(naming.run_json(planned.out))
    storage.write_json(naming.run_json(planned.out), dict(first, created_at="2000-01-01T00:00:00+00:00"))
    plan.run_plan(planned)
    assert storage.read_json(naming.run_json(planned.out))["created_at"] == "2000-01-01T00:00:00+00:00"


def test_other_settings_are_refused_with_a_hint_and_nothing_changes(planned):
    before = trees.checksums(planned.out)
    with pytest.raises(plan.PlanError, match=r"changed: steps, width\).*--overwrite"):
        plan.run_plan(planned.replace(steps=4, width=64))
    assert trees.checksums(planned.out) == before


USERS_OWN = ("notes.txt", "planning/keep.txt", "images/mine.png", "logs/app.log", "dataset/mydata.csv",
             "shards/notes.md", "zarr.json", "plan/my-plan.txt", "progress/host-0.txt")


def test_overwrite_deletes_only_what_promptmill_wrote(planned):
    out = planned.out
    for name in ("shards/00007.tar", "images/00007/old_0000.png", "thumbs/00007/old_0000.jpg", "logs/host-0.log",
                 "logs/attempt-2/host-1.log", "zarr/24x32/images/c/0", "dataset/stats.json", "dataset/gallery/page-00002.html",
                 "zarr/images/c/0/0/0/0", "progress/host-00001.json"):
        storage.write_bytes(naming.join(out, name), b"from the old run")
    for name in USERS_OWN:
        storage.write_bytes(naming.join(out, name), b"the user's own file")
    manifest = plan.run_plan(planned.replace(steps=4), overwrite=True)
    assert manifest["slices"] == 1
    names = set(trees.checksums(out))
    assert {*USERS_OWN, "run.json", "plan/manifest.json", "plan/model_files.json", "plan/inputs.json",
            "plan/input_cache.json", "plan/slices/00000.jsonl", "plan/keys/00000.parquet"} == names
    assert all(storage.read_bytes(naming.join(out, name)) == b"the user's own file" for name in USERS_OWN)
    assert storage.read_json(naming.run_json(out))["settings"]["steps"] == 4
    assert not (Path(out) / "images" / "00007").exists() and not (Path(out) / "zarr").exists()


def test_overwrite_refuses_a_folder_that_holds_no_run_and_deletes_nothing(tmp_path, capfd):
    """A folder of the user's own, which never held a run: nothing is deleted, the refusal says why."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n')
    out = tmp_path / "mine"
    for name in ("images/mine.png", "logs/app.log", "dataset/mydata.csv"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b"the user's own file")
    before = trees.checksums(str(out))
    assert cli.main(["plan", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out), "--overwrite"]) == 1
    err = capfd.readouterr().err
    assert "holds files that no promptmill run wrote (dataset/mydata.csv, images/mine.png, logs/app.log)" in err
    assert "--overwrite deletes only what a promptmill run wrote" in err
    assert trees.checksums(str(out)) == before


def test_overwrite_refuses_a_run_json_that_is_not_a_promptmill_run(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n')
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "run.json").write_text('{"name": "someone else\'s run"}')
    (out / "images").mkdir()
    (out / "images" / "00000").mkdir()
    (out / "images" / "00000" / "x_0000.png").write_bytes(b"png")
    with pytest.raises(plan.PlanError, match="is not a promptmill run's"):
        plan.run_plan(Settings(prompts=str(tmp_path / "p.jsonl"), out=str(out)), overwrite=True)
    assert (out / "images" / "00000" / "x_0000.png").exists()


def test_an_out_that_is_a_file_is_refused_clearly(tmp_path, capfd):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n')
    (tmp_path / "afile").write_text("not a folder")
    for extra in ([], ["--overwrite"]):
        assert cli.main(["plan", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "afile"),
                         *extra]) == 1
        assert "is a file, not a folder" in capfd.readouterr().err
    assert (tmp_path / "afile").read_text() == "not a folder"
