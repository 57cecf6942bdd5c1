"""FLUX.1 sampling end to end (``pipeline.model.families.flux.sampling``) against diffusers' PyTorch
``FluxPipeline``, on checkpoints it wrote.

``tests/fixtures/flux`` holds a tiny FLUX.1 [schnell]-like and [dev]-like checkpoint saved by
``FluxPipeline.save_pretrained``, and the images ``FluxPipeline.__call__`` made with them for
two prompts (one longer than both encoders take) from given initial latents: 1, 2 and 4
steps at 32x32, 2 steps at 24x40, schnell guidance-free, dev with embedded guidance 3.5 and 5
(``make_flux_fixtures.sh``; no torch here). Each checkpoint is loaded through
``read_nets``/``read_params`` (its bf16 or fp16 safetensors converted by rule, run in
float32), the prompts tokenised by ``tokenize`` and the whole sampler run as one jitted
program: images within 2 levels of the pipeline's (the largest difference is 1, a rounding),
final latents within 1e-3.

Compiles are shared: per variant, one program at 32x32 runs 1, 2 and 4 steps (``sample``,
its step count traced, the schedules padded); one ``make_denoise`` program (the host
schedule, as a run compiles it) runs dev's 24x40 case, whose dynamic shift depends on the
size. schnell's 24x40 case is checked network by network (test_flux_nets.py).
"""
from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model.sampling import flow
from pipeline.model.families.flux import sampling as fs
from pipeline.model.layers import patching
from pipeline.model.loading import tokenizer
from tests.conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "flux")
VARIANTS = ("schnell", "dev")
MAX_STEPS = 4


def case_id(path: str) -> str:
    return os.path.basename(path).removesuffix(".npz")


CASES = sorted(glob.glob(os.path.join(FIXTURES, "schnell-*-32x32.npz"))
               + glob.glob(os.path.join(FIXTURES, "dev-*.npz")))


@pytest.fixture(scope="module")
def checkpoints():
    """variant -> (nets, float32 params, clip tokenizer, t5 tokenizer, text fixture)."""
    out = {}
    for variant in VARIANTS:
        directory = os.path.join(FIXTURES, variant)
        nets = fs.read_nets(directory)
        params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), fs.read_params(directory, nets))
        out[variant] = (nets, params, tokenizer.clip(os.path.join(directory, "tokenizer")),
                        tokenizer.from_json(os.path.join(directory, "tokenizer_2"), fs.MAX_SEQUENCE_LENGTH),
                        dict(np.load(os.path.join(FIXTURES, f"{variant}.text.npz"))))
    return out


_PROGRAMS = {}


def sample_at_32(checkpoints, variant, prompts, max_length, latents, guidance, steps):
    """(images, final latents) at 32x32 through the variant's one ``sample`` program: its
    step count traced, the schedule padded to ``MAX_STEPS``."""
    nets, params, clip_tokenizer, t5_tokenizer, _ = checkpoints[variant]
    if (variant, "sample") not in _PROGRAMS:
        _PROGRAMS[variant, "sample"] = jax.jit(lambda p, c, t, x, g, sigmas, timesteps, n: fs.sample(
            nets, p, c, t, x, g, sigmas=sigmas, timesteps=timesteps, steps=n))
    clip_ids, t5_ids = fs.tokenize(clip_tokenizer, t5_tokenizer, prompts, max_length)
    schedule = flow.make_schedule(nets.scheduler_config, steps, 8 * 8)
    return _PROGRAMS[variant, "sample"](params, clip_ids, t5_ids, latents, guidance,
                                        np.pad(schedule.sigmas, (0, MAX_STEPS - steps)),
                                        np.pad(schedule.timesteps, (0, MAX_STEPS - steps)), steps)


def run(checkpoints, case):
    """(images, final latents) of a case: ``sample_at_32`` at the first size,
    ``make_denoise``'s program at the other."""
    variant = str(case["variant"])
    nets, params, clip_tokenizer, t5_tokenizer, _ = checkpoints[variant]
    steps, height, width = int(case["steps"]), int(case["height"]), int(case["width"])
    prompts, max_length = [str(p) for p in case["prompts"]], int(case["max_sequence_length"])
    guidance = np.full((len(prompts),), case["guidance_scale"], np.float32)
    if (height, width) == (32, 32):
        return sample_at_32(checkpoints, variant, prompts, max_length, case["latents"], guidance, steps)
    key = (variant, steps, height, width)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = jax.jit(fs.make_denoise(nets, steps, width, height, return_latents=True))
    clip_ids, t5_ids = fs.tokenize(clip_tokenizer, t5_tokenizer, prompts, max_length)
    return _PROGRAMS[key](params, clip_ids, t5_ids, case["latents"], guidance)


