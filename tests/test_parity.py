"""Our sampler against diffusers' own FlaxStableDiffusionPipeline, same latents and settings."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.core import keys
from pipeline.generate import sampler
from pipeline.core.choices import SCHEDULERS
from pipeline.model import load as model_lib
from pipeline.model.sampling import scheduler as scheduler_lib

STEPS = 4
SIZE = 32


@pytest.fixture(scope="module")
def diffusers_pipeline(model_cache):
    from diffusers import FlaxStableDiffusionPipeline

    model_lib.quiet_libraries()
    return FlaxStableDiffusionPipeline.from_pretrained(model_lib.resolve("tiny"), safety_checker=None,
                                                       feature_extractor=None)


def ids(tokenizer, texts):
    return jnp.asarray(tokenizer(texts, padding="max_length", max_length=tokenizer.model_max_length,
                                 truncation=True, return_tensors="np").input_ids)


@pytest.fixture(scope="module")
def v_prediction_model(model_cache, tmp_path_factory):
    """The tiny model with a v-prediction noise schedule, as SD 2.x's 768 models have."""
    import json
    import shutil

    target = tmp_path_factory.mktemp("v") / "tiny-v"
    shutil.copytree(model_lib.resolve("tiny"), target)
    config_path = target / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config["prediction_type"] = "v_prediction"
    config_path.write_text(json.dumps(config))
    return str(target)


# Schedulers that both our sampler and FlaxStableDiffusionPipeline support. (The
# pipeline casts timesteps to int, which Euler's fractional timesteps do not survive.)
# one case per scheduler; v_prediction goes through the same scheduler code as epsilon
@pytest.mark.parametrize("choice,prediction", [("ddim", "epsilon"), ("pndm", "epsilon"), ("dpmpp", "v_prediction")])
def test_matches_diffusers_pipeline_fp32(diffusers_pipeline, v_prediction_model, choice, prediction):
    pipe, params = diffusers_pipeline
    ours = model_lib.load("tiny" if prediction == "epsilon" else v_prediction_model, dtype="fp32", scheduler=choice)
    assert ours.nets.scheduler.config.prediction_type == prediction
    scheduler, state = ours.nets.scheduler, ours.params["scheduler"]
    pipe.scheduler, params = scheduler, {**params, "scheduler": state}
    prompts, negatives = ["a red house by a lake", "a cat"], ["", "blurry, dark"]
    latents = jnp.stack([keys.initial_latents(keys.image_key(s, i), ours.latent_shape(SIZE, SIZE))
                         for s, i in ((3, 0), (2**40 + 1, 2))])
    guidance = 6.0
    # the pipeline's own generation function, jitted as its jit=True path does
    generate = jax.jit(pipe._generate, static_argnums=(3, 4, 5))
    theirs = np.asarray(generate(ids(pipe.tokenizer, prompts), params, None, STEPS, SIZE, SIZE, guidance,
                                 latents, ids(pipe.tokenizer, negatives)))
    denoise = jax.jit(sampler.make_denoise_fn(ours, STEPS))
    mine = np.asarray(denoise(ours.params, ids(ours.nets.tokenizer, prompts), ids(ours.nets.tokenizer, negatives),
                              jnp.full((2,), guidance, jnp.float32), latents))
    assert mine.shape == theirs.shape == (2, SIZE, SIZE, 3)
    assert np.abs(mine - theirs).max() < 1e-3


@pytest.fixture(scope="module")
def diffusers_xl_pipeline(model_cache):
    from diffusers import FlaxStableDiffusionXLPipeline

    model_lib.quiet_libraries()
    return FlaxStableDiffusionXLPipeline.from_pretrained(model_lib.resolve("tiny-sdxl"))


# (scheduler, negative prompts); empty negatives exercise SDXL's zero conditioning,
# which the pipeline applies when it is given no negative ids at all.
# SDXL's own paths (two text encoders, pooled embeddings, time ids, empty and real negatives);
# DDIM's steps are covered by the SD 1.x case above
@pytest.mark.parametrize("choice,negatives", [("euler", ["", ""]), ("pndm", ["blurry", "dark, grainy"]),
                                              ("dpmpp", ["blurry", "x"])])
