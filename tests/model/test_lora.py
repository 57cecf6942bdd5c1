"""LoRA adapters (--lora), merged once at load, against diffusers' PyTorch LoRA loading.

``tests/fixtures/loras`` (made once by ``make_lora_fixtures.sh``, with torch and peft in
their own virtualenv) holds a random rank-4 LoRA for each tiny checkpoint of
``tests/fixtures/pt_pipelines``, saved by diffusers' ``save_lora_weights`` (alpha 8 in its
header), its kohya-format twin (alpha 2), and the images diffusers' PyTorch pipeline makes
after ``load_lora_weights`` and ``set_adapters(..., adapter_weights=[s])``, s = 1.0 and 0.5,
from the latents of the pipeline fixtures. Each family's program is compiled once: an
adapter changes parameter values only.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from safetensors import safe_open
from safetensors.numpy import save_file

from pipeline.core.settings import Lora, Run, Settings, lora_spec, parse_lora
from pipeline.generate import runtime, sampler
from pipeline.model import load as model_lib
from pipeline.model.loading import identity, lora
from tests.conftest import TESTS, rewritten

FIXTURES = os.path.join(TESTS, "fixtures")
CHECKPOINTS = os.path.join(FIXTURES, "pt_pipelines")
LORAS = os.path.join(FIXTURES, "loras")
SD, SDXL = os.path.join(CHECKPOINTS, "sd"), os.path.join(CHECKPOINTS, "sdxl")
SD_LORA = os.path.join(LORAS, "sd", "pytorch_lora_weights.safetensors")


def files(family: str) -> dict[str, str]:
    return {"diffusers": os.path.join(LORAS, family, "pytorch_lora_weights.safetensors"),
            "kohya": os.path.join(LORAS, f"{family}_kohya.safetensors")}


@pytest.fixture(scope="module")
def models():
    """family -> the checkpoint loaded without adapters (float32), once per module."""
    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = model_lib.load(os.path.join(CHECKPOINTS, family), dtype="fp32")
        return loaded[family]

    return get


_PROGRAMS = {}


def with_loras(model, loras, dtype=jnp.float32):
    """``lora.merge`` as the family's load merges: by the networks' layouts, against their
    whole shapes, each merged kernel in the run's ``dtype``."""
    return lora.merge(model.params, loras, model.family.lora_torch_names(), model.family.lora_shapes(model.path), dtype)


def images_of(model, params, reference) -> np.ndarray:
    """uint8 images of the reference's prompts and latents, guidance 0, with ``params``,
    from one compiled program per model."""
    steps = int(reference["steps"])
    if id(model) not in _PROGRAMS:
        _PROGRAMS[id(model)] = jax.jit(sampler.make_denoise_fn(model, steps, model.family.tokenize(model, [""])[0],
                                                               guided=False))
    prompts = ["a red fox in the snow", "a blue whale in the ocean"]  # make_pipeline_fixtures.PROMPTS
    ids = jnp.asarray(model.family.tokenize(model, prompts))
    images = _PROGRAMS[id(model)](params, ids, ids, jnp.zeros((len(prompts),), jnp.float32),
                                  jnp.asarray(reference["latents"]))
    return np.asarray(sampler.to_uint8(images))


def within_two_levels(ours, theirs, what):
    diff = np.abs(ours.astype(int) - theirs.astype(int))
    assert diff.max() <= 2, f"{what}: {diff.max()} levels (mean {diff.mean():.3f})"


@pytest.mark.parametrize("family", ["sd", "sdxl"])
@pytest.mark.parametrize("form", ["diffusers", "kohya"])
def test_images_match_diffusers_pytorch_lora_loading(models, family, form):
    model = models(family)
    reference = dict(np.load(os.path.join(LORAS, f"{family}.npz")))
    for scale, theirs in zip(reference["scales"], reference["images_uint8"]):
        merged = with_loras(model, [(files(family)[form], float(scale))])
        within_two_levels(images_of(model, merged, reference), theirs, f"{family} {form} at scale {scale}")
    # without the adapter, the same program gives other images: the comparison above can fail
    plain = images_of(model, model.params, reference)
    assert np.abs(plain.astype(int) - reference["images_uint8"][0].astype(int)).max() > 10
    assert len(_PROGRAMS) <= 2  # one program per family, whatever the adapter and scale


