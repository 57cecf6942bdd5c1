"""Our sampler against diffusers' own FlaxStableDiffusionPipeline, same latents and settings."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline import keys, model as model_lib, sampler

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


# Schedulers that both our sampler and FlaxStableDiffusionPipeline support. (The
# pipeline casts timesteps to int, which Euler's fractional timesteps do not survive.)
@pytest.mark.parametrize("choice", ["ddim", "pndm", "dpmpp"])
def test_matches_diffusers_pipeline_fp32(diffusers_pipeline, choice):
    pipe, params = diffusers_pipeline
    ours = model_lib.load("tiny", "fp32", choice)
    scheduler, state = ours.scheduler, ours.params["scheduler"]
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
    mine = np.asarray(denoise(ours.params, ids(ours.tokenizer, prompts), ids(ours.tokenizer, negatives),
                              jnp.full((2,), guidance, jnp.float32), latents))
    assert mine.shape == theirs.shape == (2, SIZE, SIZE, 3)
    assert np.abs(mine - theirs).max() < 1e-3
