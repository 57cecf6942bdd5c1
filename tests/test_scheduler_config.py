"""A checkpoint's scheduler config is honoured or refused at plan time, never ignored:
the Flax schedulers lack keys that diffusers' PyTorch ones act on (trailing spacing,
Karras sigmas, zero-SNR betas, ...), and ``from_config`` would drop them silently."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.core.settings import Settings
from pipeline.model import load as model_lib
from pipeline.plan import prepare

# scheduler_config.json as diffusers' PyTorch classes write them for released checkpoints
SD15_PNDM = {"_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
             "beta_start": 0.00085, "clip_sample": False, "num_train_timesteps": 1000, "set_alpha_to_one": False,
             "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None}
SDXL_EULER = {"_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
              "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear", "num_train_timesteps": 1000,
              "prediction_type": "epsilon", "sample_max_value": 1.0, "set_alpha_to_one": False,
              "skip_prk_steps": True, "steps_offset": 1, "timestep_spacing": "leading", "trained_betas": None,
              "use_karras_sigmas": False}
TURBO_EULER_A = dict(SDXL_EULER, _class_name="EulerAncestralDiscreteScheduler", timestep_spacing="trailing")


@pytest.mark.parametrize("choice", ["ddim", "pndm", "euler", "dpmpp"])
def test_released_sd_configs_are_honoured_by_every_sampler(choice):
    assert model_lib.unhonoured(SD15_PNDM, choice) == []


@pytest.mark.parametrize("config, choice, expected", [
    (SDXL_EULER, "euler", []),
    (SDXL_EULER, "dpmpp", []),
    (dict(SDXL_EULER, timestep_spacing="trailing"), "euler", [("timestep_spacing", "trailing")]),
    (dict(SDXL_EULER, timestep_spacing="linspace", steps_offset=0), "euler", []),
    (dict(SDXL_EULER, steps_offset=0), "euler", [("steps_offset", 0)]),  # Flax's leading Euler adds 1
    ({k: v for k, v in SDXL_EULER.items() if k != "steps_offset"}, "euler", [("steps_offset", 0)]),
    (dict(SDXL_EULER, use_karras_sigmas=True, final_sigmas_type="sigma_min"), "euler",
     [("use_karras_sigmas", True), ("final_sigmas_type", "sigma_min")]),
    (dict(SD15_PNDM, timestep_spacing="trailing"), "ddim", [("timestep_spacing", "trailing")]),
    (dict(SD15_PNDM, timestep_spacing="trailing"), "pndm", [("timestep_spacing", "trailing")]),
    (dict(SD15_PNDM, timestep_spacing="trailing"), "dpmpp", []),  # Flax DPM-Solver has trailing
    (dict(SD15_PNDM, rescale_betas_zero_snr=True, thresholding=True), "ddim",
     [("rescale_betas_zero_snr", True), ("thresholding", True)]),
    (dict(SD15_PNDM, prediction_type="sample"), "pndm", [("prediction_type", "sample")]),
    (dict(SD15_PNDM, prediction_type="sample"), "ddim", []),
    (dict(SD15_PNDM, algorithm_type="sde-dpmsolver++", solver_order=3), "dpmpp",
     [("algorithm_type", "sde-dpmsolver++"), ("solver_order", 3)]),
    (TURBO_EULER_A, "euler", [("timestep_spacing", "trailing")]),
    # written by a Flax class: Flax keys, Flax semantics
    ({"_class_name": "FlaxEulerDiscreteScheduler", "timestep_spacing": "leading"}, "euler", []),
])
def test_each_key_a_sampler_would_not_honour_is_named(config, choice, expected):
    assert [(key, value) for key, value, _ in model_lib.unhonoured(config, choice)] == expected


@pytest.fixture(scope="module")
def trailing_checkpoint(model_cache, tmp_path_factory):
    """The tiny model with the scheduler config a few-step PyTorch checkpoint ships:
    DDIM with trailing timesteps."""
    target = tmp_path_factory.mktemp("trailing") / "tiny-trailing"
    shutil.copytree(model_lib.resolve("tiny"), target)
    path = target / "scheduler" / "scheduler_config.json"
    config = dict(json.loads(path.read_text()), _class_name="DDIMScheduler", timestep_spacing="trailing")
    path.write_text(json.dumps(config))
    return str(target)


def test_the_plan_refuses_a_sampler_that_would_ignore_the_checkpoints_spacing(trailing_checkpoint, tmp_path):
    settings = Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "out"), model=trailing_checkpoint)
    for choice in (None, "euler", "pndm"):  # the checkpoint's own (ddim), and two more without trailing
        with pytest.raises(model_lib.ModelError, match=r"asks for timestep_spacing='trailing' \(the \w+ sampler "
                                                       r"runs 'l\w+'"):
            prepare.resolve_settings(settings.replace(scheduler=choice))
    resolved, run = prepare.resolve_settings(settings.replace(scheduler="dpmpp"))  # honours trailing
    assert resolved.scheduler == run.settings.scheduler == "dpmpp"
    with pytest.raises(model_lib.ModelError, match="timestep_spacing='trailing'"):
        model_lib.load(trailing_checkpoint, "fp32")  # and a host loading it refuses too
