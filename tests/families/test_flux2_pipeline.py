"""FLUX.2 [klein] end to end against diffusers' ``Flux2KleinPipeline``: the tiny random
checkpoints of tests/fixtures/flux2_pipeline/ (make_flux2_pipeline_fixtures.sh), distilled
and base, load through ``load.load`` and give diffusers' chat-formatted texts, prompt
embeddings (within 1e-3) and images (within 2 pixel levels) from the same initial latents,
fp32: square and not, 1 to 4 steps, the base model with classifier-free guidance (the
empty negative prompt, and one given), and at guidance 1 (no guidance: selected). Its
schedule (1e-5) and VAE decode (1e-4) are checked on their own."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model import families, load
from pipeline.model.families.flux2 import sampling
from tests.conftest import TESTS

HERE = os.path.join(TESTS, "fixtures", "flux2_pipeline")


@pytest.fixture(scope="module")
def expected():
    return np.load(os.path.join(HERE, "expected.npz"))


@pytest.fixture(scope="module")
def meta(expected):
    return json.loads(str(expected["meta"]))


@pytest.fixture(scope="module")
def models(meta):
    return {folder: load.load(os.path.join(HERE, folder), max_sequence_length=meta["max_sequence_length"])
            for folder in ("model", "model-base")}


def test_the_family_claims_klein_and_the_tiny_presets_are_registered():
    assert families.BY_NAME["flux2"] is families.BUILTINS["tiny-klein"] is families.BUILTINS["tiny-klein-base"]
    assert families.detect({"_class_name": "Flux2KleinPipeline"}, "x").name == "flux2"
    assert set(families.shapes_only_builtins()) >= {"random-klein-4b", "random-klein-9b"}


def test_flux2_dev_is_refused_naming_its_class():
    with pytest.raises(families.FamilyError, match=r"'Flux2Pipeline'.*FLUX.2 \[dev\].*Mistral.*Flux2KleinPipeline"):
        families.detect({"_class_name": "Flux2Pipeline"}, "x")


def test_the_base_checkpoint_guides_and_the_distilled_one_does_not(models):
    distilled, base = models["model"], models["model-base"]
    assert distilled.nets.distilled and not base.nets.distilled
    assert (distilled.family.guidance_rule(distilled), base.family.guidance_rule(base)) == ("unused", "diffusers")
    assert (distilled.default_steps, base.default_steps) == (4, 50)
    with pytest.raises(ValueError, match="never the guided one"):
        distilled.family.make_denoise(distilled, 2, guidance_rule="unused", guided=True)


@pytest.mark.parametrize("case", ["distilled_square", "distilled_wide", "base_cfg_square", "base_cfg_wide_negative",
                                  "base_unguided"])
def test_texts_embeddings_and_images_match_diffusers(case, models, meta, expected):
    name, folder, width, height, steps, guidance, negative = next(c for c in meta["cases"] if c[0] == case)
    model = models[folder]
    texts = [sampling.format_prompt(model.nets.tokenizer, p) for p in meta["prompts"]]
    assert texts == [str(t) for t in expected["texts"]]  # the checkpoint's template, thinking off
    assert all("<think>\n\n</think>" in t for t in texts)
    ids = model.family.tokenize(model, meta["prompts"])
    length = ids.shape[1] // 2
    embeds = sampling.stacked_states(model.nets, model.params["text_encoder"], jnp.asarray(ids[:, :length]),
                                     jnp.asarray(ids[:, length:]))
    embed_error = float(np.abs(np.asarray(embeds) - expected[f"{case}_prompt_embeds"]).max())
    assert embed_error < 1e-3, embed_error
    latents = expected[f"{case}_latents"]
    assert tuple(latents.shape[1:]) == model.latent_shape(width, height)
    guided = not model.nets.distilled  # a base model's program is the guided one, whatever each image asks
    denoise = model.family.make_denoise(model, steps, guided=guided,
                                        guidance_rule=model.family.guidance_rule(model))
    negative_ids = model.family.tokenize(model, [negative or ""] * len(meta["prompts"]))
    scales = jnp.full((len(meta["prompts"]),), guidance, jnp.float32)
    images = jax.jit(denoise)(model.params, ids, negative_ids, scales, jnp.asarray(latents))
    assert images.shape == (len(meta["prompts"]), height, width, 3)
    pixel_error = float(np.abs(np.asarray(images) - expected[f"{case}_images"]).max() * 255)
    print(f"{case}: max embedding error {embed_error:.3g}, max image error {pixel_error:.3g} levels")
    assert pixel_error <= 2, pixel_error


def test_guidance_changes_a_base_image_and_a_negative_prompt_is_used(models, expected):
    """The fixtures could not pass by ignoring guidance: the base images at 4 and at 1, and
    with and without a negative prompt, differ by more than the tolerance."""
    model = models["model-base"]
    ids = model.family.tokenize(model, ["a red fox in snow"])
    latents = jnp.asarray(expected["base_cfg_square_latents"][:1])
    denoise = jax.jit(model.family.make_denoise(model, 2, guided=True, guidance_rule="diffusers"))
    empty, other = model.family.tokenize(model, [""]), model.family.tokenize(model, ["blurry, dark"])
    at = {(g, n): np.asarray(denoise(model.params, ids, neg, jnp.asarray([g], jnp.float32), latents))
          for g in (1.0, 8.0) for n, neg in (("empty", empty), ("other", other))}
    assert np.abs(at[8.0, "empty"] - at[1.0, "empty"]).max() * 255 > 2
    assert np.abs(at[8.0, "empty"] - at[8.0, "other"]).max() * 255 > 2
    np.testing.assert_array_equal(at[1.0, "empty"], at[1.0, "other"])  # at 1: the positive prediction, selected


@pytest.mark.parametrize("tokens,steps", [(16, 1), (64, 4), (1024, 28), (4096, 50), (4300, 4), (4301, 4),
                                          (4608, 4), (16384, 50)])
def test_the_schedule_is_diffusers_with_the_empirical_mu(tokens, steps, models, expected):
    schedule = sampling.make_schedule(models["model"].nets.scheduler_config, steps, tokens)
    np.testing.assert_allclose(schedule.sigmas, expected[f"schedule_{tokens}_{steps}_sigmas"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(schedule.timesteps) / 1000,
                               expected[f"schedule_{tokens}_{steps}_timesteps"] / 1000, atol=1e-5, rtol=0)


def test_the_vae_decode_is_autoencoder_kl_flux2s(models, expected):
    from pipeline.model.layers import vae

    model = models["model"]
    images = vae.vae_decode(model.nets.vae, model.params["vae"], jnp.asarray(expected["vae_latents"]),
                            model.nets.vae.config)
    reference = np.clip(expected["vae_decoded"].transpose(0, 2, 3, 1) / 2 + 0.5, 0, 1)
    error = float(np.abs(np.asarray(images) - reference).max())
    assert error < 1e-4, error


def test_klein_mu_is_diffusers_empirical_mu():
    assert sampling.compute_empirical_mu(16, 2) == pytest.approx(1.89833333 + 8.73809524e-05 * 16
                                                                 + (0.00016927 * 16 + 0.45666666
                                                                    - 1.89833333 - 8.73809524e-05 * 16) / 190 * -8)


ROWS = [{"prompt": "a red fox", "id": "fox", "seed": 3},
        {"prompt": "a blue whale", "id": "whale", "seed": 3, "num_images": 2},  # one seed, another prompt
        {"prompt": "a green frog", "id": "frog", "guidance_scale": 1.0},  # unguided: selected
        {"prompt": "a full moon", "id": "moon", "negative_prompt": "blurry, dark", "guidance_scale": 2.5},
        {"prompt": "a painting of a city at night, " * 3, "id": "city"}]  # > 48 tokens with the template


@pytest.fixture(scope="module")
def klein_runs(tmp_path_factory, model_cache):
    """{hosts x devices: OUT} of one ``tiny-klein-base`` run (classifier-free guidance, the
    guided program, 48 Qwen3 tokens) on 2x2 and on 1x4 hosts x devices."""
    from tests.conftest import check_host_imports, run_cli

    folder = tmp_path_factory.mktemp("klein")
    prompts = folder / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    outs = {}
    for hosts, devices in ((2, 2), (1, 4)):
        out = str(folder / f"klein-{hosts}x{devices}")
        result = run_cli(["run", "--prompts", str(prompts), "--out", out, "--model", "tiny-klein-base", "--width",
                          "32", "--height", "16", "--hosts", str(hosts), "--devices-per-host", str(devices),
                          "--steps", "2", "--max-sequence-length", "48", "--per-device-batch", "1",
                          "--batches-per-slice", "1", "--no-progress"], model_cache)
        assert result.returncode == 0, result.stderr[-4000:]
        assert json.loads(result.stdout) == {"images": 6, "records": 5, "rejects": 0, "verified": True}
        check_host_imports(result)
        outs[f"{hosts}x{devices}"] = out
    return outs


def _rows(out):
    from pipeline.collect import parts

    return {r["key"]: r for r in parts.dataset_rows(out)}


def test_a_guided_klein_base_run_is_the_same_on_1x4_and_2x2(klein_runs):
    from pipeline.core import naming
    from pipeline.io import storage

    hashes = [{key: row["sha256"] for key, row in _rows(out).items()} for out in klein_runs.values()]
    assert len(hashes[0]) == 6 and hashes[0] == hashes[1]
    rows = _rows(klein_runs["2x2"])
    assert len({row["sha256"] for row in rows.values()}) == 6  # one seed, two prompts: two images
    assert {(r["model"], r["width"], r["height"], r["steps"]) for r in rows.values()} == {("tiny-klein-base", 32, 16,
                                                                                           2)}
    assert [rows[k]["guidance_scale"] for k in ("fox_0000", "frog_0000", "moon_0000")] == [4.0, 1.0, 2.5]
    assert rows["city_0000"]["prompt_truncated"] and not rows["fox_0000"]["prompt_truncated"]
    settings = storage.read_json(naming.run_json(klein_runs["2x2"]))["settings"]
    assert (settings["guidance_rule"], settings["guided"], settings["scheduler"]) == ("diffusers", True, "flow_euler")
    stats = storage.read_json(naming.dataset_file(klein_runs["2x2"], "stats.json"))
    assert stats["negative_prompts_unused"] == {"records": 0, "images": 0}
    assert stats["truncated_prompts"] == {"records": 1, "images": 1}


def test_reproduce_regenerates_klein_images_bit_exactly_on_another_topology(klein_runs, model_cache):
    from tests.conftest import run_cli

    out = klein_runs["1x4"]
    result = run_cli(["reproduce", "moon_0000", "frog_0000", "--out", out], model_cache)
    assert result.returncode == 0, result.stderr[-4000:]  # it checks the sha256 itself
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["match"] for line in lines] == [True, True]


def test_a_distilled_plan_records_its_default_steps_and_counts_a_guidance_it_will_not_use(tmp_path, model_cache):
    from tests.conftest import run_cli

    (tmp_path / "p.jsonl").write_text('{"prompt": "a fox", "guidance_scale": 3.0}\n{"prompt": "a whale"}\n')
    out = str(tmp_path / "out")
    result = run_cli(["plan", "--prompts", str(tmp_path / "p.jsonl"), "--out", out, "--model", "tiny-klein",
                      "--width", "32", "--height", "32", "--guidance-scale", "2", "--devices-per-host", "1"],
                     model_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    from pipeline.core import naming
    from pipeline.io import storage

    run = storage.read_json(naming.run_json(out))
    settings = run["settings"]
    assert (settings["steps"], settings["guidance_rule"], settings["guided"]) == (4, "unused", False)
    assert "BFL's setting for a distilled [klein]" in result.stderr  # the default that departs from diffusers'
    assert "guidance_unused" in result.stderr and "never used" in result.stderr
    from pipeline.collect.verify import unused_guidance

    rows = [{"guidance_scale": settings["guidance_scale"] if r["guidance_scale"] is None else r["guidance_scale"],
             "image_index": r["image_index"]}
            for r in map(json.loads, storage.read_text(naming.plan_slice(out, 0)).splitlines())]
    assert [r["guidance_scale"] for r in rows] == [3.0, 2.0]  # each image's own, recorded
    assert unused_guidance(rows, settings["guidance_rule"]) == (2, 2)  # counted by collect


def test_a_tokenizer_without_a_chat_template_is_refused_naming_it(models):
    import dataclasses

    model = models["model"]
    bare = dataclasses.replace(model.nets.tokenizer, chat_template=None)
    with pytest.raises(ValueError, match="tokenizer has no chat_template"):
        sampling.format_prompt(bare, "a fox")


LORA = os.path.join(os.path.dirname(HERE), "flux2_lora")


def test_a_lora_on_the_klein_transformer_matches_diffusers_and_keeps_the_program(meta, models):
    """tests/fixtures/flux2_lora (make_flux2_lora_fixtures.sh): diffusers' images with the
    adapter at two scales; the adapter moves them far (by more than 60 levels), so matching
    them within 2 levels is the merge. The merged model's program is the plain one's: the
    same lowered text (only values change)."""
    reference = np.load(os.path.join(LORA, "expected.npz"))
    lora_meta = json.loads(str(reference["meta"]))
    path = os.path.join(LORA, "pytorch_lora_weights.safetensors")
    ids = models["model"].family.tokenize(models["model"], meta["prompts"])
    latents = jnp.asarray(np.load(os.path.join(HERE, "expected.npz"))["distilled_square_latents"])
    plain = models["model"]
    texts = set()
    for scale, expected_images in zip(lora_meta["scales"], reference["images"]):
        model = load.load(os.path.join(HERE, "model"), max_sequence_length=meta["max_sequence_length"],
                          loras=(f"{path}@{scale}",))
        denoise = jax.jit(model.family.make_denoise(model, lora_meta["steps"], guidance_rule="unused", guided=False))
        images = np.asarray(denoise(model.params, ids, None, None, latents))
        error = float(np.abs(images - expected_images).max() * 255)
        assert error <= 2, (scale, error)
        texts.add(denoise.lower(model.params, ids, None, None, latents).as_text())
    assert float(np.abs(reference["images"][0] - reference["plain"]).max() * 255) > 60
    plain_denoise = jax.jit(plain.family.make_denoise(plain, lora_meta["steps"], guidance_rule="unused", guided=False))
    texts.add(plain_denoise.lower(plain.params, ids, None, None, latents).as_text())
    assert len(texts) == 1


def test_the_flop_count_unrolls_qwen3_and_the_transformer(model_cache):
    """XLA counts a loop's body once: counted, every layer of the 28-layer Qwen3 (27 run)
    and both stacks are unrolled, so the text encoder's FLOPs are near 27 layers' worth
    (from the matmul and attention shapes), not one layer's; the guided base program counts twice the rows."""
    from pipeline.bench import flops

    model = load.load("tiny-klein", abstract=True)
    counted = flops.part_flops(model, 16, 16, 1, guided=False)
    q = model.nets.qwen3
    tokens, kv = model.nets.max_sequence_length, q.num_key_value_heads * q.head_dim
    per_layer = 2 * tokens * q.hidden_size * (2 * q.num_attention_heads * q.head_dim + 2 * kv
                                              + 3 * q.intermediate_size)
    per_layer += 2 * 2 * tokens * tokens * q.num_attention_heads * q.head_dim  # scores and their average
    assert 27 * per_layer < counted["text_encoder"] < 27 * per_layer * 1.6
    base = load.load("tiny-klein-base", abstract=True)
    guided = flops.part_flops(base, 16, 16, 1, guided=True)
    assert guided["denoiser_call"] == pytest.approx(2 * counted["denoiser_call"], rel=0.01)
    assert guided["text_encoder"] == pytest.approx(2 * counted["text_encoder"], rel=0.01)
    assert guided["vae_decode"] == counted["vae_decode"]  # the images alone are decoded


