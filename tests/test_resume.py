"""Exactly once: a host killed (SIGKILL) at each crash point, then the same command again.

One output folder goes through three crashed runs and a final clean one; the result must
equal an uninterrupted run image for image, and each run's log must say what it skipped
and what it redid.
"""
import hashlib
import io
import json
import os
import tarfile

import pytest

from pipeline import crashpoints, logs, naming, storage, writer
from tests.conftest import run_cli
from tests.test_e2e import run_args, write_prompts


def test_crash_spec_parsing():
    assert crashpoints.parse("1:mid_slice:2") == (1, "mid_slice", 2)
    assert crashpoints.parse("0:ready") == (0, "ready", 0)
    for bad in ("x:ready:0", "0:nowhere:0", "0:ready:-1", "0"):
        with pytest.raises(ValueError, match="PROMPTMILL_CRASH_AT"):
            crashpoints.parse(bad)


def _events(text: str, name: str) -> list[dict]:
    return [e for e in map(logs.parse, text.splitlines()) if e and e["event"] == name]


def _host_events(out: str, name: str) -> list[dict]:
    found = []
    for path in storage.glob(naming.join(out, "logs", "host-*.log")):
        found += _events(storage.read_text(path), name)
    return found


def _committed(out: str) -> dict[int, int]:
    """{slice: host} of the committed slices."""
    return {storage.read_json(p)["slice"]: storage.read_json(p)["host"]
            for p in storage.glob(naming.join(out, "shards", "*_stats.json"))}


def _tar_images(out: str, slices: int) -> dict[str, str]:
    found = {}
    for index in range(slices):
        with tarfile.open(fileobj=io.BytesIO(storage.read_bytes(naming.shard_tar(out, index)))) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".png"):
                    found[member.name] = hashlib.sha256(tar.extractfile(member).read()).hexdigest()
    return found


def test_killed_before_first_commit_mid_slice_and_between_slices_then_resumed(tmp_path, model_cache):
    prompts = write_prompts(tmp_path / "prompts", 24, bad_rows=False)  # 26 images
    compile_cache = str(tmp_path / "compile-cache")

    def run(out, crash=None):
        args = run_args(prompts, out, 2, 2, "--format", "files,webdataset", "--compile-cache", compile_cache)
        args[args.index("--batches-per-slice") + 1] = "1"  # slices of 2: 13 slices, 7 slots per host
        env = dict(os.environ)
        env.pop(crashpoints.ENV, None)
        if crash:
            env[crashpoints.ENV] = crash
        return run_cli(args, model_cache, env=env)

    reference = str(tmp_path / "reference")
    result = run(reference)
    assert result.returncode == 0, result.stderr[-3000:]
    out = str(tmp_path / "crashed")

    # Host 0 is the victim: it loads its programs from the compile cache and is ready
    # first, so each crashed run ends before host 1 has finished compiling.
    # 1. host 0 dies warmed up, before its first commit: it committed nothing
    result = run(out, "0:ready:0")
    assert result.returncode == 1 and "host 0 of 2 failed (killed by SIGKILL)" in result.stderr
    assert [e["point"] for e in _host_events(out, "crash_point")] == ["ready"]
    assert 0 not in _committed(out).values()

    # 2. host 0 dies inside its second slice: slice 0 committed; slice 2 has images, no shards, no marker
    result = run(out, "0:mid_slice:1")
    assert result.returncode == 1 and "host 0 of 2 failed (killed by SIGKILL)" in result.stderr
    assert [e["point"] for e in _host_events(out, "crash_point")] == ["mid_slice"]
    committed = _committed(out)
    assert committed.get(0) == 0 and 2 not in committed
    assert len(storage.glob(naming.join(out, "images", "00002", "*.png"))) == 2
    assert not storage.exists(naming.shard_tar(out, 2)) and not storage.exists(naming.shard_metadata(out, 2))

    # 3. host 0 dies right after its second commit of this run, between two slices:
    #    it redid the half-written slice 2 (its first commit), then committed slice 4
    result = run(out, "0:committed:1")
    assert result.returncode == 1 and "host 0 of 2 failed (killed by SIGKILL)" in result.stderr
    assert [(e["slice"], e["leftover_objects"]) for e in _host_events(out, "slice_redone")] == [(2, 2)]
    [done_3] = [e for e in _host_events(out, "crash_point")]
    assert done_3["point"] == "committed"
    committed = _committed(out)
    assert {0, 2, 4} <= set(committed) and 6 not in committed

    # 4. the same command again completes: the log says what it skipped and what it generated
    result = run(out)
    assert result.returncode == 0, result.stderr[-3000:]
    [summary] = _events(result.stderr, "generated")
    assert summary["slices_skipped"] == len(committed) and summary["slices_generated"] == 13 - len(committed)
    assert summary["images"] == 26 - sum(2 for _ in committed)
    done = _host_events(out, "host_done")
    assert sum(d["slices_skipped"] for d in done) == len(committed)

    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    assert stats["verified"] and stats["images"] == 26
    rows = writer.read_parquet_rows(naming.dataset_file(out, "metadata.parquet"))
    expected = {r["key"]: r["sha256"] for r in writer.read_parquet_rows(naming.dataset_file(reference,
                                                                                            "metadata.parquet"))}
    assert len(rows) == len({r["key"] for r in rows}) == 26  # every planned image exactly once
    assert {r["key"]: r["sha256"] for r in rows} == expected
    for row in rows:
        assert hashlib.sha256(storage.read_bytes(naming.join(out, row["path"]))).hexdigest() == row["sha256"]
    assert _tar_images(out, 13) == _tar_images(reference, 13)
    assert len(storage.glob(naming.join(out, "images", "*", "*.png"))) == 26  # no stray objects either
