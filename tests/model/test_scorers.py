"""The scorers (``pipeline.model.scorers``) and the scoring program (``pipeline.generate.scoring``):
parity with transformers' and diffusers' PyTorch models on fixtures made once by
tests/fixtures/make_scorer_fixtures.sh, CLIP's preprocessing against PIL, the settings and
filters that read the scores, and the errors a bad scorer model gets."""
from __future__ import annotations

import functools
import json
import os

import jax

import numpy as np
import pytest
from PIL import Image

from pipeline.core import filters
from pipeline.core.settings import Run, Settings, fingerprint, scorer_models
from pipeline.model.scorers import aesthetic, clip, models, preprocess, safety
from pipeline.model.scorers.clip import ScorerError
from tests.conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "scorers")
CLIP_DIR = os.path.join(FIXTURES, "clip")
CHECKPOINT = os.path.join(FIXTURES, "sd")  # a Stable Diffusion checkpoint's safety_checker/ and feature_extractor/
HEAD = os.path.join(FIXTURES, "aesthetic.safetensors")


@pytest.fixture(scope="module")
def reference():
    return np.load(os.path.join(FIXTURES, "reference.npz"))


def fixture_image(n: int) -> np.ndarray:
    with Image.open(os.path.join(FIXTURES, "images", f"{n:02d}.png")) as image:
        return np.asarray(image.convert("RGB"))


@pytest.fixture(scope="module")
def loaded(model_cache):
    return (clip.load(CLIP_DIR, CLIP_DIR), safety.load(safety.folder_of(CHECKPOINT), CHECKPOINT),
            aesthetic.load(HEAD, HEAD, 24))


@pytest.mark.parametrize("size, resample", [(((32, 32), (24, 24)), 3), (((32, 48), (30, 45)), 3),
                                            (((17, 90), (224, 800)), 3), (((512, 512), (224, 224)), 3),
                                            (((40, 40), (40, 40)), 3), (((33, 47), (20, 29)), 2),
                                            (((64, 48), (30, 21)), 1)])
def test_the_devices_resize_is_pils_byte_for_byte(size, resample):
    (h, w), (oh, ow) = size
    rng = np.random.default_rng(h * w + resample)
    images = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8)
    images[1] = np.linspace(0, 255, w)[None, :, None].astype(np.uint8)  # a ramp: every rounding shows
    ours = np.asarray(preprocess.resize_uint8(images, oh, ow, resample))
    for image, resized in zip(images, ours):
        assert np.array_equal(resized, np.asarray(Image.fromarray(image).resize((ow, oh), resample=resample)))


def test_clip_similarity_matches_transformers_pytorch_clip(loaded, reference):
    """CLIPProcessor's PIL preprocessing of the written images, and CLIPModel's cosine: our
    pixels equal its pixel_values, our ids its input_ids (a prompt past 77 tokens cut with
    its end token), and our similarity is within 0.01 of its (in fact within 1e-5)."""
    model, _, _ = loaded
    prompts = json.loads(str(reference["prompts"]))
    assert len(clip.tokenize(model, [prompts[4]])[0]) == 77 and model.tokenizer.counts([prompts[4]])[0] > 77
    image_embeds = jax.jit(functools.partial(clip.image_embeds, model))
    text_embeds = jax.jit(functools.partial(clip.text_embeds, model))
    for n, prompt in enumerate(prompts):
        pixels = preprocess.apply(model.preprocessing, fixture_image(n)[None])
        np.testing.assert_allclose(np.asarray(pixels[0]).transpose(2, 0, 1), reference[f"clip_pixels_{n}"], atol=1e-5)
        ids = clip.tokenize(model, [prompt])
        assert np.array_equal(ids[0], reference["input_ids"][n])
        embeds = image_embeds(model.params, pixels)
        np.testing.assert_allclose(np.asarray(embeds[0]), reference["image_embeds"][n], atol=1e-4)
        similarity = float(clip.similarity(embeds, text_embeds(model.params, ids))[0])
        assert abs(similarity - float(reference["clip_similarity"][n])) < 0.01
        assert abs(similarity - float(reference["clip_similarity"][n])) < 1e-5


