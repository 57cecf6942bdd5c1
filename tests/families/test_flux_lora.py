"""FLUX.1 LoRA adapters (--lora), merged once at load into the stacked transformer blocks,
against diffusers' PyTorch ``FluxPipeline.load_lora_weights``.

``tests/fixtures/flux_loras`` (made once by ``make_flux_lora_fixtures.sh``, with torch and
peft in their own virtualenv) holds, for the tiny [dev]-like checkpoint of
``tests/fixtures/flux``, a random rank-4 LoRA on the transformer's double and single blocks
(and its own output projection), saved by ``FluxPipeline.save_lora_weights`` (alpha 8 in its
header: alpha/rank 2), a second file adding CLIP's attention and MLP (alpha 2), and the
images ``FluxPipeline`` made with them (2 steps, 32x32, embedded guidance 3.5) after
``set_adapters(..., adapter_weights=[s])``, s = 1.0 and 0.5, from the latents of the
``dev-g3.5-s2-32x32`` fixture. Each checkpoint loads through ``load.load`` with the file as
``--lora`` (the path a run takes); the sampler is compiled once for the module: an adapter
and its scale change parameter values only.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from safetensors import safe_open
from safetensors.numpy import save_file

from pipeline.generate import sampler
from pipeline.model import load as model_lib
from pipeline.model.loading import identity
from tests.conftest import TESTS, rewritten

FIXTURES = os.path.join(TESTS, "fixtures")
DEV = os.path.join(FIXTURES, "flux", "dev")
LORAS = os.path.join(FIXTURES, "flux_loras")
TRANSFORMER_LORA = os.path.join(LORAS, "transformer")  # a folder holding pytorch_lora_weights.safetensors
TRANSFORMER_FILE = os.path.join(TRANSFORMER_LORA, "pytorch_lora_weights.safetensors")
TEXT_ENCODER_LORA = os.path.join(LORAS, "text_encoder")
SD_LORA = os.path.join(FIXTURES, "loras", "sd", "pytorch_lora_weights.safetensors")


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(os.path.join(LORAS, "dev.npz")))


@pytest.fixture(scope="module")
def loaded(model_cache, reference):
    """--lora spec (None: no adapter) -> the dev checkpoint loaded with it (fp32), once each."""
    models = {}

    def get(spec):
        if spec not in models:
            models[spec] = model_lib.load(DEV, dtype="fp32", loras=[spec] if spec else [],
                                          max_sequence_length=int(reference["max_sequence_length"]))
        return models[spec]

    return get


_PROGRAMS = []
_TRACES = []  # one entry each time the program is traced, i.e. compiled


def images_of(model, reference) -> np.ndarray:
    """uint8 images of the reference's prompts, latents and guidance, with ``model``'s params
    cast to float32, from the module's one compiled program."""
    if not _PROGRAMS:  # the program depends on the networks' shapes, not on the adapter's values
        denoise = sampler.make_denoise_fn(model, int(reference["steps"]), guided=False, guidance_rule="embedded")

        def traced(*args):
            _TRACES.append(1)
            return denoise(*args)

        _PROGRAMS.append(jax.jit(traced))
    ids = jnp.asarray(model.family.tokenize(model, [str(p) for p in reference["prompts"]]))
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), model.params)
    guidance = jnp.full((len(ids),), reference["guidance_scale"], jnp.float32)
    images = _PROGRAMS[0](params, ids, ids, guidance, jnp.asarray(reference["latents"]))
    return np.asarray(sampler.to_uint8(images))


def levels(a, b) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize("index", [0, 1], ids=["scale-1", "scale-0.5"])
def test_images_match_diffusers_flux_lora_loading(loaded, reference, index):
    scale = float(reference["scales"][index])
    theirs = reference["images_uint8"][index]
    ours = images_of(loaded(f"{TRANSFORMER_LORA}@{scale}"), reference)
    assert levels(ours, theirs) <= 2, f"scale {scale}: {levels(ours, theirs)} levels"
    # the adapter matters by far more than the tolerance: without it, or at the other scale,
    # the same program makes other images
    assert levels(images_of(loaded(None), reference), theirs) > 20
    assert levels(ours, reference["images_uint8"][1 - index]) > 10
    assert len(_TRACES) == 1  # one compile, whatever the adapter and its scale