def test_an_image_does_not_depend_on_its_batch_neighbours_and_sizes_off_the_grid_are_refused(models, model_cache,
                                                                                            tmp_path):
    """The base model's guided program at batch 2: the first image beside a short prompt and
    beside a long one (other token counts under the padding) is the same, bit for bit.
    Widths and heights are multiples of 2f (16 for the real VAE), else refused at plan time; the 9B's card says non-commercial."""
    from pipeline.core.settings import Settings
    from pipeline.plan.layout import PlanError
    from pipeline.plan.prepare import resolve_settings

    model = models["model-base"]
    latents = jnp.asarray(np.random.default_rng(5).standard_normal((2, *model.latent_shape(16, 16))), jnp.float32)
    denoise = jax.jit(model.family.make_denoise(model, 2, guided=True, guidance_rule="diffusers"))
    negative, scales = model.family.tokenize(model, ["", "blurry"]), jnp.asarray([4.0, 1.0], jnp.float32)
    first = [np.asarray(denoise(model.params, model.family.tokenize(model, ["a fox", other]), negative, scales,
                                latents))[0] for other in ("owl", "a long painting of a city at night " * 4)]
    np.testing.assert_array_equal(first[0], first[1])
    with pytest.raises(PlanError, match=r"--width 1000: .* multiples of 16 .*2x2"):
        resolve_settings(Settings(model="random-klein-4b", out=str(tmp_path), width=1000, height=1024))
    assert load.describe("random-klein-9b").license == "flux-non-commercial-license"
    assert load.describe("random-klein-4b").license == "apache-2.0"
