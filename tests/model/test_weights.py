"""Checkpoints load without torch, from PyTorch safetensors or the libraries' Flax msgpack,
to the same weights; converted once per machine and memory-mapped after."""
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from pipeline.model import load as model_lib
from pipeline.model.loading import weights
from tests.conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures")


def test_torch_is_not_installed():
    assert importlib.util.find_spec("torch") is None


@pytest.fixture(scope="module")
def flax_twin(tmp_path_factory):
    """``pt_pipelines/sd`` and ``sdxl`` with their networks' weights as diffusers' and
    transformers' Flax modules saved them (``fixtures/flax_twin``: SD's UNet, VAE and text
    encoder; SDXL's second text encoder, the projected one)."""
    twins = {}
    for family, components in (("sd", ("unet", "vae", "text_encoder")), ("sdxl", ("text_encoder_2",))):
        target = tmp_path_factory.mktemp("flax") / family
        shutil.copytree(os.path.join(FIXTURES, "pt_pipelines", family), target)
        for component in components:
            for name in os.listdir(target / component):
                if name.endswith(".safetensors"):
                    os.remove(target / component / name)
            for name in os.listdir(os.path.join(FIXTURES, "flax_twin", component)):
                shutil.copy(os.path.join(FIXTURES, "flax_twin", component, name), target / component / name)
        twins[family] = str(target)
    return twins


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_flax_msgpack_weights_equal_the_safetensors_weights(flax_twin, family):
    """The libraries' own Flax files (diffusers' ``down_blocks_0/...``, the VAE's
    ``query``/``proj_attn``, transformers' ``layers/0/...``) load by the same naming rule to the
    PyTorch files' weights, bit for bit, in their stored dtype: the same images."""
    assert any(f.endswith(".msgpack") for _, _, files in os.walk(flax_twin[family]) for f in files)
    a, b = model_lib.load(flax_twin[family]), model_lib.load(os.path.join(FIXTURES, "pt_pipelines", family))
    assert a.family == b.family
    for name in a.params:
        fa, fb = flatten_dict(a.params[name]), flatten_dict(b.params[name])
        assert set(fa) == set(fb), name
        for key in fa:
            assert np.asarray(fa[key]).dtype == np.float16, key  # as stored
            np.testing.assert_array_equal(np.asarray(fa[key]), np.asarray(fb[key]), err_msg=f"{name}/{key}")
    assert a.fingerprint != b.fingerprint  # other files, other fingerprint


