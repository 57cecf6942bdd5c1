"""A checkpoint's scheduler config is honoured or refused at plan time, never ignored: every
sampler runs on promptmill's own steps, which read the config as diffusers' PyTorch class of
that sampler does (its keys, its defaults for the missing ones), and refuse what they do not
do, naming the key. A config written by one of diffusers' former Flax classes keeps the
meaning it had there."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.core.settings import Settings
from pipeline.model import load as model_lib
from pipeline.model.sampling import samplers, schedules
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


def _checkpoint(tmp_path, config):
    (tmp_path / "scheduler").mkdir(exist_ok=True)
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("choice", ["ddim", "pndm", "euler", "dpmpp", "euler_a", "lcm"])
@pytest.mark.parametrize("config", [SD15_PNDM, SDXL_EULER])
def test_released_configs_are_honoured_by_every_sampler_keeping_their_noise_schedule(tmp_path, config, choice):
    sampler = samplers.resolve_sampler(_checkpoint(tmp_path, config), choice, num_steps=4)
    assert (sampler.choice, sampler.engine) == (choice, "steps")
    resolved = schedules.resolved_config(sampler.config, choice)
    assert (resolved["beta_schedule"], resolved["beta_start"], resolved["beta_end"]) == ("scaled_linear", 0.00085,
                                                                                        0.012)
    assert resolved["num_train_timesteps"] == 1000 and resolved["prediction_type"] == "epsilon"
    if choice == "dpmpp":  # --scheduler dpmpp: DPM-Solver++ of order 2
        assert (resolved["algorithm_type"], resolved["solver_order"]) == ("dpmsolver++", 2)


@pytest.mark.parametrize("config, choice, spacing, steps_offset, final_sigmas", [
    # a config without a spacing key means the PyTorch class's default
    (SD15_PNDM, "ddim", "leading", 1, None),
    (SD15_PNDM, "euler", "linspace", 1, "zero"),
    (SD15_PNDM, "dpmpp", "linspace", 1, "zero"),
    # written by a Flax class: Flax semantics (no spacing key: leading; leading Euler adds 1;
    # DPM-Solver's last step to timestep 0)
    ({"_class_name": "FlaxDDIMScheduler", "steps_offset": 1}, "ddim", "leading", 1, None),
    ({"_class_name": "FlaxPNDMScheduler"}, "pndm", "leading", 0, None),
    ({"_class_name": "FlaxEulerDiscreteScheduler", "timestep_spacing": "leading"}, "euler", "leading", 1, "zero"),
    ({"_class_name": "FlaxDPMSolverMultistepScheduler"}, "dpmpp", "linspace", 0, "sigma_min"),
])
def test_a_config_means_what_it_meant_to_the_class_that_wrote_it(tmp_path, config, choice, spacing, steps_offset,
                                                                  final_sigmas):
    resolved = schedules.resolved_config(samplers.resolve_sampler(_checkpoint(tmp_path, config), choice).config,
                                     choice)
    assert (resolved["timestep_spacing"], resolved["steps_offset"]) == (spacing, steps_offset)
    assert resolved.get("final_sigmas_type") == final_sigmas


@pytest.mark.parametrize("config, choice", [
    (TURBO_EULER_A, None),  # the checkpoint's own: Euler ancestral
    (dict(SD15_PNDM, _class_name="LCMScheduler"), None),
    (dict(SDXL_EULER, timestep_spacing="trailing", use_karras_sigmas=True), "euler"),
    (dict(SD15_PNDM, timestep_spacing="trailing"), "pndm"),
    (dict(SDXL_EULER, final_sigmas_type="sigma_min", solver_type="heun"), "dpmpp"),
])
def test_what_the_steps_do_is_run_as_asked(tmp_path, config, choice):
    sampler = samplers.resolve_sampler(_checkpoint(tmp_path, config), choice)
    assert sampler.engine == "steps"
    assert sampler.choice == (choice or {"EulerAncestralDiscreteScheduler": "euler_a",
                                         "LCMScheduler": "lcm"}[config["_class_name"]])
    for key, value in config.items():
        if not key.startswith("_") and key in schedules.DEFAULTS[sampler.choice]:
            assert sampler.config[key] == value, key


@pytest.mark.parametrize("config, choice, spacing, refused", [
    (dict(SD15_PNDM, prediction_type="sample"), "pndm", None, r"prediction_type='sample'"),
    (dict(SD15_PNDM, rescale_betas_zero_snr=True), "dpmpp", None, r"rescale_betas_zero_snr=True"),
    (SD15_PNDM, "dpmpp", "bogus", r"--timestep-spacing must be one of"),
    (dict(SDXL_EULER, thresholding=True), "ddim", None, r"thresholding=True"),
    (dict(SDXL_EULER, use_beta_sigmas=True), "euler", None, r"use_beta_sigmas=True"),
    (dict(SD15_PNDM, use_karras_sigmas=True), "dpmpp", None, r"use_karras_sigmas=True"),
    (dict(SDXL_EULER, prediction_type="sample"), "euler_a", None, r"prediction_type='sample'"),
])
def test_what_the_steps_do_not_do_is_refused_naming_the_key(tmp_path, config, choice, spacing, refused):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    with pytest.raises(model_lib.ModelError, match=refused):
        samplers.resolve_sampler(str(tmp_path), choice, spacing)


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


def test_the_plan_honours_the_checkpoints_spacing_or_refuses_it(trailing_checkpoint, tmp_path):
    settings = Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "out"), model=trailing_checkpoint)
    for choice in (None, "euler", "euler_a", "lcm", "dpmpp", "pndm"):  # the checkpoint's own (ddim), and more
        resolved, run = prepare.resolve_settings(settings.replace(scheduler=choice))
        assert resolved.scheduler == run.settings.scheduler == (choice or "ddim")
    path = f"{trailing_checkpoint}/scheduler/scheduler_config.json"
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(config, thresholding=True), f)
    try:
        with pytest.raises(model_lib.ModelError, match=r"asks for thresholding=True"):
            prepare.resolve_settings(settings)
        with pytest.raises(model_lib.ModelError, match="thresholding=True"):
            model_lib.load(trailing_checkpoint, dtype="fp32")  # and a host loading it refuses too
    finally:
        with open(path, "w") as f:
            json.dump(config, f)
    model = model_lib.load(trailing_checkpoint, dtype="fp32")
    assert (model.sampler.engine, model.sampler.config["timestep_spacing"]) == ("steps", "trailing")


def test_a_step_count_the_sampler_cannot_run_is_refused_at_plan_time(trailing_checkpoint, tmp_path):
    settings = Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "out"), model=trailing_checkpoint,
                        scheduler="lcm", steps=51)
    with pytest.raises(model_lib.ModelError, match=r"at most original_inference_steps \(50\) steps, got 51"):
        prepare.resolve_settings(settings)
    assert prepare.resolve_settings(settings.replace(steps=4))[0].scheduler == "lcm"


def test_the_timestep_spacing_flag_overrides_the_checkpoints(model_cache, tmp_path):
    settings = Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "out"))  # tiny: DDIM, leading
    assert model_lib.load("tiny").sampler.config["timestep_spacing"] == "leading"
    trailing = model_lib.load("tiny", dtype="fp32", scheduler=None, timestep_spacing="trailing").sampler
    assert (trailing.engine, trailing.config["timestep_spacing"]) == ("steps", "trailing")
    resolved, run = prepare.resolve_settings(settings.replace(timestep_spacing="trailing"))
    assert resolved.timestep_spacing == "trailing"
    assert run.settings_fingerprint != prepare.resolve_settings(settings)[1].settings_fingerprint


def test_an_lcm_unet_with_a_guidance_embedding_is_refused(model_cache, tmp_path):
    target = tmp_path / "lcm-unet"
    shutil.copytree(model_lib.resolve("tiny"), target)
    path = target / "unet" / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), time_cond_proj_dim=256)))
    with pytest.raises(model_lib.ModelError, match="time_cond_proj_dim=256"):
        model_lib.describe(str(target))