def test_safety_checker_matches_diffusers_pytorch_checker(loaded, reference):
    """A checkpoint's safety_checker/ (PyTorch safetensors) with its feature_extractor/: the
    decisions of StableDiffusionSafetyChecker.forward, some flagged and some not (one image
    with the special-care adjustment), and its scores within 1e-3."""
    _, checker, _ = loaded
    assert checker.image_size == 28 and checker.preprocessing.shortest_edge == 28
    check = jax.jit(functools.partial(safety.check, checker))
    flags = []
    for n in range(len(reference["nsfw"])):
        pixels = preprocess.apply(checker.preprocessing, fixture_image(n)[None])
        np.testing.assert_allclose(np.asarray(pixels[0]).transpose(2, 0, 1), reference[f"safety_pixels_{n}"],
                                   atol=1e-5)
        score, flagged = check(checker.params, pixels)
        assert abs(float(score[0]) - float(reference["nsfw_score"][n])) < 1e-3
        flags.append(bool(flagged[0]))
    assert flags == list(reference["nsfw"]) and 0 < sum(flags) < len(flags)


def test_aesthetic_head_equals_the_reference_mlp(loaded, reference):
    _, _, head = loaded
    assert head.widths == (24, 32, 16, 8, 4, 1)
    outputs = np.asarray(aesthetic.apply(head.params, reference["aesthetic_inputs"]))
    np.testing.assert_allclose(outputs, reference["aesthetic_outputs"], atol=1e-5)


def as_sampled(images, devices):
    """``images`` [N, H, W, 3] on ``devices`` as the sampler leaves them: split over the
    host's mesh (``--fsdp 1``), each device its own rows."""
    import jax

    from pipeline.model import sharding

    return jax.device_put(images, sharding.batch_sharding(sharding.mesh(devices, 1), 4))


def test_the_scoring_program_on_the_devices_gives_the_reference_scores(loaded, reference):
    """The program the hosts run (``scoring.Scorer``), on two devices, with a padding
    row: the same scores as the PyTorch models give the fixture's two 32x32 images."""
    import jax

    from pipeline.generate import scoring

    model, checker, head = loaded
    scorers = models.Scorers(("clip", "aesthetic", "safety"), model, head, checker)
    devices = jax.local_devices()[:2]
    scorer = scoring.Scorer(scorers, 32, 32, 2, devices)
    images = np.stack([fixture_image(0), fixture_image(1), fixture_image(1), np.zeros((32, 32, 3), np.uint8)])
    prompts = json.loads(str(reference["prompts"]))[:2]
    on_devices = as_sampled(images, devices)
    generator = type("G", (), {"latents": False})()
    scores = scorer.fetch(scorer.dispatch(on_devices, generator, scorer.tokenize(prompts + [prompts[1], ""])))
    assert set(scores) == {"clip_similarity", "aesthetic", "nsfw", "nsfw_score"}
    np.testing.assert_allclose(scores["clip_similarity"][:2], reference["clip_similarity"][:2], atol=1e-5)
    np.testing.assert_allclose(scores["nsfw_score"][:2], reference["nsfw_score"][:2], atol=1e-5)
    assert list(scores["nsfw"][:2]) == list(reference["nsfw"][:2])
    # an image's scores do not depend on its place in the batch or its neighbours
    assert scores["clip_similarity"][1] == scores["clip_similarity"][2]
    assert scores["aesthetic"][1] == scores["aesthetic"][2]
    embeds = clip.image_embeds(model, model.params, preprocess.apply(model.preprocessing, images[:2]))
    np.testing.assert_allclose(scores["aesthetic"][:2], np.asarray(aesthetic.apply(head.params, embeds)), atol=1e-5)


def test_a_later_sizes_scorer_shares_the_first_sizes_models_and_params(loaded, model_cache):
    """A run of several sizes scores each size with a program of its own (its images' shape),
    on the scorer models the host loaded and replicated once (``ready_scorer(like=)``): the
    same scores as a scorer of that size with its own copy."""
    import types

    from pipeline.generate import scoring

    model, checker, head = loaded
    scorers = models.Scorers(("clip", "aesthetic", "safety"), model, head, checker)
    devices = jax.local_devices()[:2]
    first = scoring.Scorer(scorers, 32, 32, 1, devices)
    settings = Settings(model="tiny", width=24, height=32, per_device_batch=1, scores=("clip", "aesthetic", "safety"),
                        clip_model=CLIP_DIR, aesthetic_head=HEAD, safety_checker=CHECKPOINT).validate()
    later, parts = scoring.ready_scorer(types.SimpleNamespace(settings=settings), devices, like=first)
    assert later.params is first.params and later.scorers is first.scorers and "scorer_load" not in parts
    assert later.program is not first.program
    own = scoring.Scorer(scorers, 24, 32, 1, devices)
    images = np.stack([fixture_image(0)[:, 4:28], fixture_image(1)[:, :24]])
    generator = type("G", (), {"latents": False})()
    ids = own.tokenize(["a photo", "a drawing"])
    on_devices = as_sampled(images, devices)
    got, expected = (s.fetch(s.dispatch(on_devices, generator, ids)) for s in (later, own))
    assert {k: list(v) for k, v in got.items()} == {k: list(v) for k, v in expected.items()}
    with pytest.raises(ValueError, match="same devices"):
        scoring.ready_scorer(types.SimpleNamespace(settings=settings), devices[:1], like=first)


