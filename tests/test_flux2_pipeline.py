"""FLUX.2 [klein] end to end against diffusers' ``Flux2KleinPipeline``: the tiny random
checkpoint of tests/fixtures/flux2_pipeline/ (make_flux2_pipeline_fixtures.sh) loads through
``load.load`` and gives diffusers' chat-formatted texts, prompt embeddings (within 1e-3) and
images (within 2 pixel levels) from the same initial latents, fp32."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model import families, load
from pipeline.model.families.flux2 import sampling

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "flux2_pipeline")
MODEL = os.path.join(HERE, "model")


@pytest.fixture(scope="module")
def expected():
    return np.load(os.path.join(HERE, "expected.npz"))


@pytest.fixture(scope="module")
def model(expected):
    import json
    meta = json.loads(str(expected["meta"]))
    return load.load(MODEL, max_sequence_length=meta["max_sequence_length"]), meta


def test_the_family_claims_klein_and_the_tiny_preset_is_registered():
    assert families.BY_NAME["flux2"] is families.BUILTINS["tiny-flux2-klein"]
    assert families.detect({"_class_name": "Flux2KleinPipeline"}, "x").name == "flux2"


def test_texts_embeddings_and_images_match_diffusers(model, expected):
    model, meta = model
    texts = [sampling.format_prompt(model.nets.tokenizer, p) for p in meta["prompts"]]
    assert texts == [str(t) for t in expected["texts"]]  # the checkpoint's template, thinking off
    assert all("<think>\n\n</think>" in t for t in texts)
    ids = model.family.tokenize(model, meta["prompts"])
    length = ids.shape[1] // 2
    embeds = sampling.stacked_states(model.nets, model.params["text_encoder"], jnp.asarray(ids[:, :length]),
                                     jnp.asarray(ids[:, length:]))
    embed_error = float(np.abs(np.asarray(embeds) - expected["prompt_embeds"]).max())
    assert embed_error < 1e-3, embed_error
    latents = expected["latents"]
    assert tuple(latents.shape[1:]) == model.latent_shape(meta["size"], meta["size"])
    denoise = model.family.make_denoise(model, meta["steps"])
    images = jax.jit(denoise)(model.params, ids, None, None, jnp.asarray(latents))
    pixel_error = float(np.abs(np.asarray(images) - expected["images"]).max() * 255)
    print(f"max embedding error {embed_error:.3g}, max image error {pixel_error:.3g} levels")
    assert pixel_error <= 2, pixel_error


def test_klein_mu_is_diffusers_empirical_mu():
    assert sampling.compute_empirical_mu(16, 2) == pytest.approx(1.89833333 + 8.73809524e-05 * 16
                                                                 + (0.00016927 * 16 + 0.45666666
                                                                    - 1.89833333 - 8.73809524e-05 * 16) / 190 * -8)


def test_the_built_in_klein_runs_plan_generate_collect_and_reproduces_an_image(tmp_path, model_cache):
    """``--model tiny-flux2-klein`` through the real job: two local hosts, a record with two
    images, then ``reproduce`` of one key gives the bytes of the dataset's image."""
    import json

    from pipeline.core import naming
    from pipeline.io import storage
    from pipeline.output import writer
    from tests.conftest import run_cli

    (tmp_path / "p.jsonl").write_text('{"prompt": "a red fox"}\n{"prompt": "a blue whale", "num_images": 2}\n'
                                      '{"prompt": "a green frog"}\n')
    out = str(tmp_path / "out")
    result = run_cli(["run", "--prompts", str(tmp_path / "p.jsonl"), "--out", out, "--model", "tiny-flux2-klein",
                      "--width", "32", "--height", "32", "--hosts", "2", "--devices-per-host", "1", "--steps", "2",
                      "--per-device-batch", "1", "--batches-per-slice", "1", "--no-progress"], model_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == {"images": 4, "records": 3, "rejects": 0, "verified": True}
    rows = writer.read_parquet_rows(naming.dataset_file(out, "metadata.parquet"))
    assert {(row["model"], row["width"], row["height"]) for row in rows} == {("tiny-flux2-klein", 32, 32)}
    assert len({row["sha256"] for row in rows}) == 4
    row = rows[1]
    again = run_cli(["reproduce", row["key"], "--out", out, "--save", str(tmp_path / "again")], model_cache)
    assert again.returncode == 0, again.stderr[-3000:]  # it checks the sha256 itself
    [saved] = os.listdir(tmp_path / "again")
    assert (tmp_path / "again" / saved).read_bytes() == storage.read_bytes(naming.join(out, row["path"]))


def test_a_tokenizer_without_a_chat_template_is_refused_naming_it(model):
    import copy

    model, _ = model
    bare = copy.copy(model.nets.tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="tokenizer has no chat_template"):
        sampling.format_prompt(bare, "a fox")
