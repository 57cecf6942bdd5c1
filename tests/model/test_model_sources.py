"""--model from a gs:// prefix (copied once per machine into the cache, fingerprinted by
its objects' checksums) and from a hub id."""
import contextlib
import hashlib
import os
import subprocess
import sys
import time
from urllib.parse import unquote, urlsplit

import pytest

from pipeline.io import gcs, storage
from pipeline.model import load as model_lib
from pipeline.model.loading import fetch, identity
from pipeline.testing.fault_proxy import FaultyProxy
from tests.conftest import ROOT, TESTS


def upload_tree(local_dir, prefix):
    for root, _, files in os.walk(local_dir):
        for name in files:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, local_dir).replace(os.sep, "/")
            with open(path, "rb") as f:
                storage.write_bytes(f"{prefix}/{relative}", f.read())


def test_gcs_model_is_copied_once_and_loads_like_the_local_one(gcs_emulator, model_cache, monkeypatch):
    local = model_lib.resolve("tiny")
    prefix = f"gs://{gcs_emulator}/models/tiny"
    upload_tree(local, prefix)
    fetched = model_lib.resolve(prefix)
    assert fetched.startswith(os.path.join(model_cache, "models", "remote"))
    assert storage.object_checksums(fetched) == storage.object_checksums(local)  # the same bytes
    # a gs:// checkpoint's fingerprint is its objects' checksums: the prefix's, its copy's and the plan's agree
    assert identity.fingerprint(fetched) == identity.fingerprint(prefix) == model_lib.describe(prefix).fingerprint
    assert identity.fingerprint(prefix) != identity.fingerprint(local)
    # a local checkpoint's is still the hash of its files' names and bytes
    content = hashlib.sha256()
    for relative, path in sorted((os.path.relpath(os.path.join(root, name), local).replace(os.sep, "/"),
                                  os.path.join(root, name)) for root, _, names in os.walk(local) for name in names):
        with open(path, "rb") as f:
            content.update(relative.encode() + b"\0" + f.read() + b"\0")
    assert identity.fingerprint(local) == content.hexdigest()

    def no_download(*args, **kwargs):
        raise AssertionError("an unchanged checkpoint must not be fetched again")

    monkeypatch.setattr(storage, "download_verified", no_download)
    assert model_lib.resolve(prefix) == fetched
    monkeypatch.undo()

    storage.write_bytes(f"{prefix}/scheduler/scheduler_config.json",
                        storage.read_bytes(f"{prefix}/scheduler/scheduler_config.json").replace(b"0.012", b"0.0120"))
    changed = model_lib.resolve(prefix)
    assert changed != fetched and os.path.isfile(os.path.join(changed, "model_index.json"))


def test_gcs_prefix_without_a_checkpoint_is_a_clear_error(gcs_emulator, model_cache):
    storage.write_bytes(f"gs://{gcs_emulator}/not-a-model/readme.txt", b"hello")
    with pytest.raises(model_lib.ModelError, match="missing model_index.json"):
        model_lib.resolve(f"gs://{gcs_emulator}/not-a-model")


def test_hub_id_that_cannot_be_fetched_is_a_clear_error(monkeypatch, model_cache):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(model_lib.ModelError, match="could not fetch 'someone/some-sd-model' from the Hugging Face hub"):
        model_lib.resolve("someone/some-sd-model")


def test_unknown_model_names_the_options(model_cache):
    with pytest.raises(model_lib.ModelError, match="built-in random models: tiny, random-sd15, tiny-sdxl"):
        model_lib.resolve("/no/such/folder")