def _head_file(tmp_path, tensors: dict) -> str:
    from safetensors.numpy import save_file

    path = str(tmp_path / "head.safetensors")
    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, path)
    return path


def _linear(n_out, n_in, index):
    return {f"layers.{index}.weight": np.zeros((n_out, n_in)), f"layers.{index}.bias": np.zeros(n_out)}


@pytest.mark.parametrize("tensors, message", [
    ({**_linear(4, 24, 0), **_linear(1, 4, 2), "extra": np.zeros(2)}, "unexpected tensor 'extra'"),
    ({**_linear(4, 24, 0), **_linear(1, 5, 2)}, "layers.2 takes 5 inputs, but the layer before gives 4"),
    ({**_linear(4, 24, 0), **_linear(2, 4, 2)}, "its last layer gives 2 outputs, not 1"),
    ({**_linear(1, 16, 0)}, "it takes 16-wide embeddings, but the --clip-model's image embeddings are 24 wide"),
    ({"layers.0.weight": np.zeros((1, 24))}, "layers.0 has weight only"),
])
def test_a_head_that_is_not_the_predictor_is_refused_naming_the_problem(tmp_path, tensors, message):
    with pytest.raises(ScorerError, match=f"--aesthetic-head .*{message}"):
        aesthetic.load(_head_file(tmp_path, tensors), "h", 24)


def test_a_clip_folder_without_weights_or_tokenizer_is_refused(tmp_path):
    import shutil

    folder = tmp_path / "clip"
    shutil.copytree(CLIP_DIR, folder)
    os.remove(folder / "model.safetensors")
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ScorerError, match=r"--clip-model .*no flax_model.msgpack or model.safetensors.*pytorch_model"):
        clip.load(str(folder), str(folder))
    os.remove(folder / "vocab.json")
    with pytest.raises(ScorerError, match="no CLIP tokenizer"):
        clip.load(str(folder), str(folder))


def test_preprocessing_reads_every_form_of_a_processor_config():
    old = preprocess.from_config({"size": 224, "crop_size": 224, "do_center_crop": True, "resample": 3}, 224)
    assert (old.shortest_edge, old.crop, old.mean) == (224, (224, 224), preprocess.OPENAI_CLIP_MEAN)
    assert old.resized_size(512, 768) == (224, 336) and old.output_size(512, 768) == (224, 224)
    square = preprocess.from_config({"size": {"height": 30, "width": 30}, "do_center_crop": False}, 30)
    assert square.output_size(64, 48) == (30, 30)
    defaults = preprocess.from_config({}, 24)
    assert (defaults.shortest_edge, defaults.crop) == (24, (24, 24))
    with pytest.raises(ValueError, match="come out of its preprocessing at 30x30, but the model takes 24x24"):
        preprocess.check(square, 24, 64, 48, "m")
    with pytest.raises(ValueError, match="resampling filter nearest is not supported"):
        preprocess.check(preprocess.from_config({"resample": 0}, 24), 24, 32, 32, "m")
    crop = preprocess.from_config({"size": {"shortest_edge": 20}, "crop_size": 24}, 24)
    with pytest.raises(ValueError, match="centre crop 24x24 is larger than the resized"):
        preprocess.check(crop, 24, 32, 32, "m")


SCORED = dict(scores=("clip", "aesthetic", "safety"), clip_model="tiny-clip", aesthetic_head="tiny-aesthetic",
              safety_checker="tiny-safety-checker")


@pytest.mark.parametrize("changes, message", [
    (dict(scores=("clip",)), "--score clip needs --clip-model"),
    (dict(scores=("aesthetic",), clip_model="c"), "--score aesthetic needs --aesthetic-head.*docs/scores.md says"),
    (dict(scores=("safety", "clip")), "--score must list some of clip, aesthetic, safety"),
    (dict(scores=("nsfw",)), "--score takes a comma-separated subset of clip, aesthetic, safety"),
    (dict(clip_model="c"), r"--clip-model is read only by --score clip or aesthetic, which the run does not "
                           r"compute \(no --score\)"),
    (dict(scores=("clip",), clip_model="c", aesthetic_head="h"), "--aesthetic-head is read only by --score aesthetic"),
    (dict(safety_checker="s"), "--safety-checker is read only by --score safety"),
    (dict(scores=("safety",), min_aesthetic=5.0), "--min-aesthetic filters on the aesthetic score.*--score "
                                                  "aesthetic,safety"),
    (dict(scores=("safety",), min_clip_similarity=0.2), "--min-clip-similarity filters on the clip score"),
    (dict(scores=("clip",), clip_model="c", drop_nsfw=True), "--drop-nsfw .*add --score clip,safety"),
    (dict(scores=("clip",), clip_model="c", min_clip_similarity=1.5), r"in \[-1, 1\], got 1.5"),
    (dict(scores=("clip",), clip_model="c", min_clip_similarity=float("nan")), "must be a finite number"),
])
def test_score_settings_are_refused_naming_the_flag(changes, message):
    with pytest.raises(ValueError, match=message):
        Settings(**changes).validate()


