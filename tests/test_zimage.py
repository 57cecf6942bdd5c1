"""Z-Image against diffusers' PyTorch ``ZImagePipeline`` and ``ZImageTransformer2DModel``:
the tiny random checkpoint of tests/fixtures/zimage/ (make_zimage_fixtures.sh) loads through
``load.load`` and gives the transformer's outputs (1e-4) for captions of several lengths in
one batch, the schedule (1e-5), the chat-formatted texts, prompt embeddings (1e-3) and
images (2 pixel levels) from the same initial latents: guidance-free and guided above 0,
1 to 4 steps, square and not, a prompt cut at 512 templated tokens beside a short one."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model import load
from pipeline.model.families.zimage import sampling, transformer as zimage
from pipeline.model.layers.patching import pack_latents

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "zimage")


@pytest.fixture(scope="module")
def expected():
    return np.load(os.path.join(HERE, "expected.npz"))


@pytest.fixture(scope="module")
def meta(expected):
    return json.loads(str(expected["meta"]))


@pytest.fixture(scope="module")
def model(meta):
    return load.load(os.path.join(HERE, "model"), max_sequence_length=meta["max_sequence_length"])


@pytest.mark.parametrize("case", ["short_captions", "whole_image"])
def test_the_transformer_matches_diffusers_for_captions_of_several_lengths(case, model, expected):
    latents = expected[f"transformer_{case}_latents"]
    rows = latents.shape[2] // 2
    out = model.nets.transformer.apply({"params": model.params["transformer"]},
                                       pack_latents(jnp.asarray(latents), "yxc"),
                                       jnp.asarray(expected[f"transformer_{case}_captions"]),
                                       jnp.asarray(expected[f"transformer_{case}_lengths"]),
                                       jnp.asarray(expected[f"transformer_{case}_t"]), image_rows=rows)
    reference = pack_latents(expected[f"transformer_{case}_out"], "yxc")
    error = float(np.abs(np.asarray(out) - reference).max())
    assert error < 1e-4, error


def test_the_family_claims_zimage_and_its_presets_are_registered():
    from pipeline.model import families

    assert families.detect({"_class_name": "ZImagePipeline"}, "x").name == "zimage"
    assert families.BUILTINS["tiny-zimage"] is families.BUILTINS["random-zimage"] is families.BY_NAME["zimage"]
    assert "random-zimage" in families.shapes_only_builtins()


@pytest.mark.parametrize("case", ["turbo_square", "cfg_wide", "cfg_tall_negative", "turbo_4"])
def test_texts_embeddings_and_images_match_diffusers(case, model, meta, expected):
    name, width, height, steps, guidance, negative = next(c for c in meta["cases"] if c[0] == case)
    texts = [sampling.format_prompt(model.nets.tokenizer, p) for p in meta["prompts"]]
    assert texts == [str(t) for t in expected["texts"]]  # the checkpoint's template, thinking on
    ids = model.family.tokenize(model, meta["prompts"])
    length = ids.shape[1] // 2
    states, lengths = sampling.caption_states(model.nets, model.params["text_encoder"], jnp.asarray(ids[:, :length]),
                                              jnp.asarray(ids[:, length:]))
    assert list(np.asarray(lengths)) == list(expected[f"{case}_embed_lengths"])  # 512: the long prompt was cut
    assert model.family.truncated(model, meta["prompts"]) == [False, True]
    reference = expected[f"{case}_prompt_embeds"]
    error = max(float(np.abs(np.asarray(states[i, :n]) - reference[i, :n]).max()) for i, n in enumerate(lengths))
    assert error < 1e-3, error
    latents = expected[f"{case}_latents"]
    assert tuple(latents.shape[1:]) == model.latent_shape(width, height)
    guided = guidance > 0
    denoise = model.family.make_denoise(model, steps, guided=guided, guidance_rule="zimage")
    negative_ids = model.family.tokenize(model, [negative or ""] * len(meta["prompts"]))
    scales = jnp.full((len(meta["prompts"]),), guidance, jnp.float32)
    images = jax.jit(denoise)(model.params, ids, negative_ids, scales, jnp.asarray(latents))
    assert images.shape == (len(meta["prompts"]), height, width, 3)
    pixel_error = float(np.abs(np.asarray(images) - expected[f"{case}_images"]).max() * 255)
    print(f"{case}: max embedding error {error:.3g}, max image error {pixel_error:.3g} levels")
    assert pixel_error <= 2, pixel_error


@pytest.mark.parametrize("steps", [1, 2, 4, 8, 9, 50])
def test_the_schedule_is_diffusers(steps, model, expected):
    schedule = sampling.make_schedule(model.nets.scheduler_config, steps, 16)
    np.testing.assert_allclose(schedule.sigmas, expected[f"schedule_{steps}_sigmas"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(schedule.timesteps) / 1000, expected[f"schedule_{steps}_timesteps"] / 1000,
                               atol=1e-5, rtol=0)