@pytest.fixture(scope="module")
def other_unet(model_cache, tmp_path_factory):
    """A UNet-only safetensors file, as SDXL-Lightning ships one: the tiny model's UNet
    in PyTorch names, every weight changed."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(model_lib.resolve("tiny"), "unet", "diffusion_pytorch_model.safetensors"))
    path = str(tmp_path_factory.mktemp("unet") / "fast_unet.safetensors")
    save_file({k: (v * 1.5 + 0.01).astype(np.float32) for k, v in tensors.items()}, path)
    return path


def test_unet_flag_replaces_the_unet_weights_and_is_part_of_the_fingerprint(other_unet, gcs_emulator, tmp_path):
    import numpy as np
    from flax.traverse_util import flatten_dict

    from pipeline.core.settings import Settings
    from pipeline.plan import prepare

    base, swapped = model_lib.load("tiny"), model_lib.load("tiny", unet=other_unet)
    a, b = flatten_dict(base.params["unet"]), flatten_dict(swapped.params["unet"])
    assert set(a) == set(b) and all(not np.allclose(a[k], b[k]) for k in a)
    for name in ("text_encoder", "vae"):  # the rest stays the checkpoint's
        for key, value in flatten_dict(base.params[name]).items():
            np.testing.assert_array_equal(value, flatten_dict(swapped.params[name])[key])
    assert swapped.fingerprint != base.fingerprint
    settings = Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "out"))
    _, run = prepare.resolve_settings(settings.replace(unet=other_unet))
    assert run.model_fingerprint == swapped.fingerprint and run.settings.unet == other_unet
    # from gs://: copied once into the cache; same bytes, same fingerprint wherever the file is
    remote = f"gs://{gcs_emulator}/unets/fast_unet.safetensors"
    with open(other_unet, "rb") as f:
        storage.write_bytes(remote, f.read())
    _, remote_run = prepare.resolve_settings(settings.replace(unet=remote))
    assert remote_run.settings_fingerprint == run.settings_fingerprint
    assert model_lib.load("tiny", unet=remote).fingerprint == swapped.fingerprint


def test_a_unet_file_that_does_not_fit_is_refused_at_plan_time(other_unet, model_cache, tmp_path):
    from pipeline.core.settings import Settings
    from pipeline.plan import prepare

    import json
    import shutil

    settings = Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "out"))
    wider = tmp_path / "wider"  # a checkpoint whose UNet is wider than the file's
    shutil.copytree(model_lib.resolve("tiny"), wider)
    config = json.loads((wider / "unet" / "config.json").read_text())
    (wider / "unet" / "config.json").write_text(json.dumps(dict(config, block_out_channels=[64, 64])))
    with pytest.raises(model_lib.ModelError, match=r"conv_in.weight is \(32, 4, 3, 3\), the checkpoint's UNet needs "
                                                   r"\(64, 4, 3, 3\)"):
        prepare.resolve_settings(settings.replace(model=str(wider), unet=other_unet))
    (tmp_path / "junk.safetensors").write_bytes(b"not tensors")
    with pytest.raises(model_lib.ModelError, match="not a readable safetensors file"):
        prepare.resolve_settings(settings.replace(unet=str(tmp_path / "junk.safetensors")))
    with pytest.raises(model_lib.ModelError, match="no such file"):
        prepare.resolve_settings(settings.replace(unet=str(tmp_path / "missing.safetensors")))
    with pytest.raises(model_lib.ModelError, match="as a .safetensors file"):
        prepare.resolve_settings(settings.replace(unet=str(tmp_path / "unet.bin")))


def test_a_gcs_lora_is_copied_once_and_fingerprinted_like_the_local_file(gcs_emulator, model_cache, monkeypatch):
    """--lora gs://: a file or a folder holding pytorch_lora_weights.safetensors."""
    fixtures = os.path.join(TESTS, "fixtures")
    checkpoint, local = os.path.join(fixtures, "pt_pipelines", "sd"), os.path.join(fixtures, "loras", "sd")
    upload_tree(local, f"gs://{gcs_emulator}/loras/style")
    folder, file = f"gs://{gcs_emulator}/loras/style", f"gs://{gcs_emulator}/loras/style/{fetch.LORA_FILE}"
    copied = fetch.resolve_lora(folder)
    assert copied.startswith(os.path.join(model_cache, "loras")) and fetch.resolve_lora(file) == copied
    expected = model_lib.describe(checkpoint, loras=[f"{local}@0.5"])
    described = model_lib.describe(checkpoint, loras=[f"{folder}@0.5"])
    assert described.fingerprint == expected.fingerprint != model_lib.describe(checkpoint).fingerprint
    assert described.loras == ({"path": folder, "scale": 0.5, "sha256": expected.loras[0]["sha256"]},)

    def no_download(*args):
        raise AssertionError("an unchanged adapter must not be fetched again")

    monkeypatch.setattr(storage, "download", no_download)
    assert fetch.resolve_lora(folder) == copied
    monkeypatch.undo()
    with pytest.raises(model_lib.ModelError, match=f"--lora gs://{gcs_emulator}/loras/none: the folder holds no "
                                                   "pytorch_lora_weights.safetensors"):
        fetch.resolve_lora(f"gs://{gcs_emulator}/loras/none")


