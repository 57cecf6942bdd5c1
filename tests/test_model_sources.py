"""--model from a gs:// prefix (copied once into the cache) and from a hub id."""
import os

import pytest

from pipeline.io import storage
from pipeline.model import load as model_lib


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
    assert model_lib.fingerprint(fetched) == model_lib.fingerprint(local)
    assert model_lib.describe(prefix)["fingerprint"] == model_lib.fingerprint(local)

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
