"""--save-latents: the final latents (before VAE decoding) next to the zarr images."""
import json

import numpy as np
import pytest

from pipeline.core import naming
from pipeline.core.settings import Settings, fingerprint
from pipeline.generate import jax_events
from pipeline.generate.generator import Generator
from pipeline.io import storage
from pipeline.model import load as model_lib
from pipeline.output import formats
from pipeline.generate.spec import ProgramSpec
from tests import trees
from tests.conftest import run_cli
from tests.e2e.test_e2e import run_args, write_prompts


def assert_within_one_level(ours, theirs):
    diff = np.abs(ours.astype(int) - theirs.astype(int))
    assert diff.max() <= 1, diff.max()


@pytest.fixture(scope="module")
def model(model_cache):
    return model_lib.load("tiny")


@pytest.fixture(scope="module")
def decode_uint8(model):
    """What the sampler does after the denoising loop, from final latents [2, C, h, w]."""
    import jax

    from pipeline.generate import sampler

    decode = jax.jit(lambda p, z: sampler.to_uint8(sampler.decode_latents(model, p, z)))
    return lambda latents: np.asarray(decode(model.params["vae"], np.asarray(latents, np.float32)))


def test_generator_latents_decode_to_its_images_and_nothing_recompiles(model, decode_uint8):
    generator = Generator(model, ProgramSpec(32, 32, 2, 1, latents=True))
    generator(generator.padding_batch())  # warm-up
    before = jax_events.COMPILES.count()
    batch = generator.batch(["a cat", "a dog"], ["", "blurry"], [7.5, 3.0], [11, 2**40], [0, 5])
    images, latents = generator.generate(batch)
    assert jax_events.COMPILES.count() - before == 0
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    assert latents.shape == (2, *model.latent_shape(32, 32)) and latents.dtype == np.float32
    assert np.isfinite(latents).all() and not np.array_equal(latents[0], latents[1])
    assert_within_one_level(decode_uint8(latents), images)
    np.testing.assert_array_equal(generator(batch), images)  # __call__: the images alone


def test_save_latents_needs_zarr():
    with pytest.raises(ValueError, match="--save-latents needs --format zarr"):
        Settings(save_latents=True, formats=("files",)).validate()
    Settings(save_latents=True, formats=("files", "zarr")).validate()


def test_save_latents_is_part_of_the_fingerprint():
    loaded = Settings.from_dict(json.loads(json.dumps(Settings().to_dict())))
    assert loaded.save_latents is False
    assert fingerprint(loaded.replace(save_latents=True), "m") != fingerprint(loaded, "m")


def test_run_writes_latents_that_decode_to_the_zarr_images(tmp_path, model_cache, model, decode_uint8):
    prompts = write_prompts(tmp_path / "prompts", 5, bad_rows=False)  # 7 images: record 2 has three
    out = str(tmp_path / "out")
    result = run_cli(run_args(prompts, out, 1, 2, "--format", "zarr", "--save-latents"), model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    run = storage.read_json(naming.run_json(out))
    assert run["settings"]["save_latents"] is True
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    assert stats["verified"] and stats["images"] == 7 and stats["compiles_after_warmup"] == 0

    images = formats.read_zarr_images(out).read().result()
    store = formats.read_zarr_latents(out)
    latents = store.read().result()
    shape = model.latent_shape(32, 32)
    assert latents.shape == (7, *shape) and latents.dtype == np.float32
    assert np.isfinite(latents).all()
    assert all(np.abs(latents[p]).max() > 0 for p in range(7))  # every position was written
    attributes = json.loads(storage.read_text(naming.join(naming.zarr_latents(out), "zarr.json")))["attributes"]
    assert attributes["vae_scaling_factor"] == model.nets.vae.config.scaling_factor
    # --overwrite's list of what promptmill writes holds every object of the run, zarr and latents included
    assert [name for name in trees.checksums(out) if not naming.owned(name)] == []
    assert "before the division" in attributes["latents"]
    assert_within_one_level(decode_uint8(latents[2:4]), images[2:4])  # one compiled decoder: batches of 2


def test_cli_refuses_save_latents_without_zarr(tmp_path, model_cache):
    prompts = write_prompts(tmp_path / "prompts", 5, bad_rows=False)
    result = run_cli(["plan", "--prompts", prompts, "--out", str(tmp_path / "o"), "--save-latents"], model_cache)
    assert result.returncode == 1 and "--save-latents needs --format zarr" in result.stderr