def test_sdxl_lora_adapts_both_text_encoders_and_the_unet(models):
    merged = with_loras(models("sdxl"), [(files("sdxl")["diffusers"], 1.0)])
    for component in ("unet", "text_encoder", "text_encoder_2"):
        before, after = flatten_dict(models("sdxl").params[component]), flatten_dict(merged[component])
        assert any(not np.array_equal(np.asarray(before[k]), after[k]) for k in before), component
    assert merged["vae"] is models("sdxl").params["vae"]
    # SDXL reads its first encoder's penultimate state: its last layer is neither loaded nor run,
    # and the adapter's update of that layer (which diffusers computes for nothing) is not merged
    with safe_open(files("sdxl")["diffusers"], "np") as f:
        assert any(key.startswith("text_encoder.text_model.encoder.layers.1.") for key in f.keys())
    assert kernel(merged, "text_encoder", ("text_model", "encoder", "layers", "mlp", "fc1", "kernel")).shape[0] == 1
    with pytest.raises(lora.LoraError, match="match no layer"):  # without the whole shapes, it would not match
        lora.merge(models("sdxl").params, [(files("sdxl")["diffusers"], 1.0)], models("sdxl").family.lora_torch_names())


def kernel(params, component, path):
    return np.asarray(flatten_dict(params[component])[path])


def test_merged_kernels_are_w_plus_scale_alpha_over_rank_up_down_in_float32(models):
    model = models("sd")
    scale = 0.7
    result = with_loras(model, [(SD_LORA, scale)])
    with safe_open(SD_LORA, "np") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        alpha = json.loads(f.metadata()["lora_adapter_metadata"])["unet.lora_alpha"]
    assert alpha == 8.0
    layers = {  # a Dense layer, a 1x1 and a 3x3 convolution
        "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k": ("down_blocks", "0", "attentions", "0",
                                                                        "transformer_blocks", "0", "attn2", "to_k"),
        "down_blocks.0.attentions.0.proj_in": ("down_blocks", "0", "attentions", "0", "proj_in"),
        "up_blocks.1.resnets.0.conv1": ("up_blocks", "1", "resnets", "0", "conv1"),
    }
    for module, path in layers.items():
        down = tensors[f"unet.{module}.lora_A.weight"]
        up = tensors[f"unet.{module}.lora_B.weight"]
        rank = down.shape[0]
        w = kernel(model.params, "unet", path + ("kernel",)).astype(np.float32)  # stored in float16
        product = up.reshape(up.shape[0], rank) @ down.reshape(rank, -1)  # PyTorch's (out, in·kh·kw)
        if w.ndim == 2:
            update = product.T  # Flax Dense: (in, out)
        else:  # Flax Conv: (kh, kw, in, out) from PyTorch's (out, in, kh, kw)
            update = product.reshape(w.shape[3], w.shape[2], w.shape[0], w.shape[1]).transpose(2, 3, 1, 0)
        expected = w + np.float32(scale * alpha / rank) * update
        got = kernel(result, "unet", path + ("kernel",))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected, err_msg=module)
        assert not np.array_equal(got, w)
        if path[-1] != "to_k":  # a bias is not touched
            np.testing.assert_array_equal(kernel(result, "unet", path + ("bias",)),
                                          kernel(model.params, "unet", path + ("bias",)))
    # the text encoder's layers likewise (its metadata has its own alpha), block 1 of its stack
    down = tensors["text_encoder.text_model.encoder.layers.1.mlp.fc1.lora_A.weight"]
    up = tensors["text_encoder.text_model.encoder.layers.1.mlp.fc1.lora_B.weight"]
    path = ("text_model", "encoder", "layers", "mlp", "fc1", "kernel")
    stored = kernel(model.params, "text_encoder", path).astype(np.float32)
    expected = stored[1] + np.float32(scale * 8.0 / 4) * (up @ down).T
    np.testing.assert_array_equal(kernel(result, "text_encoder", path)[1], expected)