def test_a_lora_on_clip_and_the_transformer_matches_diffusers(loaded, reference):
    theirs = reference["text_encoder_images_uint8"]
    model = loaded(f"{TEXT_ENCODER_LORA}@1.0")
    ours = images_of(model, reference)
    assert levels(ours, theirs) <= 2, f"{levels(ours, theirs)} levels"
    assert levels(theirs, reference["images_uint8"][0]) > 5  # CLIP's adapter matters
    changed = flatten_dict(model.params["text_encoder"])
    plain = flatten_dict(loaded(None).params["text_encoder"])
    assert any(not np.array_equal(np.asarray(changed[k]), np.asarray(plain[k])) for k in plain)
    for a, b in zip(jax.tree_util.tree_leaves(model.params["text_encoder_2"]),
                    jax.tree_util.tree_leaves(loaded(None).params["text_encoder_2"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # T5 is not adapted


def test_each_block_of_a_stacked_kernel_gets_its_own_update_in_the_stored_dtype(loaded):
    """transformer_blocks.{i}.… is block i of the scanned stack: W[i] + scale·alpha/rank·(up·down)ᵀ,
    in float32, cast back to the checkpoint's float16; layers the adapter does not name keep
    their bytes."""
    scale = 0.5
    merged = flatten_dict(loaded(f"{TRANSFORMER_LORA}@{scale}").params["transformer"])
    plain = flatten_dict(loaded(None).params["transformer"])
    with safe_open(TRANSFORMER_FILE, "np") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    factor = np.float32(scale * 8.0 / 4)  # the header's alpha 8, rank 4
    layers = {"transformer_blocks.{}.attn.to_out.0": ("transformer_blocks", "attn", "to_out", "0"),
              "single_transformer_blocks.{}.proj_mlp": ("single_transformer_blocks", "proj_mlp"),
              "proj_out": ("proj_out",)}
    for module, path in layers.items():
        w, got = np.asarray(plain[path + ("kernel",)]), np.asarray(merged[path + ("kernel",)])
        assert w.dtype == got.dtype == np.float16
        for block in range(2) if "{}" in module else [None]:
            name = module.format(block)
            up, down = tensors[f"transformer.{name}.lora_B.weight"], tensors[f"transformer.{name}.lora_A.weight"]
            one = w if block is None else w[block]
            expected = (one.astype(np.float32) + factor * (up @ down).T).astype(np.float16)
            np.testing.assert_array_equal(got if block is None else got[block], expected, err_msg=name)
            assert not np.array_equal(expected, one)
        np.testing.assert_array_equal(np.asarray(merged[path + ("bias",)]), np.asarray(plain[path + ("bias",)]))
    for path in (("transformer_blocks", "attn", "add_k_proj", "kernel"), ("x_embedder", "kernel"),
                 ("transformer_blocks", "ff_context", "net", "2", "kernel")):
        np.testing.assert_array_equal(np.asarray(merged[path]), np.asarray(plain[path]))


def test_a_stacked_bf16_kernel_is_merged_without_a_float32_copy_of_the_stack(tmp_path):
    """The merge's one copy of a changed kernel is in its stored dtype; float32 is one block
    at a time: its peak host allocation stays below the float32 stack's size (a 12B bf16
    model never gets a float32 copy). numpy reports its buffers to tracemalloc."""
    import tracemalloc

    from pipeline.model.loading import lora
    from pipeline.model.loading import convert

    blocks, width, rank = 16, 256, 4
    rng = np.random.default_rng(0)
    stack = rng.standard_normal((blocks, width, width)).astype(jnp.bfloat16)
    params = {"transformer": {"transformer_blocks": {"attn": {"to_q": {"kernel": stack}}}}}
    tensors = {}
    for i in range(blocks):
        tensors[f"transformer.transformer_blocks.{i}.attn.to_q.lora_A.weight"] = rng.standard_normal(
            (rank, width)).astype(np.float32)
        tensors[f"transformer.transformer_blocks.{i}.attn.to_q.lora_B.weight"] = rng.standard_normal(
            (width, rank)).astype(np.float32)
    path = str(tmp_path / "stacked.safetensors")
    save_file(tensors, path)
    torch_names = {"transformer": convert.TorchNames(stacks=("transformer_blocks",))}
    lora.merge(params, [(path, 1.0)], torch_names)  # imports and caches warmed up outside the trace
    tracemalloc.start()
    try:
        merged = lora.merge(params, [(path, 1.0)], torch_names)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < stack.size * 4, f"peak {peak} bytes; the float32 stack is {stack.size * 4}"
    got = merged["transformer"]["transformer_blocks"]["attn"]["to_q"]["kernel"]
    assert got.dtype == stack.dtype and got is not stack
    last = f"transformer.transformer_blocks.{blocks - 1}.attn.to_q"
    expected = stack[-1].astype(np.float32) + (tensors[f"{last}.lora_B.weight"] @ tensors[f"{last}.lora_A.weight"]).T
    np.testing.assert_array_equal(got[-1], expected.astype(stack.dtype))
    assert not np.array_equal(got[0], stack[0])


def test_describe_accepts_it_and_fingerprints_it(loaded, reference):
    spec = f"{TRANSFORMER_LORA}@0.5"
    described = model_lib.describe(DEV, loras=[spec], max_sequence_length=int(reference["max_sequence_length"]))
    assert described.family == "flux"
    assert described.loras == ({"path": TRANSFORMER_LORA, "scale": 0.5,
                                "sha256": identity.file_sha256(TRANSFORMER_FILE)},)
    assert described.fingerprint == loaded(spec).fingerprint != loaded(None).fingerprint


# ---------------------------------------------------------------- refused at plan time


@pytest.mark.parametrize("key", ["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
                                 "lora_unet_single_blocks_1_linear1.lora_up.weight",
                                 "diffusion_model.double_blocks.0.txt_mlp.0.lora_A.weight"])
def test_a_flux_lora_naming_bfl_blocks_is_refused_naming_the_format(tmp_path, key):
    path = str(tmp_path / "bfl.safetensors")
    save_file({key: np.zeros((4, 24), np.float32)}, path)
    with pytest.raises(model_lib.ModelError, match=rf"--lora {path}: a FLUX.1 LoRA in kohya's or Black Forest "
                                                   rf"Labs' own format \(keys such as {key}.*does not read yet"):
        model_lib.describe(DEV, loras=[path])


def test_a_lora_for_another_family_is_refused_naming_it(model_cache):
    with pytest.raises(model_lib.ModelError, match=r"made for another model family: it adapts .*unet.*, which the "
                                                   r"model does not have \(it has .*transformer"):
        model_lib.describe(DEV, loras=[SD_LORA])
    with pytest.raises(model_lib.ModelError, match=r"made for another model family: it adapts transformer, which the "
                                                   r"model does not have \(it has .*unet"):
        model_lib.describe("tiny", loras=[TRANSFORMER_LORA])


def test_a_key_that_matches_no_layer_is_refused_naming_it(tmp_path):
    def third_block(tensors):  # the checkpoint has two double blocks
        tensors["transformer.transformer_blocks.2.attn.to_q.lora_A.weight"] = np.zeros((4, 24), np.float32)
        tensors["transformer.transformer_blocks.2.attn.to_q.lora_B.weight"] = np.zeros((24, 4), np.float32)

    with pytest.raises(model_lib.ModelError, match=r"diffusers/PEFT format\): 2 key\(s\) match no layer of the "
                                                   r"model, e\.g\. transformer\.transformer_blocks\.2\.attn\.to_q"):
        model_lib.describe(DEV, loras=[rewritten(tmp_path, TRANSFORMER_FILE, third_block)])

    def wider(tensors):
        tensors["transformer.single_transformer_blocks.1.proj_mlp.lora_A.weight"] = np.zeros((4, 32), np.float32)

    with pytest.raises(model_lib.ModelError, match=r"single_transformer_blocks\.1\.proj_mlp\.lora_A\.weight "
                                                   r"\(4, 32\).*do not fit transformer/single_transformer_blocks/"
                                                   r"proj_mlp/kernel \(24, 96\)"):
        model_lib.describe(DEV, loras=[rewritten(tmp_path, TRANSFORMER_FILE, wider, "wider.safetensors")])
