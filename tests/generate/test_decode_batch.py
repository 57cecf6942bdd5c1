"""The VAE decode in micro-batches (``--decode-batch``): the chunking rule alone, then tiny
generators (SD and FLUX.1, replicated and FSDP) against whole-batch decoding, and the setting
as a run records it (run.json's settings, the fingerprint, each metadata row, the program
a run's generator and reproduce compile, an old run's whole-batch program)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.core import decode_batch
from pipeline.core.settings import AUTO, Settings, fingerprint
from pipeline.generate import runtime
from pipeline.generate.generator import Generator, lower_sampler
from pipeline.model import load as model_lib, sharding
from pipeline.model.sampling import decoding
from pipeline.generate.spec import ProgramSpec

# ---- the chunking rule alone


def _rowwise(x):
    """A decode stand-in: each row's output depends on that row alone (and the shape changes)."""
    flat = x.reshape(x.shape[0], -1)
    return jnp.concatenate([flat * 2 + 1, flat.sum(axis=1, keepdims=True)], axis=1)


@pytest.mark.parametrize("batch,micro", [(1, 1), (3, 1), (3, 2), (4, 2), (5, 3), (6, 4), (4, 4), (4, 9), (4, None)])
def test_micro_batches_give_the_whole_decode_in_order(batch, micro):
    latents = jnp.arange(batch * 2 * 3, dtype=jnp.float32).reshape(batch, 2, 3) + 1
    got = decoding.decode_in_micro_batches(_rowwise, latents, micro)
    np.testing.assert_array_equal(got, _rowwise(latents))


def test_a_batch_no_multiple_of_the_micro_batch_is_padded_with_zeros_that_are_dropped():
    seen = []

    def decode(x):
        seen.append(x.shape)
        return x * 3

    latents = jnp.ones((5, 2), jnp.float32)
    out = jax.jit(lambda z: decoding.decode_in_micro_batches(decode, z, 2))(latents)
    assert seen == [(2, 2)] and out.shape == (5, 2)  # one chunk program of 2; 3 chunks, the last half padding
    np.testing.assert_array_equal(out, 3 * np.ones((5, 2)))
    text = jax.jit(lambda z: decoding.decode_in_micro_batches(decode, z, 2)).lower(latents).as_text()
    assert "while" in text and "pad" in text
    # at or above the batch, and without one: the function itself, the same program text
    whole = jax.jit(lambda z: decode(z)).lower(latents).as_text()
    for micro in (None, 5, 8):
        assert jax.jit(lambda z, m=micro: decoding.decode_in_micro_batches(decode, z, m)).lower(latents).as_text() \
            == whole
    with pytest.raises(ValueError, match="at least 1"):
        decoding.decode_in_micro_batches(decode, latents, 0)


def test_under_a_mesh_each_device_decodes_its_own_rows_a_micro_batch_at_a_time():
    mesh = sharding.mesh(jax.devices()[:2], 1)  # 2 devices, each with 3 rows
    latents = jax.device_put(jnp.arange(12, dtype=jnp.float32).reshape(6, 2), sharding.batch_sharding(mesh, 2))
    seen = []

    def decode(x):
        seen.append(x.shape)
        return _rowwise(x)

    out = jax.jit(lambda z: decoding.decode_in_micro_batches(decode, z, 2, mesh=mesh))(latents)
    assert seen == [(4, 2)]  # a chunk: 2 rows of each device
    np.testing.assert_array_equal(out, _rowwise(latents))
    assert out.sharding.is_equivalent_to(sharding.batch_sharding(mesh, 2), 2)


def test_auto_is_what_planning_resolves_it_to():
    assert decode_batch.planned(AUTO) == decode_batch.DECODE_BATCH == 1
    assert decode_batch.planned(None) is None and decode_batch.planned(3) == 3
    assert decoding.micro_batches(None) is decoding.whole


# ---- tiny generators: micro-batches against the whole batch


def _rows(n):
    return [(f"a photo {i}", "blurry" if i % 2 else "", 7.5, 1000 + 7 * i, i) for i in range(n)]


@pytest.fixture(scope="module")
def whole_tiny(model_cache):
    """tiny's whole-batch generator (2 devices x 3 images) and its images of ``_rows``."""
    model = model_lib.load("tiny")
    whole = Generator(model, ProgramSpec(32, 32, 2, 3))
    rows = _rows(whole.batch_size)
    return model, whole, rows, whole(whole.batch_of(rows)).astype(int)


