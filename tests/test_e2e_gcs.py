"""End to end on gs:// (the emulator) in every format, and resume after a crash."""
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from pipeline import formats, naming, storage, writer
from tests.conftest import ROOT, run_cli
from tests.test_e2e import run_args, write_prompts


def test_all_formats_with_prompts_model_and_output_on_gcs(gcs_emulator, tmp_path, model_cache):
    import webdataset as wds

    local = write_prompts(tmp_path / "prompts", 9)
    for path in storage.glob(local):
        storage.write_bytes(f"gs://{gcs_emulator}/prompts/{os.path.basename(path)}", storage.read_bytes(path))
    from tests.test_model_sources import upload_tree
    from pipeline import model as model_lib

    model = f"gs://{gcs_emulator}/models/tiny-e2e"
    upload_tree(model_lib.resolve("tiny"), model)
    out = f"gs://{gcs_emulator}/runs/all-formats"
    args = run_args(f"gs://{gcs_emulator}/prompts/*.jsonl", out, 2, 2, "--format", "files,webdataset,parquet,zarr")
    args[args.index("--model") + 1] = model
    result = run_cli(args, model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = writer.read_parquet_rows(naming.dataset_file(out, "metadata.parquet"))
    assert {r["model"] for r in rows} == {model}
    assert len(rows) == 11 and storage.read_json(naming.dataset_file(out, "stats.json"))["verified"]
    pixels = {}
    for row in rows:
        data = storage.read_bytes(naming.join(out, row["path"]))
        assert hashlib.sha256(data).hexdigest() == row["sha256"]
        pixels[row["key"]] = np.asarray(Image.open(io.BytesIO(data)))
    manifest = storage.read_json(naming.manifest(out))
    seen_tar, seen_parquet = set(), set()
    for index in range(manifest["slices"]):
        tar_path = tmp_path / f"{index}.tar"
        tar_path.write_bytes(storage.read_bytes(naming.shard_tar(out, index)))
        for sample in wds.WebDataset(str(tar_path), shardshuffle=False):
            assert {"png", "json", "txt"} <= set(sample)
            key = sample["__key__"]
            assert json.loads(sample["json"])["key"] == key and sample["txt"].decode() == json.loads(sample["json"])["prompt"]
            np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(sample["png"]))), pixels[key])
            seen_tar.add(key)
        table = pq.read_table(pa.BufferReader(storage.read_bytes(naming.image_parquet(out, index))))
        for record in table.to_pylist():
            np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(record["image"]["bytes"]))),
                                          pixels[record["key"]])
            seen_parquet.add(record["key"])
    assert seen_tar == seen_parquet == set(pixels)
    zarr = formats.read_zarr_images(out)
    assert zarr.shape == (11, 32, 32, 3)
    for row in rows:
        np.testing.assert_array_equal(zarr[row["position"]].read().result(), pixels[row["key"]])


def test_resume_after_killing_a_host_gives_the_uninterrupted_images(tmp_path, model_cache):
    prompts = write_prompts(tmp_path / "p", 40, bad_rows=False)
    reference, resumed = str(tmp_path / "reference"), str(tmp_path / "resumed")

    def args(out):
        a = run_args(prompts, out, 2, 2)
        a[a.index("--batches-per-slice") + 1] = "1"
        return a

    result = run_cli(args(reference), model_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    env = dict(os.environ, PROMPTMILL_CACHE=model_cache)
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", *args(resumed)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = os.path.join(resumed, "logs", "host-1.log")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(log) and open(log).read().count('"slice_committed"') >= 2:
            break
        time.sleep(0.1)
    with open(os.path.join(resumed, "logs", "hosts.json")) as f:
        os.kill(json.load(f)["1"], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == 1
    committed_before = len(storage.glob(naming.join(resumed, "shards", "*_stats.json")))
    result = run_cli(args(resumed), model_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    done = [json.loads(line) for h in (0, 1) for line in open(os.path.join(resumed, "logs", f"host-{h}.log"))
            if '"host_done"' in line]
    assert sum(d["slices_skipped"] for d in done) == committed_before > 0
    slices = storage.read_json(naming.manifest(resumed))["slices"]
    assert sum(d["slices_generated"] for d in done) == slices - committed_before > 0

    def hashes(out):
        return {r["key"]: r["sha256"] for r in writer.read_parquet_rows(naming.dataset_file(out, "metadata.parquet"))}

    assert len(hashes(reference)) == 42 and hashes(resumed) == hashes(reference)
    for row in writer.read_parquet_rows(naming.dataset_file(resumed, "metadata.parquet")):
        assert hashlib.sha256(storage.read_bytes(naming.join(resumed, row["path"]))).hexdigest() == row["sha256"]