@contextlib.contextmanager
def watched(latency_s: float = 0.0):
    """Every GCS request of this process goes through a proxy that records it (and holds
    each for ``latency_s``)."""
    previous = os.environ["STORAGE_EMULATOR_HOST"]
    with FaultyProxy(int(previous.rsplit(":", 1)[1]), failure_rate=0.0, latency_s=latency_s,
                     own_links=True) as proxy:
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{proxy.port}"
        gcs.reset_client()
        try:
            yield proxy
        finally:
            os.environ["STORAGE_EMULATOR_HOST"] = previous
            gcs.reset_client()


def downloads(proxy, prefix: str) -> dict[str, list[int]]:
    """{object name under gs:// ``prefix``: the body size of each media GET of it}."""
    under = prefix.split("/", 3)[3] + "/"
    found: dict[str, list[int]] = {}
    for method, path, size in proxy.requests:
        url = urlsplit(path)
        if method == "GET" and "alt=media" in url.query:
            name = unquote(url.path.split("/o/", 1)[1])
            if name.startswith(under):
                found.setdefault(name[len(under):], []).append(size)
    return found


def corrupt_listing(path: str) -> None:
    """Give an object another crc32c (the emulator lets its metadata be patched): its bytes
    no longer match what it is listed with, as if they were corrupted on the way."""
    blob = gcs.client().bucket(path.split("/")[2]).blob(path.split("/", 3)[3])
    blob.reload()
    blob.crc32c = "AAAAAA=="
    blob.patch()


def test_a_large_object_downloads_in_parallel_chunks_with_the_same_bytes(gcs_emulator, tmp_path, monkeypatch):
    from pipeline.core import logs

    data = os.urandom((1 << 20) + 17)
    path = f"gs://{gcs_emulator}/chunks/big.bin"
    storage.write_bytes(path, data)
    listed = storage.object_checksums(f"gs://{gcs_emulator}/chunks")["big.bin"]
    assert listed["size"] == len(data) and listed["md5"] and listed["crc32c"]
    with watched() as proxy:
        storage.download_verified(path, str(tmp_path / "chunked"), listed, chunk_size=256 << 10, workers=4)
    assert (tmp_path / "chunked").read_bytes() == data
    chunks = downloads(proxy, f"gs://{gcs_emulator}/chunks")["big.bin"]
    assert len(chunks) == 5 and sum(chunks) == len(data) and max(chunks) == 256 << 10

    # listed without a crc32c (the chunks' checksums cannot be combined): one whole download, logged
    events = []
    monkeypatch.setattr(logs, "event", lambda name, **fields: events.append((name, fields)))
    with watched() as proxy:
        storage.download_verified(path, str(tmp_path / "whole"), dict(listed, crc32c=None), chunk_size=256 << 10)
    assert (tmp_path / "whole").read_bytes() == data
    assert downloads(proxy, f"gs://{gcs_emulator}/chunks") == {"big.bin": [len(data)]}
    assert [name for name, fields in events if fields.get("path") == path] == ["download_whole"]


