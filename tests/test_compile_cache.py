"""The persistent compilation cache: where it lives and how it reaches the hosts.

That a gs:// cache filled by one run's host is used by the next run's, on a fresh
machine, is shown end to end by the two triggers of one date in tests/test_schedule.py.
"""
import pytest

from pipeline.engines import local as launcher
from pipeline.generate import compile_cache


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
