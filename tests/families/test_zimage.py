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
from tests.conftest import TESTS

HERE = os.path.join(TESTS, "fixtures", "zimage")


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


@pytest.mark.parametrize("case", ["turbo_square", "cfg_wide", "cfg_tall_negative"])
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


def test_an_image_does_not_depend_on_its_batch_neighbours_prompt_lengths(model):
    """One program, batch 2: the first image beside a short prompt and beside a long one
    (other caption lengths, so other padding and masks around it) is the same, bit for bit,
    guided and not; another prompt with the same latents gives another image."""
    latents = jnp.asarray(np.random.default_rng(3).standard_normal((2, *model.latent_shape(16, 16))), jnp.float32)
    latents = latents.at[1].set(latents[0])
    for guided, scale in ((False, 0.0), (True, 3.0)):
        denoise = jax.jit(model.family.make_denoise(model, 2, guided=guided, guidance_rule="zimage"))
        negative = model.family.tokenize(model, ["", "blurry"])
        scales = jnp.full((2,), scale, jnp.float32)
        beside_short = np.asarray(denoise(model.params, model.family.tokenize(model, ["a fox", "owl"]), negative,
                                          scales, latents))
        beside_long = np.asarray(denoise(model.params, model.family.tokenize(
            model, ["a fox", "a long painting of a city at night " * 9]), negative, scales, latents))
        np.testing.assert_array_equal(beside_short[0], beside_long[0])
        assert np.abs(beside_short[0] - beside_short[1]).max() > 0.01  # another prompt, the same latents


def test_sizes_beyond_the_rotary_tables_and_odd_configs_are_refused(model):
    config = model.nets.transformer.config
    with pytest.raises(ValueError, match="rotary table"):
        config.check_sizes(config.axes_lens[1] + 1, 4, 16)
    with pytest.raises(ValueError, match="position .* on the first axis"):
        config.check_sizes(4, 4, config.axes_lens[0])
    with pytest.raises(ValueError, match="siglip_feat_dim"):
        zimage.ZImageConfig.from_dict({"siglip_feat_dim": 1152})
    with pytest.raises(ValueError, match="all_patch_size"):
        zimage.ZImageConfig.from_dict({"all_patch_size": [2, 4], "all_f_patch_size": [1, 1]})
    with pytest.raises(ValueError, match="axes_dims"):
        zimage.ZImageConfig.from_dict({"dim": 64, "n_heads": 2, "axes_dims": [8, 8, 8]})


def _optimised_env():
    """The environment with XLA's backend optimisation at level 1 instead of the suite's 0
    (tests/conftest.py, for compile speed): at level 0 XLA:CPU's code for a host of two
    devices and a host of four round one image of this run a float apart (one pixel level
    of one image flips), at level 1 and at the default level (every real run's) they agree."""
    return dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
        "--xla_backend_optimization_level=0", "--xla_backend_optimization_level=1"))


ROWS = [{"prompt": "a red fox", "id": "fox", "seed": 3},
        {"prompt": "a blue whale in a deep ocean", "id": "whale", "seed": 3, "num_images": 2},
        {"prompt": "a green frog", "id": "frog", "guidance_scale": 0},  # guidance-free in a guided run
        {"prompt": "a full moon", "id": "moon", "negative_prompt": "blurry, dark", "guidance_scale": 1.0},
        {"prompt": "a painting of a city at night, " * 3, "id": "city"}]  # > 64 tokens with the template


@pytest.fixture(scope="module")
def zimage_runs(tmp_path_factory, model_cache):
    """{hosts x devices: OUT} of one ``tiny-zimage`` run (its defaults guide: the guided
    program; 64 Qwen3 tokens) on 2x2 and on 1x4 hosts x devices."""
    from tests.conftest import check_host_imports, run_cli

    folder = tmp_path_factory.mktemp("zimage")
    env = _optimised_env()
    prompts = folder / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    outs = {}
    for hosts, devices in ((2, 2), (1, 4)):
        out = str(folder / f"zimage-{hosts}x{devices}")
        result = run_cli(["run", "--prompts", str(prompts), "--out", out, "--model", "tiny-zimage", "--width", "32",
                          "--height", "16", "--hosts", str(hosts), "--devices-per-host", str(devices), "--steps", "2",
                          "--max-sequence-length", "64", "--per-device-batch", "1", "--batches-per-slice", "1",
                          "--no-progress"], model_cache, env=env)
        assert result.returncode == 0, result.stderr[-4000:]
        assert json.loads(result.stdout) == {"images": 6, "records": 5, "rejects": 0, "verified": True}
        assert "--steps 8 --guidance-scale 0" in result.stderr  # the guidance is a default: the Turbo recipe said
        check_host_imports(result)
        outs[f"{hosts}x{devices}"] = out
    return outs