def test_a_download_that_does_not_match_its_listing_is_an_error_naming_the_object(gcs_emulator, model_cache,
                                                                                  tmp_path, monkeypatch):
    path = f"gs://{gcs_emulator}/corrupt/big.bin"
    storage.write_bytes(path, os.urandom((1 << 20) + 5))
    listed = storage.object_checksums(f"gs://{gcs_emulator}/corrupt")["big.bin"]
    corrupt_listing(path)
    bad = storage.object_checksums(f"gs://{gcs_emulator}/corrupt")["big.bin"]
    target = tmp_path / "big.bin"
    with pytest.raises(storage.ChecksumError, match=f"{path}: the downloaded ranges' crc32c differs"):
        storage.download_verified(path, str(target), bad, chunk_size=256 << 10)  # in chunks
    with pytest.raises(storage.ChecksumError, match=f"{path}: "):
        storage.download_verified(path, str(target), bad, chunk_size=4 << 20)  # whole
    with pytest.raises(storage.ChecksumError, match=f"{path}: now has crc32c AAAAAA==, but it was listed with"):
        storage.download_verified(path, str(target), listed, chunk_size=256 << 10)  # changed since listed
    assert not target.exists()

    # a checkpoint with an object whose bytes do not match its listing is refused, naming it; nothing is cached
    local = model_lib.resolve("tiny")
    prefix = f"gs://{gcs_emulator}/models/tiny-corrupt"
    upload_tree(local, prefix)
    corrupt_listing(f"{prefix}/unet/diffusion_pytorch_model.safetensors")
    monkeypatch.setenv("PROMPTMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(storage, "CHUNK_SIZE", 1 << 20)  # the 3 MB UNet in chunks
    with pytest.raises(model_lib.ModelError, match=f"{prefix}: unet/diffusion_pytorch_model.safetensors does not match "
                                                   "its listed checksum"):
        model_lib.resolve(prefix)
    remote = tmp_path / "cache" / "models" / "remote"
    assert [name for name in os.listdir(remote) if not name.endswith((".lock", ".objects.json"))] == []


CHILD = """
import os, sys, time
from pipeline.core import logs
from pipeline.model import load as model_load
logs.setup()
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[3]):  # every process starts resolving at the same moment
    time.sleep(0.005)
print(model_load.resolve(sys.argv[1]))
"""


def test_processes_on_one_machine_download_a_gcs_checkpoint_once(gcs_emulator, model_cache, tmp_path):
    local = model_lib.resolve("tiny")
    prefix = f"gs://{gcs_emulator}/models/tiny-once"
    upload_tree(local, prefix)
    listed = storage.object_checksums(prefix)
    cache, go, count = tmp_path / "cache", tmp_path / "go", 4
    # each request held 0.25 s, so the first process is still downloading (a dozen objects)
    # when the others reach the lock, however busy the machine
    with watched(latency_s=0.25) as proxy:
        env = dict(os.environ, PROMPTMILL_CACHE=str(cache))
        children = [subprocess.Popen([sys.executable, "-c", CHILD, prefix, str(tmp_path / f"ready-{i}"), str(go)],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for i in range(count)]
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{i}").exists() for i in range(count)) and time.monotonic() < deadline:
            time.sleep(0.01)
        go.touch()
        results = [child.communicate(timeout=120) for child in children]
    assert all(child.returncode == 0 for child in children), [err[-2000:] for _, err in results]
    folders = {out.strip() for out, _ in results}
    assert len(folders) == 1 and folders.pop().startswith(str(cache / "models" / "remote"))
    fetched = downloads(proxy, prefix)
    assert {name: sum(sizes) for name, sizes in fetched.items()} == {name: o["size"] for name, o in listed.items()}
    assert all(len(sizes) == 1 for sizes in fetched.values())  # each object once, whole (all under one chunk)
    assert sum('"cache_wait"' in err for _, err in results) >= 1  # the others waited for the first


def test_a_host_checks_a_gcs_model_by_listing_it_and_refuses_a_changed_object(gcs_emulator, model_cache):
    local = model_lib.resolve("tiny")
    prefix = f"gs://{gcs_emulator}/models/tiny-check"
    upload_tree(local, prefix)
    table = model_lib.model_table(prefix)  # what the plan writes
    weights = "unet/diffusion_pytorch_model.safetensors"
    assert table[weights] == storage.object_checksums(local)[weights]  # size, md5 and crc32c
    with watched() as proxy:
        model_lib.check_model(prefix, table)
    assert proxy.requests and downloads(proxy, prefix) == {}  # listed: not one byte read, nothing fetched

    config = f"{prefix}/scheduler/scheduler_config.json"
    original = storage.read_bytes(config)
    storage.write_bytes(config, original.replace(b"0.012", b"0.013"))  # same size, other bytes
    with pytest.raises(model_lib.ModelError, match=f"{prefix}: scheduler/scheduler_config.json differs from the "
                                                   "object the run was planned with"):
        model_lib.check_model(prefix, table)
    storage.write_bytes(config, original + b" ")
    with pytest.raises(model_lib.ModelError, match=f"scheduler/scheduler_config.json has {len(original) + 1} bytes"):
        model_lib.check_model(prefix, table)
    storage.write_bytes(config, original)
    storage.write_bytes(f"{prefix}/unet/extra.bin", b"x")
    with pytest.raises(model_lib.ModelError, match="unet/extra.bin was not part of the checkpoint"):
        model_lib.check_model(prefix, table)