def test_sdxl_matches_diffusers_pipeline_fp32(diffusers_xl_pipeline, choice, negatives):
    pipe, params = diffusers_xl_pipeline
    ours = model_lib.load("tiny-sdxl", dtype="fp32", scheduler=choice)
    assert ours.family.name == "sdxl"
    pipe.scheduler, params = ours.nets.scheduler, {**params, "scheduler": ours.params["scheduler"]}
    prompts = ["a red house by a lake", "a cat"]
    latents = jnp.stack([keys.initial_latents(keys.image_key(s, i), ours.latent_shape(SIZE, SIZE))
                         for s, i in ((5, 0), (2**41 + 3, 1))])
    guidance = 5.0
    prompt_ids = jnp.asarray(ours.family.tokenize(ours, prompts))
    negative_ids = jnp.asarray(ours.family.tokenize(ours, negatives))
    assert prompt_ids.shape == (2, 2, 77)
    np.testing.assert_array_equal(prompt_ids, pipe.prepare_inputs(prompts))  # same tokenisation as diffusers
    generate = jax.jit(pipe._generate, static_argnums=(3, 4, 5))
    theirs = np.asarray(generate(prompt_ids, params, None, STEPS, SIZE, SIZE, guidance, latents,
                                 None if not any(negatives) else negative_ids))
    denoise = jax.jit(sampler.make_denoise_fn(ours, STEPS, ours.family.tokenize(ours, [""])[0]))
    mine = np.asarray(denoise(ours.params, prompt_ids, negative_ids, jnp.full((2,), guidance, jnp.float32), latents))
    assert mine.shape == theirs.shape == (2, SIZE, SIZE, 3)
    assert np.abs(mine - theirs).max() < 1e-3


@pytest.mark.parametrize("choice", ["ddim", "pndm", "euler", "dpmpp"])
@pytest.mark.parametrize("name", ["tiny", "tiny-sdxl"])
def test_scheduler_choice_keeps_the_checkpoints_noise_schedule(model_cache, name, choice):
    scheduler, state = scheduler_lib.make_flax_scheduler(scheduler_lib.resolve_sampler(model_lib.resolve(name), choice))
    assert type(scheduler).__name__ == SCHEDULERS[choice][0]
    config = scheduler.config
    assert (config.beta_schedule, config.beta_start, config.beta_end) == ("scaled_linear", 0.00085, 0.012)
    assert config.num_train_timesteps == 1000 and config.prediction_type == "epsilon"
    if choice == "dpmpp":
        assert (config.algorithm_type, config.solver_order) == ("dpmsolver++", 2)


@pytest.mark.parametrize("choice", ["ddim", "pndm", "euler", "dpmpp"])
def test_flax_schedulers_are_built_as_diffusers_from_config_builds_them(choice):
    """``flax_from_config`` (no import of every compatible class) against diffusers' own
    ``from_config``: the same config, dropped keys kept alike, the same state, on a config
    with another class's keys, a key no class takes and values off the defaults."""
    import diffusers

    cls = getattr(diffusers, SCHEDULERS[choice][0])
    config = {"num_train_timesteps": 999, "beta_start": 0.001, "beta_end": 0.02, "beta_schedule": "linear",
              "prediction_type": "v_prediction", "steps_offset": 1, "skip_prk_steps": True, "set_alpha_to_one": False,
              "clip_sample": False, "timestep_spacing": "trailing", "solver_order": 3, "no_class_takes_this": 7,
              **SCHEDULERS[choice][1]}
    ours, theirs = scheduler_lib.flax_from_config(cls, config), cls.from_config(config)
    assert type(ours) is type(theirs) and dict(ours.config) == dict(theirs.config)
    assert ours.config["no_class_takes_this"] == 7 and ours.config.num_train_timesteps == 999
    for mine, reference in zip(jax.tree_util.tree_leaves(ours.create_state()),
                               jax.tree_util.tree_leaves(theirs.create_state()), strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(reference))
