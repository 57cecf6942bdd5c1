"""promptmill's sampler against diffusers' PyTorch pipelines, on checkpoints they wrote.

``tests/fixtures/pt_pipelines`` holds a tiny SD and a tiny SDXL checkpoint written by
diffusers' PyTorch ``save_pretrained`` (safetensors, ``EulerDiscreteScheduler`` with
trailing timesteps), and the images diffusers' ``StableDiffusionPipeline`` and
``StableDiffusionXLPipeline`` made with them from given initial latents: trailing Euler
and trailing DDIM, guidance 0, 1 and 3, 1 to 4 steps. ``make_pipeline_fixtures.sh``
made them once, with torch in its own virtualenv; these tests need no torch.

Each case loads the checkpoint through the path a user's takes (``model.load``: the
scheduler config resolved, safetensors converted), runs the program a run would
compile (guidance-free at guidance <= 1, guided above), and compares the images within
2 levels and the final latents within 3e-2 (the Flax UNet's tanh GELU against
PyTorch's exact one is the whole of the difference).
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

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "pt_pipelines")
CASES = sorted(glob.glob(os.path.join(FIXTURES, "sd-*.npz")) + glob.glob(os.path.join(FIXTURES, "sdxl-*.npz")))


def case_id(path: str) -> str:
    return os.path.basename(path).removesuffix(".npz")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, sampler) -> the loaded model: the checkpoint as written (trailing Euler),
    and a copy whose scheduler config is the cases' trailing DDIM."""
    loaded = {}

    def get(family: str, sampler_name: str, config_file: str):
        if (family, sampler_name) not in loaded:
            directory = os.path.join(FIXTURES, family)
            if sampler_name == "ddim":
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
    assert len(names) == 18 and {name.split("-")[0] for name in names} == {"sd", "sdxl"}
    assert {name.split("-")[1] for name in names} == {"euler", "ddim"}


@pytest.mark.parametrize("path", CASES, ids=case_id)
def test_images_match_diffusers_pytorch_pipeline(checkpoints, path):
    case = dict(np.load(path))
    family, name = str(case["family"]), str(case["sampler"])
    model = checkpoints(family, name, str(case["scheduler_config_file"]))
    config = json.loads(str(case["scheduler_config"]))
    assert (model.sampler.choice, model.sampler.engine, config["timestep_spacing"]) == (name, "steps", "trailing")
    steps, guidance = int(case["steps"]), float(case["guidance_scale"])
    prompts = [str(p) for p in case["prompts"]]
    prompt_ids = jnp.asarray(model.family.tokenize(model, prompts))
    negative_ids = jnp.asarray(model.family.tokenize(model, [""] * len(prompts)))  # no negative prompt
    images, latents = program(model, steps, guidance > 1)(model.params, prompt_ids, negative_ids,
                                                          jnp.full((len(prompts),), guidance, jnp.float32),
                                                          jnp.asarray(case["latents"]))
    ours = np.asarray(sampler.to_uint8(images))
    diff = np.abs(ours.astype(int) - case["images_uint8"].astype(int))
    assert diff.max() <= 2, f"{case_id(path)}: {diff.max()} levels (mean {diff.mean():.3f})"
    np.testing.assert_allclose(np.asarray(latents), case["step_latents"][-1], atol=3e-2)
