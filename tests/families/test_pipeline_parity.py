"""promptmill's own networks and sampler against diffusers' PyTorch pipelines, on
checkpoints they wrote.

``tests/fixtures/pt_pipelines`` holds a tiny SD, a tiny SDXL and a tiny SD 2.x checkpoint
written by diffusers' PyTorch ``save_pretrained`` (safetensors; SD and SDXL with an
``EulerDiscreteScheduler`` of trailing timesteps; SD 2 with an OpenCLIP-style text encoder,
heads given per block, linear projections, upcast attention and a v-prediction DDIM), and the
images diffusers' ``StableDiffusionPipeline`` and ``StableDiffusionXLPipeline`` made with
them from given initial latents: trailing Euler and DDIM, PNDM and DPM-Solver++, guidance
0, 1 and 3, 1 to 4 steps, with and without negative prompts (SDXL's two encoders,
penultimate states, projected pooled output and time ids; SDXL's zeros for an empty
negative prompt). ``make_pipeline_fixtures.sh`` made them once, with torch in its own
virtualenv; these tests need no torch.

Each case loads the checkpoint through the path a user's takes (``model.load``: the
scheduler config resolved, safetensors converted), runs the program a run would
compile (guidance-free at guidance <= 1, guided above), and compares the float images
within 1e-3 and the uint8 images within 2 levels (in fact within 2e-6 and 1 level), and the
final latents within 1e-3.
"""
from __future__ import annotations

import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.generate import sampler
from pipeline.model import load as model_lib
from tests.conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "pt_pipelines")
CASES = sorted(path for family in ("sd", "sdxl", "sd2") for path in glob.glob(os.path.join(FIXTURES, f"{family}-*.npz")))


def case_id(path: str) -> str:
    return os.path.basename(path).removesuffix(".npz")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, sampler) -> the loaded model: the checkpoint as written, and copies whose
    scheduler config is the case's."""
    loaded = {}

    def get(family: str, sampler_name: str, config_file: str):
        if (family, sampler_name) not in loaded:
            directory = os.path.join(FIXTURES, family)
            if json.loads(config_file)["_class_name"] != json.load(open(os.path.join(
                    directory, "scheduler", "scheduler_config.json")))["_class_name"]:
                copy = tmp_path_factory.mktemp(f"{family}-ddim") / family
                shutil.copytree(directory, copy)
                (copy / "scheduler" / "scheduler_config.json").write_text(config_file)
                directory = str(copy)
            loaded[family, sampler_name] = model_lib.load(directory, dtype="fp32")
        return loaded[family, sampler_name]

    return get


_PROGRAMS = {}


def program(model, steps: int, guided: bool):
    key = (id(model), steps, guided)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = jax.jit(sampler.make_denoise_fn(model, steps, model.family.tokenize(model, [""])[0],
                                                         return_latents=True, guided=guided))
    return _PROGRAMS[key]


def test_the_fixtures_are_all_there():
    names = [case_id(path) for path in CASES]
    assert len(names) == 26 and {name.split("-")[0] for name in names} == {"sd", "sdxl", "sd2"}
    assert {name.split("-")[1] for name in names} == {"euler", "ddim", "pndm", "dpmpp"}
    assert {name for name in names if name.endswith("-neg")} == {"sdxl-dpmpp-g3-s3-neg", "sd2-dpmpp-g3-s3-neg"}


def test_sd2s_traits_are_in_its_checkpoint():
    """The SD 2 case's own keys: the exact GELU (OpenCLIP), heads as counts, linear
    projections, upcast attention, v-prediction; read as such."""
    model = _sd2()
    assert model.nets.text_encoders[0].config.hidden_act == "gelu"
    config = model.nets.unet.config
    assert [block.heads for block in config.down] == [2, 4] and config.use_linear_projection
    assert config.upcast_attention and model.sampler.config["prediction_type"] == "v_prediction"


def _sd2():
    return model_lib.load(os.path.join(FIXTURES, "sd2"), dtype="fp32")


@pytest.mark.parametrize("path", CASES, ids=case_id)
def test_images_match_diffusers_pytorch_pipeline(checkpoints, path):
    case = dict(np.load(path))
    family, name = str(case["family"]), str(case["sampler"])
    model = checkpoints(family, name, str(case["scheduler_config_file"]))
    assert (model.sampler.choice, model.sampler.engine) == (name, "steps")
    steps, guidance = int(case["steps"]), float(case["guidance_scale"])
    prompts = [str(p) for p in case["prompts"]]
    prompt_ids = jnp.asarray(model.family.tokenize(model, prompts))
    # "" for each: the pipeline got no negative prompt (the cases written before negative
    # prompts were: their ``negative_prompt`` is "")
    negatives = ([str(p) for p in case["negative_prompts"]] if "negative_prompts" in case
                 else [str(case["negative_prompt"])] * len(prompts))
    negative_ids = jnp.asarray(model.family.tokenize(model, negatives))
    images, latents = program(model, steps, guidance > 1)(model.params, prompt_ids, negative_ids,
                                                          jnp.full((len(prompts),), guidance, jnp.float32),
                                                          jnp.asarray(case["latents"]))
    np.testing.assert_allclose(np.asarray(images), case["images_float"], atol=1e-3)
    ours = np.asarray(sampler.to_uint8(images))
    diff = np.abs(ours.astype(int) - case["images_uint8"].astype(int))
    assert diff.max() <= 2, f"{case_id(path)}: {diff.max()} levels (mean {diff.mean():.3f})"
    np.testing.assert_allclose(np.asarray(latents), case["step_latents"][-1], atol=1e-3)


