"""The persistent compilation cache: a second fresh process loads what the first compiled."""
import json
import os

import pytest

from pipeline.generate import compile_cache
from pipeline.engines import local as launcher
from pipeline.core import logs
from tests.conftest import run_cli


def test_local_folders_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert compile_cache.resolve("cc") == str(tmp_path / "cc")
    assert compile_cache.resolve(str(tmp_path / "x")) == str(tmp_path / "x")


def test_unusable_folders_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="local folder or gs://"):
        compile_cache.resolve("s3://bucket/cache")
    with pytest.raises(ValueError, match="needs a folder"):
        compile_cache.resolve("")
    assert compile_cache.resolve("gs://bucket/cache/") == "gs://bucket/cache"


def test_host_command_forwards_the_cache_as_an_absolute_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command = launcher.host_command("out", "127.0.0.1:1", 2, 1, compile_cache="cc")
    assert command[command.index("--compile-cache") + 1] == str(tmp_path / "cc")
    assert "--compile-cache" not in launcher.host_command("out", "127.0.0.1:1", 2, 1)


def _host_ready(out):
    with open(os.path.join(out, "logs", "host-0.log")) as f:
        return next(e for e in map(logs.parse, f) if e and e["event"] == "host_ready")


def test_a_gcs_cache_folder_is_filled_by_one_run_and_used_by_the_next(gcs_emulator, tmp_path, model_cache):
    from pipeline.io import storage

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "p"}) + "\n")
    folder = f"gs://{gcs_emulator}/compile-cache"
    common = ["--prompts", str(tmp_path / "p.jsonl"), "--model", "tiny", "--hosts", "1", "--devices-per-host", "1",
              "--steps", "2", "--no-progress", "--compile-cache", folder]
    first = run_cli(["run", "--out", str(tmp_path / "a"), *common], model_cache)
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(storage.glob(folder + "/*")) == _host_ready(str(tmp_path / "a"))["cache_writes"] > 0
    # as on a fresh machine: no local mirror, so the entries can only come from gs://
    import shutil

    shutil.rmtree(compile_cache._mirror(folder))
    second = run_cli(["run", "--out", str(tmp_path / "b"), *common], model_cache)
    assert second.returncode == 0, second.stderr[-3000:]
    ready = _host_ready(str(tmp_path / "b"))
    assert ready["cache_hits"] > 0 and ready["cache_writes"] == 0