def test_the_fixtures_are_all_there():
    names = [case_id(path) for path in CASES] + ["schnell-g0-s2-24x40"]
    assert len(names) == 9 and all(os.path.isfile(os.path.join(FIXTURES, f"{n}.npz")) for n in names)
    assert {n.split("-")[0] for n in names} == set(VARIANTS)
    assert {n.split("-")[2] for n in names} == {"s1", "s2", "s4"}
    assert {n.split("-")[3] for n in names} == {"32x32", "24x40"}


@pytest.mark.parametrize("path", CASES, ids=case_id)
def test_images_match_diffusers_flux_pipeline(checkpoints, path):
    case = dict(np.load(path))
    images, latents = run(checkpoints, case)
    ours = np.asarray(jnp.round(images * 255)).astype(np.uint8)
    diff = np.abs(ours.astype(int) - case["images_uint8"].astype(int))
    assert diff.max() <= 2, f"{case_id(path)}: {diff.max()} levels (mean {diff.mean():.3f})"
    np.testing.assert_allclose(np.asarray(patching.pack_latents(latents)), case["step_latents"][-1], rtol=0, atol=1e-3)
    # the prompts' images differ (the pipeline's do, by far more than the tolerance)
    assert np.abs(ours[0].astype(int) - ours[1]).max() > 50


def test_guidance_is_per_image(checkpoints):
    """One batch, two embedded guidance scales: each image is the one the pipeline made with
    its own scale for the whole batch."""
    default, other = (dict(np.load(os.path.join(FIXTURES, f"dev-g{g}-s2-32x32.npz"))) for g in ("3.5", "5"))
    images, _ = sample_at_32(checkpoints, "dev", [str(p) for p in default["prompts"]],
                             int(default["max_sequence_length"]), default["latents"],
                             np.array([3.5, 5.0], np.float32), 2)
    ours = np.asarray(jnp.round(images * 255)).astype(int)
    assert np.abs(ours[0] - default["images_uint8"][0]).max() <= 2
    assert np.abs(ours[1] - other["images_uint8"][1]).max() <= 2
    assert np.abs(default["images_uint8"][1].astype(int) - other["images_uint8"][1]).max() > 10


def test_schnell_reads_no_guidance(checkpoints):
    """A guidance-free transformer ([schnell]) never reads the guidance: any value gives the
    same images."""
    case = dict(np.load(os.path.join(FIXTURES, "schnell-g0-s2-32x32.npz")))
    first, _ = run(checkpoints, case)
    second, _ = run(checkpoints, dict(case, guidance_scale=np.float32(7.5)))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


@pytest.mark.parametrize("variant", VARIANTS)
def test_tokenize_is_flux_pipelines(checkpoints, variant):
    """The ids FluxPipeline's encoders got: CLIP padded and cut at 77, T5 padded and cut at the
    run's max_sequence_length with its end token kept; the long prompt is cut by both."""
    _, _, clip_tokenizer, t5_tokenizer, text = checkpoints[variant]
    prompts = [str(p) for p in text["prompts"]]
    length = int(text["max_sequence_length"])
    clip_ids, t5_ids = fs.tokenize(clip_tokenizer, t5_tokenizer, prompts, length)
    assert clip_ids.dtype == t5_ids.dtype == np.int32
    np.testing.assert_array_equal(clip_ids, text["clip_ids"])
    np.testing.assert_array_equal(t5_ids, text["t5_ids"])
    assert t5_ids.shape == (2, length) and clip_ids.shape == (2, 77)
    eos = t5_tokenizer.backend.token_to_id(t5_tokenizer.special_tokens["eos_token"])
    assert t5_ids[1, -1] == eos and t5_ids[0, -1] == t5_tokenizer.pad_id
    assert fs.truncated(t5_tokenizer, prompts, length) == [False, True]
    assert fs.truncated(clip_tokenizer, prompts, 77) == [False, True]
    for bad in (0, 513, "16"):
        with pytest.raises(ValueError, match="max_sequence_length"):
            fs.tokenize(clip_tokenizer, t5_tokenizer, prompts, bad)


def test_make_denoise_refuses_sizes_and_latents_it_cannot_take(checkpoints):
    nets, params, *_ = checkpoints["schnell"]
    with pytest.raises(ValueError, match="multiples of 4"):
        fs.make_denoise(nets, 2, 32, 30)
    denoise = fs.make_denoise(nets, 2, 32, 32)
    with pytest.raises(ValueError, match=r"latents have shape \(1, 16, 8, 8\)"):
        denoise(params, np.zeros((1, 77), np.int32), np.zeros((1, 16), np.int32), np.zeros((1, 16, 8, 8), np.float32))
    with pytest.raises(ValueError, match=r"for 32x48 images"):  # width x height, as everywhere
        fs.make_denoise(nets, 2, 32, 48)(params, np.zeros((1, 77), np.int32), np.zeros((1, 16), np.int32),
                                        np.zeros((1, 16, 16, 24), np.float32))