@pytest.mark.parametrize("family", ["sd", "sd2", "sdxl"])
def test_token_ids_and_text_conditioning_match_diffusers(checkpoints, family):
    """``{family}.text.npz``: the pipeline's token ids, and the context its UNet got: SD's
    last hidden state (after the final norm), SD 2's OpenCLIP-H-style encoder's, SDXL's
    two encoders' penultimate states side by side; its negative rows, with no negative
    prompt, are the empty prompt's (SD, SD 2) or zeros (SDXL)."""
    text = dict(np.load(os.path.join(FIXTURES, f"{family}.text.npz")))
    model = checkpoints(family, "own", json.dumps(json.load(open(os.path.join(
        FIXTURES, family, "scheduler", "scheduler_config.json")))))
    prompts = [str(p) for p in text["prompts"]]
    ids = model.family.tokenize(model, prompts)
    if family == "sdxl":
        np.testing.assert_array_equal(ids[:, 0], text["input_ids"])
        np.testing.assert_array_equal(ids[:, 1], text["input_ids_2"])
    else:
        np.testing.assert_array_equal(ids, text["input_ids"])
    encode = jax.jit(model.family.make_encode_fn(model))
    context, pooled = encode(model.params, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(context), text["encoder_hidden_states"], atol=1e-3)
    negative = np.asarray(encode(model.params, jnp.asarray(model.family.tokenize(model, ["", ""])))[0])
    expected = np.zeros_like(negative) if family == "sdxl" else negative
    np.testing.assert_allclose(text["cfg_encoder_hidden_states"], np.concatenate([expected, np.asarray(context)]),
                               atol=1e-3)
    assert (pooled is None) == (family != "sdxl")


@pytest.mark.parametrize("path", [p for p in CASES if p.endswith("-neg.npz")], ids=case_id)
def test_the_first_unet_call_matches_diffusers_with_negative_prompts(checkpoints, path):
    """The UNet's first call of a guided case with negative prompts, from our own
    conditioning: SDXL's projected pooled output and added time ids against what its
    UNet got, and the call's output (SD 2: v-prediction, upcast attention)."""
    case = dict(np.load(path))
    family = str(case["family"])
    model = checkpoints(family, str(case["sampler"]), str(case["scheduler_config_file"]))
    encode = jax.jit(model.family.make_encode_fn(model))
    negative, positive = (encode(model.params, jnp.asarray(model.family.tokenize(model, [str(p) for p in texts])))
                          for texts in (case["negative_prompts"], case["prompts"]))
    context = jnp.concatenate([negative[0], positive[0]])
    added = {}
    if family == "sdxl":
        np.testing.assert_allclose(np.asarray(jnp.concatenate([negative[1], positive[1]])), case["text_embeds"],
                                   atol=1e-3)
        size = int(case["height"])
        np.testing.assert_array_equal(case["time_ids"], np.tile([size, size, 0, 0, size, size], (4, 1)))
        added = {"text_embeds": jnp.asarray(case["text_embeds"]), "time_ids": jnp.asarray(case["time_ids"])}
    sample = jnp.asarray(case["unet_sample_0"])
    t = jnp.broadcast_to(jnp.asarray(case["unet_timesteps"][0]), (sample.shape[0],))
    output = jax.jit(model.nets.unet.apply)({"params": model.params["unet"]}, sample, t, context, **added)
    np.testing.assert_allclose(np.asarray(output), case["unet_output_0"], atol=1e-3)


def test_sdxls_first_encoder_reads_and_runs_only_the_layers_its_penultimate_state_needs(checkpoints):
    """SDXL takes the first encoder's penultimate state: its last layer and final norm are
    neither read nor run (the conditioning above still matches diffusers'); the second
    encoder's pooled, projected output needs all of it."""
    from flax.traverse_util import flatten_dict

    model = checkpoints("sdxl", "own", json.dumps(json.load(open(os.path.join(
        FIXTURES, "sdxl", "scheduler", "scheduler_config.json")))))
    for index, component in enumerate(("text_encoder", "text_encoder_2")):
        encoder = model.nets.text_encoders[index]
        params = flatten_dict(model.params[component])
        depth = {value.shape[0] for key, value in params.items() if key[:3] == ("text_model", "encoder", "layers")}
        read = encoder.config.num_hidden_layers - (index == 0)
        assert depth == {read} and encoder.layers == read
        assert any(key[1] == "final_layer_norm" for key in params) == (index == 1) == encoder.final
        assert any(key[0] == "text_projection" for key in params) == (index == 1)