@pytest.mark.parametrize("name,kind", [("tiny", {}), ("tiny-flux", dict(guided=False, guidance_rule="unused"))])
def test_decoding_in_micro_batches_moves_no_pixel_more_than_two_levels(name, kind, whole_tiny):
    if name == "tiny":
        model, whole, rows, expected = whole_tiny
    else:
        model = model_lib.load(name)
        whole = Generator(model, ProgramSpec(32, 32, 2, 3, **kind))  # 2 devices x 3 images
        rows = _rows(whole.batch_size)
        expected = whole(whole.batch_of(rows)).astype(int)
    # 2: a device's 3 images as 2 + 1 padded (a micro-batch of 1 is the e2e runs' and the sizes tests')
    gen = Generator(model, ProgramSpec(32, 32, 2, 3, decode_batch=2, **kind), params=whole.params)
    assert np.abs(gen(gen.batch_of(rows)).astype(int) - expected).max() <= 2
    assert gen.compiled.as_text() != whole.compiled.as_text()
    # a micro-batch of at least the batch is the whole-batch program, the one of runs planned before
    shapes = model_lib.load(name, abstract=True)
    texts = [lower_sampler(shapes, ProgramSpec(32, 32, 2, 3, decode_batch=micro, **kind), whole.devices).as_text()
             for micro in (None, 3)]
    assert texts[0] == texts[1]


def test_an_fsdp_generator_decodes_each_devices_images_in_micro_batches(whole_tiny):
    model, _, rows, expected = whole_tiny
    sharded = Generator(model, ProgramSpec(32, 32, 2, 3, fsdp=2, decode_batch=2))
    assert np.abs(sharded(sharded.batch_of(rows)).astype(int) - expected).max() <= 2


# ---- the setting as a run records it


def _planned(**changes):
    return Settings(model="tiny", width=32, height=32, steps=2, per_device_batch=3, guidance_scale=7.5,
                    guided=True, guidance_rule="diffusers", **changes).validate()


def test_the_run_records_its_decode_batch_and_an_old_run_keeps_its_fingerprint():
    new, old = _planned(decode_batch=1), _planned(decode_batch=None)
    assert new.to_dict()["decode_batch"] == 1 and Settings.from_dict(new.to_dict()) == new  # run.json
    assert fingerprint(new, "m") != fingerprint(old, "m") != fingerprint(_planned(decode_batch=2), "m")
    # the executable cache's description names it only for a micro-batched program
    assert "decode_batch" not in ProgramSpec.of(old).description()
    assert ProgramSpec.of(new).description()["decode_batch"] == 1
    assert runtime.program_tag(_run(new)) != runtime.program_tag(_run(old))


def _run(settings):
    from pipeline.core.settings import Run

    return Run.create(settings, "f" * 64, created_at="2025-01-01T00:00:00Z", versions={})


def test_each_metadata_row_says_how_its_image_was_decoded():
    from pipeline.core.records import Item
    from pipeline.output import writer

    item = Item(key="k_0000", id="k", image_index=0, prompt="p", negative_prompt="", seed=1, guidance_scale=None,
                slice=0, position=0, source="s.jsonl", line=1, extra={})
    rows = {micro: writer.metadata_row(item, _run(_planned(decode_batch=micro)), 0, b"x", "p")
            for micro in (1, 2, None)}
    assert [rows[m]["decode_batch"] for m in (1, 2, None)] == [1, 2, None]
    assert [name for name, kind in writer.METADATA_FIELDS if name == "decode_batch"] == ["decode_batch"]
    table = writer.parquet_bytes(list(rows.values()))  # int32, null for the whole batch
    assert table


def test_a_runs_generator_and_reproduce_use_its_decode_batch(monkeypatch):
    """``runtime.make_generator`` (what every host and ``reproduce``, through
    ``ready_generator``, build) makes the run's program: micro-batched for a new run, whole
    for one planned before the setting (the programs themselves are compared above)."""
    made = []
    monkeypatch.setattr(runtime, "Generator", lambda model, spec, *args, **kwargs: made.append(spec.decode_batch))
    for micro in (2, None):
        runtime.make_generator(object(), _planned(decode_batch=micro), jax.local_devices()[:1])
    assert made == [2, None]


def test_the_plan_resolves_auto_and_keeps_an_old_runs_whole_batch(tmp_path):
    from pipeline.io import runs
    from pipeline.plan import prepare

    out = str(tmp_path / "out")
    fresh = Settings(out=out)
    assert prepare.kept_decode_batch(fresh) == fresh  # no run yet: auto, resolved by resolve_settings
    runs.write(out, _run(dataclasses.replace(_planned(decode_batch=None), out=out)))
    assert prepare.kept_decode_batch(fresh).decode_batch is None  # the old run decodes whole batches
    assert prepare.kept_decode_batch(fresh, overwrite=True).decode_batch == AUTO
    assert prepare.kept_decode_batch(Settings(out=out, decode_batch=2)).decode_batch == 2
