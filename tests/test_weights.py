"""Checkpoints with PyTorch safetensors load without torch and give the same images."""
import importlib.util
import json
import os

import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from pipeline.model import load as model_lib, weights
from tests.pt_export import write_twin


def test_torch_is_not_installed():
    assert importlib.util.find_spec("torch") is None


@pytest.fixture(scope="module", params=["tiny", "tiny-sdxl"])
def twins(request, model_cache, tmp_path_factory):
    flax_dir = model_lib.resolve(request.param)
    pt_dir = str(tmp_path_factory.mktemp("pt") / request.param)
    write_twin(flax_dir, pt_dir)
    return flax_dir, pt_dir


def test_safetensors_params_equal_the_flax_params(twins):
    """Equal parameters, bit for bit: the sampler is a pure function of them, so a
    safetensors checkpoint gives the same images as its Flax twin."""
    flax_dir, pt_dir = twins
    assert not any(f.endswith(".msgpack") for _, _, files in os.walk(pt_dir) for f in files)
    a, b = model_lib.load(flax_dir), model_lib.load(pt_dir)
    assert a.family == b.family
    for name in a.params:
        if name == "scheduler":
            continue
        fa, fb = flatten_dict(a.params[name]), flatten_dict(b.params[name])
        assert set(fa) == set(fb), name
        for key in fa:
            np.testing.assert_array_equal(np.asarray(fa[key]), np.asarray(fb[key]), err_msg=f"{name}/{key}")
    assert a.fingerprint != b.fingerprint  # other files, other fingerprint


def test_missing_weights_are_named(twins, tmp_path):
    _, pt_dir = twins
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(pt_dir, broken)
    os.remove(broken / "vae" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(model_lib.ModelError, match=r"no weights for 'vae'.*diffusion_pytorch_model.safetensors"):
        model_lib.load(str(broken))


def test_a_weight_with_the_wrong_shape_is_named(tmp_path, model_cache):
    from safetensors.numpy import load_file, save_file

    pt_dir = str(tmp_path / "pt")
    write_twin(model_lib.resolve("tiny"), pt_dir)
    path = os.path.join(pt_dir, "unet", "diffusion_pytorch_model.safetensors")
    tensors = load_file(path)
    tensors["conv_in.weight"] = np.zeros((1, 1, 3, 3), np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(weights.WeightsError, match="conv_in/kernel"):
        model_lib.load(pt_dir)


@pytest.mark.parametrize("remove,message", [("model_index.json", "missing model_index.json"),
                                            ("unet/config.json", "missing unet/config.json"),
                                            ("scheduler/scheduler_config.json", "missing scheduler/scheduler_config.json"),
                                            ("tokenizer", "missing component 'tokenizer/'")])
def test_a_malformed_checkpoint_names_the_missing_piece(tmp_path, model_cache, remove, message):
    import shutil

    target = tmp_path / "ckpt"
    shutil.copytree(model_lib.resolve("tiny"), target)
    victim = target / remove
    shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
    with pytest.raises(model_lib.ModelError, match=message):
        model_lib.load(str(target))


def test_sdxl_without_its_second_text_encoder_is_named(tmp_path, model_cache):
    import shutil

    target = tmp_path / "xl"
    shutil.copytree(model_lib.resolve("tiny-sdxl"), target)
    shutil.rmtree(target / "text_encoder_2")
    assert json.loads((target / "model_index.json").read_text())["text_encoder_2"][0] == "transformers"
    with pytest.raises(model_lib.ModelError, match="missing component 'text_encoder_2/'"):
        model_lib.load(str(target))