def test_scores_and_their_models_are_in_the_fingerprint_and_old_runs_keep_theirs():
    plain = Settings()
    scored = Settings(**SCORED)
    models_a, models_b = {"clip": "a", "aesthetic": "b", "safety": "c"}, {"clip": "a", "aesthetic": "b", "safety": "d"}
    values = {fingerprint(plain, "m"), fingerprint(scored, "m", models_a), fingerprint(scored, "m", models_b),
              fingerprint(scored.replace(min_aesthetic=5.0), "m", models_a),
              fingerprint(scored.replace(drop_nsfw=True), "m", models_a)}
    assert len(values) == 5
    # where a model is does not matter, its bytes do
    assert fingerprint(scored.replace(clip_model="/elsewhere"), "m", models_a) == fingerprint(scored, "m", models_a)
    run = Run.create(scored, "m", "t", {}, scorers=models_a)
    assert Run.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    with pytest.raises(ValueError, match=r"records scorer models \[\], but its settings read"):
        Run.create(scored, "m", "t", {})


def test_filters_name_each_failed_rule_with_its_value():
    settings = Settings(**SCORED, min_clip_similarity=0.25, min_aesthetic=5.0, drop_nsfw=True)
    assert filters.active_rules(settings) == ("min_clip_similarity", "min_aesthetic", "drop_nsfw")
    kept = {"clip_similarity": 0.25, "aesthetic": 6.5, "nsfw": False, "nsfw_score": -0.02}
    assert filters.dropped_reason(settings, kept) is None  # a minimum keeps its own value
    reason = filters.dropped_reason(settings, {**kept, "clip_similarity": 0.1812, "nsfw": True, "nsfw_score": 0.013})
    assert reason == ("min_clip_similarity: clip_similarity 0.1812 < 0.25; "
                      "drop_nsfw: flagged by the safety checker (nsfw_score 0.013)")
    assert filters.rules_of(reason) == ["min_clip_similarity", "drop_nsfw"] and filters.rules_of(None) == []
    assert filters.dropped_reason(settings, {**kept, "aesthetic": float("nan")}).startswith("min_aesthetic")
    assert filters.dropped_reason(Settings(**SCORED), {"aesthetic": -9.0}) is None  # no filter, nothing dropped


@pytest.mark.parametrize("rule,column,threshold", [("min_clip_similarity", "clip_similarity", 0.0),
                                                    ("min_clip_similarity", "clip_similarity", -0.2),
                                                    ("min_aesthetic", "aesthetic", 0),
                                                    ("min_aesthetic", "aesthetic", -1.5)])
def test_a_filter_at_zero_or_below_is_applied(rule, column, threshold):
    """0.0 == False in Python: a threshold of 0 must not read as 'no filter' (scores below it
    are dropped, and the card says the rule), nor a negative one."""
    from pipeline.collect import card

    settings = Settings(**SCORED, **{rule: threshold})
    assert filters.active_rules(settings) == (rule,)
    assert filters.dropped_reason(settings, {column: threshold - 0.158}) == \
        f"{rule}: {column} {threshold - 0.158:.6g} < {threshold:g}"
    assert filters.dropped_reason(settings, {column: threshold}) is None
    assert f"| filters | `{column} >= {threshold:g}` |" in card.render(
        Run.create(settings, "m", "t", {}, scorers={name: "f" for name in scorer_models(settings)}), {})


def test_a_threshold_of_zero_is_a_threshold():
    assert filters.active_rules(Settings(**SCORED, min_clip_similarity=0.0)) == ("min_clip_similarity",)
    assert filters.active_rules(Settings(**SCORED)) == ()