def test_older_diffusers_names_and_a_file_without_alphas(models, tmp_path):
    """The older diffusers names (UNet ``.lora.down``/``.lora.up``, text encoder
    ``.lora_linear_layer.``), renamed by diffusers' own rules; with neither an adapter
    config in the header nor ``.alpha`` keys, alpha is the rank."""
    def older(tensors):
        for key in list(tensors):
            value = tensors.pop(key)
            kind = ".lora." if key.startswith("unet.") else ".lora_linear_layer."
            tensors[key.replace(".lora_A.", f"{kind}down.").replace(".lora_B.", f"{kind}up.")] = value

    with safe_open(SD_LORA, "np") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    older(tensors)
    path = str(tmp_path / "older.safetensors")
    save_file(tensors, path)  # no header: alpha = rank, half the saved file's alpha 8 over rank 4
    assert lora.read(path).format == "diffusers/PEFT"
    ours, saved = with_loras(models("sd"), [(path, 1.0)]), with_loras(models("sd"), [(SD_LORA, 0.5)])
    for component in ("unet", "text_encoder"):
        for key, value in flatten_dict(saved[component]).items():
            np.testing.assert_array_equal(flatten_dict(ours[component])[key], value, err_msg=str(key))


def test_two_loras_compose_additively(models):
    params = models("sd").params
    first, second = files("sd")["diffusers"], files("sd")["kohya"]
    both = with_loras(models("sd"), [(first, 0.5), (second, -0.25)])
    one = with_loras(models("sd"), [(first, 0.5)])
    other = with_loras(models("sd"), [(second, -0.25)])
    changed = 0
    for component in ("unet", "text_encoder"):
        base = flatten_dict(params[component])
        a, b, ab = flatten_dict(one[component]), flatten_dict(other[component]), flatten_dict(both[component])
        for key, w in base.items():
            w = np.asarray(w)
            expected = (np.asarray(a[key]) - w) + (np.asarray(b[key]) - w) + w  # the sum of the two updates
            np.testing.assert_allclose(ab[key], expected, rtol=1e-5, atol=1e-6, err_msg=str(key))
            changed += not np.array_equal(np.asarray(ab[key]), w)
    assert changed > 50


def test_an_adapter_leaves_the_compiled_program_unchanged(models):
    from pipeline.bench import flops
    from pipeline.model import shapes

    model = models("sd")
    adapted = dataclasses.replace(model, params=with_loras(model, [(SD_LORA, 1.0)]))
    counted = flops.part_flops(adapted, 32, 32, 1, guided=False)
    assert counted == flops.part_flops(model, 32, 32, 1, guided=False) and counted["denoiser_call"] > 0
    assert jax.tree_util.tree_structure(adapted.params) == jax.tree_util.tree_structure(model.params)
    # the host keeps the stored float16 where nothing merged: the devices get one dtype either way
    assert shapes.struct(adapted.params, model.param_dtype) == shapes.struct(model.params, model.param_dtype)


def test_load_merges_the_adapters_before_the_cast_and_fingerprints_them(models, tmp_path):
    folder = os.path.join(LORAS, "sd")  # a folder holding pytorch_lora_weights.safetensors
    loaded = model_lib.load(SD, dtype="bf16", loras=[f"{folder}@0.5"])
    expected = with_loras(models("sd"), [(SD_LORA, 0.5)])
    path = ("down_blocks", "0", "attentions", "0", "transformer_blocks", "0", "attn1", "to_q", "kernel")
    got = kernel(loaded.params, "unet", path)
    assert got.dtype == jnp.bfloat16  # merged in float32, then in the run's dtype
    np.testing.assert_array_equal(got, kernel(expected, "unet", path).astype(jnp.bfloat16))
    plain = models("sd").fingerprint
    assert loaded.fingerprint != plain
    assert model_lib.describe(SD, loras=[f"{folder}@0.5"]).fingerprint == loaded.fingerprint  # the plan's
    # another scale: another fingerprint; the same bytes elsewhere: the same
    assert identity.model_fingerprint(SD, None, [(SD_LORA, 1.0)]) not in (loaded.fingerprint, plain)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(SD_LORA, copy)
    assert identity.model_fingerprint(SD, None, [(str(copy), 0.5)]) == loaded.fingerprint


