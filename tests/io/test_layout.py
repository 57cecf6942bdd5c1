"""The output layout's version: run.json records it, and a run of another layout is
refused by ``run``, ``collect``, ``status`` and ``reproduce``, with what to do, and left
as it was. ``tests/fixtures/layout1_run`` is a finished tiny run (1 host, 3 images) made
once with the code of commit ec47c59, the last to write layout 1 (``promptmill run
--model tiny --width 32 --height 32 --steps 2 --hosts 1 --devices-per-host 1``, its host
logs left out); it is copied, never changed. ``tests/fixtures/settings1_run`` is a planned
run (one prompt) made once with the code of commit 8902dbf, the last to write settings
version 1 (its earlier guidance, filter and key-name modes; ``promptmill plan --prompts
p.jsonl --out OUT --model tiny``): it is refused alike."""
import hashlib
import os
import shutil

import pytest

from jobs import cli
from pipeline.core import naming
from pipeline.io import runs, storage
from pipeline.testing import fabricate
from tests.conftest import ROOT

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "layout1_run")
SETTINGS1 = os.path.join(ROOT, "tests", "fixtures", "settings1_run")


def tree(folder: str) -> dict[str, str]:
    """{path relative to ``folder``: sha256} of every file, and the folders, under it."""
    found = {}
    for root, folders, files in os.walk(folder):
        for name in folders:
            found[os.path.relpath(os.path.join(root, name), folder) + "/"] = "folder"
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.fixture
def old_run(tmp_path):
    out = str(tmp_path / "old")
    shutil.copytree(FIXTURE, out)
    return out


def test_run_json_records_the_layout_and_one_without_it_is_layout_1(tmp_path):
    out = str(tmp_path / "new")
    fabricate.fabricate(out, 2, slice_size=2, hosts=1)
    assert storage.read_json(naming.run_json(out))["layout"] == naming.LAYOUT == 2
    assert runs.read(out).layout == 2
    assert "layout" not in storage.read_json(os.path.join(FIXTURE, "run.json"))
    assert runs.read_document(FIXTURE, any_version=True).get("layout", 1) == 1


@pytest.mark.parametrize("argv", [
    ["status", "{out}"],
    ["status", "{out}", "--json"],
    ["collect", "--out", "{out}"],
    ["reproduce", "prompts--L1_0000", "--out", "{out}"],
    ["run", "--prompts", "{prompts}", "--out", "{out}", "--model", "tiny", "--width", "32", "--height", "32",
     "--steps", "2", "--hosts", "1", "--devices-per-host", "1", "--no-compile-cache"],
    ["plan", "--prompts", "{prompts}", "--out", "{out}", "--model", "tiny"],
])
def test_a_run_of_the_earlier_layout_is_refused_by_every_command_and_left_as_it_was(old_run, tmp_path, argv,
                                                                                     capfd, model_cache):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "cat", "prompt": "a cat"}\n')
    before = tree(old_run)
    assert before == tree(FIXTURE)
    code = cli.main([arg.format(out=old_run, prompts=prompts) for arg in argv])
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert f"{old_run} holds a run made with output layout 1 (by promptmill 0.1.0), an earlier layout than " \
           f"this version's (2)" in err
    assert "changed nothing in it" in err and "--overwrite" in err and "another --out" in err
    assert tree(old_run) == before  # not a byte, nor a folder, added, changed or removed


@pytest.mark.parametrize("argv", [
    ["status", "{out}"],
    ["collect", "--out", "{out}"],
    ["run", "--prompts", "{prompts}", "--out", "{out}", "--model", "tiny", "--hosts", "1", "--no-compile-cache"],
    ["plan", "--prompts", "{prompts}", "--out", "{out}", "--model", "tiny"],
])
def test_a_run_of_the_earlier_settings_version_is_refused_by_every_command_and_left_as_it_was(tmp_path, argv, capfd,
                                                                                              model_cache):
    out = str(tmp_path / "old")
    shutil.copytree(SETTINGS1, out)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a fox"}\n')
    before = tree(out)
    code = cli.main([arg.format(out=out, prompts=prompts) for arg in argv])
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert f"{out} holds a run made with settings version 1 (by promptmill 0.1.0), an earlier settings version " \
           f"than this version's (2)" in err
    assert "changed nothing in it" in err and "--overwrite" in err and "another --out" in err
    assert tree(out) == before


def test_overwrite_clears_a_run_of_the_earlier_layout(old_run):
    """What the refusal offers: --overwrite deletes that run, every object of it (its names
    are still promptmill's), and nothing else."""
    from pipeline.plan import prepare

    storage.write_text(naming.join(old_run, "notes.txt"), "mine")
    assert prepare.clear_run(old_run) == len(tree(FIXTURE)) - sum(1 for v in tree(FIXTURE).values() if v == "folder")
    kept = {name: digest for name, digest in tree(old_run).items() if digest != "folder"}
    assert kept == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