def test_dropped_rows_are_accounted_for_and_a_dropped_image_on_disk_is_unexpected():
    from pipeline.collect import stats as dataset_stats, verify

    rows = [{"key": "a", "image_bytes": 3}, {"key": "b", "dropped": "min_aesthetic: aesthetic 1 < 5"},
            {"key": "c", "dropped": "x: y"}]
    listed = {"size": 3, "md5": None}
    verdicts = verify.verify_slice(["a", "b", "c"], rows, {"i/a.png": listed, "i/c.png": listed})
    assert (verdicts["ok"], verdicts["dropped"], verdicts["unexpected"]) == (["a"], ["b"], ["c"])
    summary = {"slice": 0, "slices": 1, "ok": 1, "records": 2, "dropped": 2, "flagged": 1,
               "dropped_by_rule": {"min_aesthetic": 2, "drop_nsfw": 1}, "scores": {"aesthetic": np.arange(5.0)}}
    stats = dataset_stats.dataset_stats({"input_rows": 2, "images": 3, "slices": 1},
                                        dataset_stats.Tally().add(summary), {}, 0.0, safety=True)
    assert stats["verified"] and stats["images"] == 1
    assert stats["dropped"] == {"images": 2, "by_rule": {"drop_nsfw": 1, "min_aesthetic": 2}}
    assert stats["image_conservation"] == {"planned_images": 3, "images": 1, "dropped": 2, "holds": True}
    assert stats["scores"]["aesthetic"]["quantiles"]["p50"] == 2.0 and stats["scores"]["nsfw"] == {"flagged": 1}


def test_a_safety_score_needs_a_checker_the_model_has_or_one_named(model_cache):
    settings = Settings(scores=("safety",), width=32, height=32)  # tiny has no safety_checker/
    with pytest.raises(ScorerError, match="the model 'tiny' has no safety_checker/ folder; give --safety-checker"):
        models.describe(settings, "m")
    named = settings.replace(safety_checker=CHECKPOINT)
    found = models.describe(named, "m")["fingerprints"]
    assert set(found) == {"safety"} and found == models.fingerprints(named)


def test_planning_checks_the_scorers_against_the_image_size(model_cache, tmp_path):
    import shutil

    folder = tmp_path / "clip"
    shutil.copytree(CLIP_DIR, folder)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**config, "do_center_crop": False}))
    settings = Settings(scores=("clip",), clip_model=str(folder), width=32, height=16)
    with pytest.raises(ScorerError, match="--clip-model .* 32x16 images come out of its preprocessing at 60x30, "
                                          "but the model takes 30x30"):
        models.describe(settings, "m")
    assert models.describe(settings.replace(clip_model=CLIP_DIR), "m")["fingerprints"]["clip"]


def test_the_gallery_orders_by_a_score_and_shows_a_dropped_row_without_a_picture():
    import heapq
    import io

    from pipeline.collect import gallery, transforms as collect
    from pipeline.output import formats

    thumb = formats.thumbnail(np.zeros((8, 8, 3), np.uint8))
    rows = [{"key": f"k{i}", "slice": 0, "position": i, "prompt": "p", "seed": 1, "path": f"images/00000/k{i}.png",
             "clip_similarity": value, "nsfw": i == 1, "nsfw_score": 0.01 if i == 1 else -0.2,
             "dropped": "min_clip_similarity: clip_similarity 0.05 < 0.1" if i == 2 else None,
             "thumb": None if i == 2 else thumb}
            for i, value in enumerate([0.1, 0.3, 0.05, 0.2, None])]
    assert [r["key"] for r in collect.gallery_rows(rows, "clip_similarity")] == ["k1", "k3", "k0", "k2", "k4"]
    top = heapq.nlargest(2, rows, key=gallery.score_key("clip_similarity"))  # a part's bounded top-k
    assert [r["key"] for r in top] == ["k1", "k3"]
    page = gallery.render_page(rows, 1, 1, 5, "t")
    assert page.count('class="dropped"') == 1 and page.count("<img ") == 4
    assert "dropped: min_clip_similarity: clip_similarity 0.05 &lt; 0.1" in page
    assert page.count("flagged by the safety checker") == 1 and "clip 0.300" in page
    gallery.check_order("aesthetic", ("clip", "aesthetic"))
    with pytest.raises(ValueError, match=r"--gallery-order nsfw_score: the run did not compute it \(it was planned "
                                         r"with --score clip\)"):
        gallery.check_order("nsfw_score", ("clip",))
    with pytest.raises(ValueError, match=r"\(it was planned without --score\)"):
        gallery.check_order("aesthetic", ())
    # a flagged image's thumbnail is blurred: the same size, far less detail
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    sharp, blurred = (np.asarray(Image.open(io.BytesIO(formats.thumbnail(noise, blur=b))), float) for b in (0, 1))
    assert sharp.shape == blurred.shape and blurred.std() < sharp.std() / 4