def test_a_zimage_run_is_the_same_on_1x4_and_2x2_and_reproduces(zimage_runs, model_cache):
    from pipeline.core import naming
    from pipeline.io import storage
    from pipeline.collect import parts
    from tests.conftest import run_cli

    rows = [{r["key"]: r for r in parts.dataset_rows(out)}
            for out in zimage_runs.values()]
    assert {k: r["sha256"] for k, r in rows[0].items()} == {k: r["sha256"] for k, r in rows[1].items()}
    assert len({r["sha256"] for r in rows[0].values()}) == 6  # one seed, two prompts: two images
    assert [rows[0][k]["guidance_scale"] for k in ("fox_0000", "frog_0000", "moon_0000")] == [5.0, 0.0, 1.0]
    assert rows[0]["city_0000"]["prompt_truncated"] and not rows[0]["fox_0000"]["prompt_truncated"]
    settings = storage.read_json(naming.run_json(zimage_runs["2x2"]))["settings"]
    assert (settings["guidance_rule"], settings["guided"], settings["steps"]) == ("zimage", True, 2)
    stats = storage.read_json(naming.dataset_file(zimage_runs["2x2"], "stats.json"))
    assert stats["negative_prompts_unused"] == {"records": 0, "images": 0}  # moon's guidance 1 guides here
    card = storage.read_text(naming.dataset_card(zimage_runs["2x2"]))
    assert "Not SD's scale: g = 1 already guides" in card and "some record's guidance > 0" in card
    result = run_cli(["reproduce", "whale_0001", "city_0000", "--out", zimage_runs["1x4"]], model_cache,
                     env=_optimised_env())
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["match"] for line in lines] == [True, True]


def test_a_lora_on_the_zimage_transformer_matches_diffusers_and_keeps_the_program(meta, model):
    """tests/fixtures/zimage_lora (make_zimage_lora_fixtures.sh): diffusers' images with the
    adapter at two scales (it moves them by more than 60 levels); merged here they match
    within 2 levels, and the program is the plain model's (the same lowered text)."""
    folder = os.path.join(os.path.dirname(HERE), "zimage_lora")
    reference = np.load(os.path.join(folder, "expected.npz"))
    lora_meta = json.loads(str(reference["meta"]))
    path = os.path.join(folder, "pytorch_lora_weights.safetensors")
    ids = model.family.tokenize(model, meta["prompts"])
    latents = jnp.asarray(np.load(os.path.join(HERE, "expected.npz"))["turbo_square_latents"])
    texts = set()
    for scale, expected_images in zip(lora_meta["scales"], reference["images"]):
        merged = load.load(os.path.join(HERE, "model"), max_sequence_length=meta["max_sequence_length"],
                           loras=(f"{path}@{scale}",))
        denoise = jax.jit(merged.family.make_denoise(merged, lora_meta["steps"], guided=False))
        images = np.asarray(denoise(merged.params, ids, None, None, latents))
        error = float(np.abs(images - expected_images).max() * 255)
        assert error <= 2, (scale, error)
        texts.add(denoise.lower(merged.params, ids, None, None, latents).as_text())
    assert float(np.abs(reference["images"][0] - reference["plain"]).max() * 255) > 60
    plain = jax.jit(model.family.make_denoise(model, lora_meta["steps"], guided=False))
    texts.add(plain.lower(model.params, ids, None, None, latents).as_text())
    assert len(texts) == 1


def test_a_checkpoints_default_size_it_cannot_make_is_refused_when_planning(tmp_path, model_cache, capfd):
    """tiny-zimage's files as a user's checkpoint: Z-Image's default size (1024, as
    ZImagePipeline's) is beyond what its rotary tables hold, so planning refuses it, naming
    the default, where the hosts would otherwise fail after the plan; the built-in runs at
    its own small default."""
    from jobs import cli
    from pipeline.model import load

    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat"}\n')
    folder = load.resolve("tiny-zimage")
    out = tmp_path / "out"
    assert cli.main(["plan", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out), "--model", folder]) == 1
    err = capfd.readouterr().err
    assert "the default width (--width not given) 1024: zimage images are at most 256 pixels each way" in err
    assert not out.exists()
    assert load.describe("tiny-zimage").native_size == 32
