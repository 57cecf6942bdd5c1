"""A checkpoint's scheduler config is honoured or refused at plan time, never ignored:
the Flax schedulers lack keys that diffusers' PyTorch ones act on (trailing spacing,
Karras sigmas, zero-SNR betas, ...), and ``from_config`` would drop them silently. Such
configs run on promptmill's own steps where those do what the config asks."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.core.settings import Settings
from pipeline.model import load as model_lib
from pipeline.model.sampling import scheduler as scheduler_lib
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
    assert scheduler_lib.unhonoured(SD15_PNDM, choice) == []


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
    assert [(key, value) for key, value, _ in scheduler_lib.unhonoured(config, choice)] == expected


@pytest.mark.parametrize("config, choice, engine", [
    (SD15_PNDM, "ddim", "flax"),
    (SD15_PNDM, "euler", "flax"),
    (dict(SD15_PNDM, timestep_spacing="trailing"), "ddim", "steps"),  # Flax DDIM has no spacing
    (dict(SDXL_EULER, timestep_spacing="trailing"), "euler", "steps"),
    (dict(SDXL_EULER, steps_offset=0), "euler", "steps"),  # PyTorch's leading spacing without Flax's + 1
    (dict(SDXL_EULER, use_karras_sigmas=True), "euler", "steps"),
    (dict(SDXL_EULER, timestep_spacing="trailing"), "dpmpp", "flax"),
    (TURBO_EULER_A, None, "steps"),  # the checkpoint's own: Euler ancestral
    (dict(SD15_PNDM, _class_name="LCMScheduler"), None, "steps"),
])
def test_each_config_runs_on_the_engine_that_honours_it(tmp_path, config, choice, engine):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    sampler = scheduler_lib.resolve_sampler(str(tmp_path), choice)
    assert sampler.engine == engine
    assert sampler.choice == (choice or {"EulerAncestralDiscreteScheduler": "euler_a",
                                         "LCMScheduler": "lcm"}[config["_class_name"]])


@pytest.mark.parametrize("config, choice, spacing, refused", [
    (dict(SD15_PNDM, timestep_spacing="trailing"), "pndm", None, r"timestep_spacing='trailing' \(the pndm sampler "
                                                                  r"runs 'leading'\)"),
    (SD15_PNDM, "pndm", "linspace", r"with --timestep-spacing asks for timestep_spacing='linspace'"),
    (dict(SDXL_EULER, thresholding=True), "ddim", None, r"thresholding=True"),
    (dict(SDXL_EULER, use_beta_sigmas=True), "euler", None, r"use_beta_sigmas=True"),
    (dict(SD15_PNDM, algorithm_type="sde-dpmsolver++"), "dpmpp", None, r"algorithm_type='sde-dpmsolver\+\+'"),
    (dict(SDXL_EULER, prediction_type="sample"), "euler_a", None, r"prediction_type='sample'"),
])
def test_what_no_engine_does_is_refused_naming_the_key(tmp_path, config, choice, spacing, refused):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    with pytest.raises(model_lib.ModelError, match=refused):
        scheduler_lib.resolve_sampler(str(tmp_path), choice, spacing)


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
    for choice in (None, "euler", "euler_a", "lcm", "dpmpp"):  # the checkpoint's own (ddim), and more
        resolved, run = prepare.resolve_settings(settings.replace(scheduler=choice))
        assert resolved.scheduler == run.settings.scheduler == (choice or "ddim")
    with pytest.raises(model_lib.ModelError, match=r"asks for timestep_spacing='trailing' \(the pndm sampler "
                                                   r"runs 'leading'\)"):
        prepare.resolve_settings(settings.replace(scheduler="pndm"))
    with pytest.raises(model_lib.ModelError, match="timestep_spacing='trailing'"):
        model_lib.load(trailing_checkpoint, dtype="fp32", scheduler="pndm")  # and a host loading it refuses too
    model = model_lib.load(trailing_checkpoint, dtype="fp32")
    found = (model.sampler.engine, model.sampler.config["timestep_spacing"], model.nets.scheduler)
    assert found == ("steps", "trailing", None)


def test_a_step_count_the_sampler_cannot_run_is_refused_at_plan_time(trailing_checkpoint, tmp_path):
    settings = Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "out"), model=trailing_checkpoint,
                        scheduler="lcm", steps=51)
    with pytest.raises(model_lib.ModelError, match=r"at most original_inference_steps \(50\) steps, got 51"):
        prepare.resolve_settings(settings)
    assert prepare.resolve_settings(settings.replace(steps=4))[0].scheduler == "lcm"


def test_the_timestep_spacing_flag_overrides_the_checkpoints(model_cache, tmp_path):
    settings = Settings(prompts=str(tmp_path / "*.jsonl"), out=str(tmp_path / "out"))  # tiny: Flax DDIM, leading
    assert model_lib.load("tiny").sampler.engine == "flax"
    trailing = model_lib.load("tiny", dtype="fp32", scheduler=None, timestep_spacing="trailing").sampler
    assert (trailing.engine, trailing.config["timestep_spacing"]) == ("steps", "trailing")
    resolved, run = prepare.resolve_settings(settings.replace(timestep_spacing="trailing"))
    assert resolved.timestep_spacing == "trailing"
    assert run.settings_fingerprint != prepare.resolve_settings(settings)[1].settings_fingerprint
    with pytest.raises(model_lib.ModelError, match="with --timestep-spacing asks for timestep_spacing='trailing'"):
        prepare.resolve_settings(settings.replace(timestep_spacing="trailing", scheduler="pndm"))


def test_an_lcm_unet_with_a_guidance_embedding_is_refused(model_cache, tmp_path):
    target = tmp_path / "lcm-unet"
    shutil.copytree(model_lib.resolve("tiny"), target)
    path = target / "unet" / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), time_cond_proj_dim=256)))
    with pytest.raises(model_lib.ModelError, match="time_cond_proj_dim=256"):
        model_lib.describe(str(target))