def test_generate_and_reproduce_load_the_planned_adapters(models, tmp_path, model_cache):
    from pipeline.plan import prepare

    settings = Settings(model=SD, steps=2, loras=(lora_spec(SD_LORA, 0.5),), prompts="p", out=str(tmp_path))
    settings, run = prepare.resolve_settings(settings)
    assert run.loras == (Lora(path=SD_LORA, scale=0.5, sha256=run.loras[0].sha256),)
    assert len(run.loras[0].sha256) == 64
    assert Run.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    model = runtime.load_model(run)  # as every host, and reproduce, load the run's model
    assert model.fingerprint == run.model_fingerprint
    path = ("text_model", "encoder", "layers", "self_attn", "q_proj", "kernel")
    np.testing.assert_array_equal(kernel(model.params, "text_encoder", path),
                                  kernel(with_loras(models("sd"), [(SD_LORA, 0.5)]), "text_encoder", path))
    # a changed adapter file is caught before any image is made
    def doubled(tensors):
        key = next(iter(tensors))
        tensors[key] = tensors[key] * 2

    changed = rewritten(tmp_path, SD_LORA, doubled, "changed.safetensors")
    planned = dataclasses.replace(run, settings=run.settings.replace(loras=(lora_spec(changed, 0.5),)),
                                  loras=(Lora(changed, 0.5, run.loras[0].sha256),))
    with pytest.raises(runtime.GenerateError, match="the same --unet and --lora files"):
        runtime.load_model(planned)


# ---------------------------------------------------------------- errors, at plan time


def test_an_unmatched_key_is_an_error_naming_it_and_the_format(tmp_path):
    def add_layer(tensors):
        tensors["unet.down_blocks.7.attentions.0.proj_in.lora_A.weight"] = np.zeros((4, 64), np.float32)
        tensors["unet.down_blocks.7.attentions.0.proj_in.lora_B.weight"] = np.zeros((64, 4), np.float32)

    path = rewritten(tmp_path, SD_LORA, add_layer)
    with pytest.raises(model_lib.ModelError, match=r"diffusers/PEFT format\): 2 key\(s\) match no layer of the "
                                                   r"model, e\.g\. unet\.down_blocks\.7\.attentions\.0\.proj_in"):
        model_lib.describe(SD, loras=[path])

    def add_kohya_layer(tensors):
        tensors["lora_unet_mid_block_attentions_9_proj_out.lora_down.weight"] = np.zeros((4, 64), np.float32)
        tensors["lora_unet_mid_block_attentions_9_proj_out.lora_up.weight"] = np.zeros((64, 4), np.float32)

    path = rewritten(tmp_path, files("sd")["kohya"], add_kohya_layer, "kohya.safetensors")
    with pytest.raises(model_lib.ModelError, match=r"kohya format\): 2 key\(s\) match no layer.*"
                                                   r"lora_unet_mid_block_attentions_9_proj_out"):
        model_lib.describe(SD, loras=[path])

    def stability_names(tensors):  # the original Stability block names that some kohya files use
        tensors["lora_unet_input_blocks_4_1_proj_in.lora_down.weight"] = np.zeros((4, 64), np.float32)
        tensors["lora_unet_input_blocks_4_1_proj_in.lora_up.weight"] = np.zeros((64, 4), np.float32)

    path = rewritten(tmp_path, files("sd")["kohya"], stability_names, "stability.safetensors")
    with pytest.raises(model_lib.ModelError, match=r"lora_unet_input_blocks_4_1_proj_in.*original Stability "
                                                   r"blocks.*convert the file"):
        model_lib.describe(SD, loras=[path])