def test_missing_weights_are_named(tmp_path, model_cache):
    broken = tmp_path / "broken"
    shutil.copytree(model_lib.resolve("tiny"), broken)
    os.remove(broken / "vae" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(model_lib.ModelError, match=r"no weights for 'vae'.*diffusion_pytorch_model.safetensors"):
        model_lib.load(str(broken))


def test_a_weight_with_the_wrong_shape_is_named(tmp_path, model_cache):
    from safetensors.numpy import load_file, save_file

    pt_dir = str(tmp_path / "pt")
    shutil.copytree(model_lib.resolve("tiny"), pt_dir)
    path = os.path.join(pt_dir, "unet", "diffusion_pytorch_model.safetensors")
    tensors = load_file(path)
    tensors["conv_in.weight"] = np.zeros((1, 1, 3, 3), np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(weights.WeightsError, match=r"conv_in\.weight has shape \(1, 1, 3, 3\)"):
        model_lib.load(pt_dir)


@pytest.mark.parametrize("remove,message", [("model_index.json", "missing model_index.json"),
                                            ("unet/config.json", "missing unet/config.json"),
                                            ("scheduler/scheduler_config.json", "missing scheduler/scheduler_config.json"),
                                            ("tokenizer", "missing component 'tokenizer/'")])
def test_a_malformed_checkpoint_names_the_missing_piece(tmp_path, model_cache, remove, message):
    target = tmp_path / "ckpt"
    shutil.copytree(model_lib.resolve("tiny"), target)
    victim = target / remove
    shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
    with pytest.raises(model_lib.ModelError, match=message):
        model_lib.load(str(target))


def test_sdxl_without_its_second_text_encoder_is_named(tmp_path, model_cache):
    target = tmp_path / "xl"
    shutil.copytree(model_lib.resolve("tiny-sdxl"), target)
    shutil.rmtree(target / "text_encoder_2")
    assert json.loads((target / "model_index.json").read_text())["text_encoder_2"][0] == "transformers"
    with pytest.raises(model_lib.ModelError, match="missing component 'text_encoder_2/'"):
        model_lib.load(str(target))


def _mapped(array) -> bool:
    """Whether ``array`` is a view of a memory-mapped file."""
    return _file(array) is not None


def _file(array) -> str | None:
    """The file ``array`` is a view of (memory-mapped), or None."""
    while array is not None:
        if isinstance(array, np.memmap) and array.filename:
            return os.path.realpath(array.filename)
        array = getattr(array, "base", None)
    return None


def test_safetensors_written_array_by_array_are_read_back_mapped_and_by_the_library(tmp_path):
    import ml_dtypes
    from safetensors import safe_open

    arrays = {"a/kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones((3,), np.float16),
              "c": np.asarray([1.5, -2.0], ml_dtypes.bfloat16), "d": np.zeros((0, 3), np.float32)}
    path = str(tmp_path / "w.safetensors")
    weights.write_safetensors(path, arrays)
    mapped = weights.read_mapped(path)
    assert list(mapped) == list(arrays)
    for name, array in arrays.items():
        assert mapped[name].dtype == array.dtype and mapped[name].shape == array.shape
        assert mapped[name].ctypes.data % weights.ALIGN == 0  # usable in place by a CPU device
        np.testing.assert_array_equal(mapped[name].astype(np.float32), array.astype(np.float32))
        assert _mapped(mapped[name])  # a view of the file, not a copy
    with safe_open(path, "np") as f:  # the format's own reader agrees
        np.testing.assert_array_equal(f.get_tensor("a/kernel"), arrays["a/kernel"])
        np.testing.assert_array_equal(f.get_tensor("b"), arrays["b"])
    with open(path, "r+b") as f:  # cut off the last bytes
        f.truncate(os.path.getsize(path) - 4)
    with pytest.raises(weights.WeightsError, match=r"w.safetensors: not a readable safetensors file.*past the end"):
        weights.read_mapped(path)


def test_weights_are_converted_once_and_memory_mapped_after(tmp_path, model_cache):
    """The first load converts a component's weights and keeps them; the next load maps
    them (read-only views, the same bits); a changed source is converted anew; a broken
    converted file is replaced."""
    directory = str(tmp_path / "ckpt")
    shutil.copytree(model_lib.resolve("tiny"), directory)
    assert weights.converted_files(directory) == []
    first = model_lib.load(directory)
    converted = {os.path.realpath(path) for path in weights.converted_files(directory)}
    assert len(converted) == 3  # text encoder, UNet, VAE
    second = model_lib.load(directory)
    for name in ("text_encoder", "unet", "vae"):
        a, b = flatten_dict(first.params[name]), flatten_dict(second.params[name])
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=f"{name}/{key}")
            # converted from the checkpoint's file (views of it where no axes moved), then mapped
            assert _file(b[key]) in converted and _file(a[key]) not in converted, f"{name}/{key}"
    unet = os.path.join(directory, "unet", weights.SAFETENSORS_FILES["diffusers"])
    before = weights.converted_path(unet, os.path.dirname(unet))
    os.utime(unet, ns=(os.stat(unet).st_atime_ns, os.stat(unet).st_mtime_ns + 10**9))  # "changed"
    assert weights.converted_path(unet, os.path.dirname(unet)) != before
    third = model_lib.load(directory)
    assert len(weights.converted_files(directory)) == 3 and os.path.isfile(before)
    assert _file(flatten_dict(third.params["unet"])[("conv_in", "kernel")]) not in converted  # converted anew
    broken = weights.converted_path(unet, os.path.dirname(unet))
    with open(broken, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    fourth = model_lib.load(directory)
    np.testing.assert_array_equal(np.asarray(flatten_dict(fourth.params["unet"])[("conv_in", "kernel")]),
                                  np.asarray(flatten_dict(first.params["unet"])[("conv_in", "kernel")]))
    assert _mapped(flatten_dict(model_lib.load(directory).params["unet"])[("conv_in", "kernel")])


def test_mapped_weights_go_onto_cpu_devices_without_a_copy(tmp_path, model_cache):
    """The converted file's arrays are aligned for XLA's CPU client, which then uses them
    in place: the transfer onto the devices copies nothing (every device reads the one
    mapped copy)."""
    import jax

    from pipeline.generate.generator import replicate

    model_lib.load("tiny")  # converted once (by this or an earlier test)
    kernel = flatten_dict(model_lib.load("tiny").params["unet"])[("conv_in", "kernel")]
    assert _mapped(kernel)
    placed = replicate({"k": kernel}, jax.local_devices())["k"]
    assert [s.data.unsafe_buffer_pointer() for s in placed.addressable_shards] == \
        [kernel.ctypes.data] * len(jax.local_devices())


def test_threads_asking_for_a_networks_shapes_at_once_share_one_trace():
    """A host loads its weights (their shapes check them) while a thread compiles its
    sampler from the same shapes: the second asker waits for the first one's trace."""
    import dataclasses
    import threading

    from pipeline.model.layers import vae
    from pipeline.model.loading import convert

    config = dataclasses.replace(vae.VaeConfig.from_dict({
        "latent_channels": 4, "norm_num_groups": 2, "block_out_channels": [4, 4],
        "up_block_types": ["UpDecoderBlock2D"] * 2}, shifted=False), scaling_factor=0.123457)  # no other test's
    before = convert._traced_shapes.cache_info()
    start = threading.Barrier(2)
    found = []

    def ask():
        start.wait()
        found.append(vae.NETWORK.param_shapes(config))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = convert._traced_shapes.cache_info()
    assert found[0] == found[1] and found[0]
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
