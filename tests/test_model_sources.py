"""--model from a gs:// prefix (copied once into the cache) and from a hub id."""
import os

import pytest

from pipeline.io import storage
from pipeline.model import load as model_lib, sources


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
    assert sources.fingerprint(fetched) == sources.fingerprint(local)
    assert model_lib.describe(prefix)["fingerprint"] == sources.fingerprint(local)

    def no_download(*args):
        raise AssertionError("an unchanged checkpoint must not be fetched again")

    monkeypatch.setattr(storage, "download", no_download)
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
    with pytest.raises(model_lib.ModelError, match="built-in random models: tiny, tiny-sdxl"):
        model_lib.resolve("/no/such/folder")


@pytest.fixture(scope="module")
def other_unet(model_cache, tmp_path_factory):
    """A UNet-only safetensors file, as SDXL-Lightning ships one: the tiny model's UNet
    in PyTorch names, every weight changed."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from tests.pt_export import write_twin

    twin = str(tmp_path_factory.mktemp("twin") / "tiny")
    write_twin(model_lib.resolve("tiny"), twin)
    tensors = load_file(os.path.join(twin, "unet", "diffusion_pytorch_model.safetensors"))
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
    fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
    checkpoint, local = os.path.join(fixtures, "pt_pipelines", "sd"), os.path.join(fixtures, "loras", "sd")
    upload_tree(local, f"gs://{gcs_emulator}/loras/style")
    folder, file = f"gs://{gcs_emulator}/loras/style", f"gs://{gcs_emulator}/loras/style/{sources.LORA_FILE}"
    copied = sources.resolve_lora(folder)
    assert copied.startswith(os.path.join(model_cache, "loras")) and sources.resolve_lora(file) == copied
    expected = model_lib.describe(checkpoint, loras=[f"{local}@0.5"])
    described = model_lib.describe(checkpoint, loras=[f"{folder}@0.5"])
    assert described["fingerprint"] == expected["fingerprint"] != model_lib.describe(checkpoint)["fingerprint"]
    assert described["loras"] == [{"path": folder, "scale": 0.5, "sha256": expected["loras"][0]["sha256"]}]

    def no_download(*args):
        raise AssertionError("an unchanged adapter must not be fetched again")

    monkeypatch.setattr(storage, "download", no_download)
    assert sources.resolve_lora(folder) == copied
    monkeypatch.undo()
    with pytest.raises(model_lib.ModelError, match=f"--lora gs://{gcs_emulator}/loras/none: the folder holds no "
                                                   "pytorch_lora_weights.safetensors"):
        sources.resolve_lora(f"gs://{gcs_emulator}/loras/none")