def test_a_lora_for_another_family_is_an_error_saying_so():
    with pytest.raises(model_lib.ModelError, match=r"made for another model family: it adapts text_encoder_2, which "
                                                   r"the model does not have"):
        model_lib.describe(SD, loras=[os.path.join(LORAS, "sdxl")])
    with pytest.raises(model_lib.ModelError, match=r"made for another model family: its UNet's cross-attention takes "
                                                   r"32-wide text features, the model's 64-wide"):
        model_lib.describe(SDXL, loras=[SD_LORA])


def test_a_shape_that_does_not_fit_is_an_error(tmp_path):
    key = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight"

    def wider(tensors):
        tensors[key] = np.zeros((4, 48), np.float32)

    with pytest.raises(model_lib.ModelError, match=r"attn1\.to_q\.lora_A\.weight \(4, 48\).*do not fit "
                                                   r"unet/down_blocks/0/.*/to_q/kernel \(32, 32\)"):
        model_lib.describe(SD, loras=[rewritten(tmp_path, SD_LORA, wider)])


def test_a_missing_or_unreadable_file_is_an_error_naming_it(tmp_path):
    missing = str(tmp_path / "missing.safetensors")
    with pytest.raises(model_lib.ModelError, match=f"--lora {missing}: no such file"):
        model_lib.describe(SD, loras=[missing])
    with pytest.raises(model_lib.ModelError, match="the folder holds no pytorch_lora_weights.safetensors"):
        model_lib.describe(SD, loras=[str(tmp_path)])
    with pytest.raises(model_lib.ModelError, match="no such file or folder"):
        model_lib.describe(SD, loras=[str(tmp_path / "nothing-here")])
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(model_lib.ModelError, match="junk.safetensors: not a readable safetensors file"):
        model_lib.describe(SD, loras=[str(junk)])
    other = tmp_path / "weights.safetensors"
    save_file({"conv_in.weight": np.zeros((1,), np.float32)}, str(other))
    with pytest.raises(model_lib.ModelError, match="not a LoRA in a known format.*conv_in.weight"):
        model_lib.describe(SD, loras=[str(other)])


def test_variants_that_are_not_plain_lora_are_refused(tmp_path):
    def dora(tensors):
        tensors["lora_unet_mid_block_attentions_0_proj_out.dora_scale"] = np.ones((1, 64), np.float32)

    with pytest.raises(model_lib.ModelError, match="not plain LoRA weights.*dora_scale"):
        model_lib.describe(SD, loras=[rewritten(tmp_path, files("sd")["kohya"], dora)])

    def half(tensors):
        del tensors["unet.mid_block.attentions.0.proj_out.lora_B.weight"]

    with pytest.raises(model_lib.ModelError, match="without their down/up partner.*mid_block.attentions.0.proj_out"):
        model_lib.describe(SD, loras=[rewritten(tmp_path, SD_LORA, half, "half.safetensors")])


# ---------------------------------------------------------------- the spec


@pytest.mark.parametrize("spec, expected", [
    ("style.safetensors", ("style.safetensors", 1.0)),
    ("style.safetensors@0.5", ("style.safetensors", 0.5)),
    ("gs://b/loras/lcm@1", ("gs://b/loras/lcm", 1.0)),
    ("style.safetensors@-0.25", ("style.safetensors", -0.25)),
    ("/data/v2@final/lora.safetensors", ("/data/v2@final/lora.safetensors", 1.0)),  # an '@' in a folder's name
    ("me@work.safetensors@1.5", ("me@work.safetensors", 1.5)),
    (lora_spec("a.safetensors", 0.5), ("a.safetensors", 0.5)),
])
def test_lora_specs(spec, expected):
    assert parse_lora(spec) == expected


@pytest.mark.parametrize("spec, message", [
    ("style.safetensors@strong", r"the scale after '@' must be a number, got 'strong'"),
    ("style.safetensors@nan", "must be finite"),
    ("@0.5", "no path before '@'"),
    ("", "--lora takes PATH"),
])
def test_bad_lora_specs_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_lora(spec)
    with pytest.raises(ValueError, match=message):
        Settings(loras=(spec,)).validate()
