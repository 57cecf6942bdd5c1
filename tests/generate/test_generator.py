import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

from pipeline.generate import jax_events
from pipeline.generate.generator import Generator
from pipeline.model import load as model_lib
from pipeline.generate.spec import ProgramSpec


@pytest.fixture(scope="module")
def generator(model_cache):
    return Generator(model_lib.load("tiny"), ProgramSpec(32, 32, 2, 1))


def make_batch(gen, prompts, negatives, guidance, seeds, indices):
    return gen.batch(prompts, negatives, guidance, [int(s) for s in seeds], indices)


def test_runs_on_every_local_device(generator):
    assert len(generator.devices) == jax.local_device_count() == 2
    assert generator.batch_size == 2


def test_no_compilation_after_warm_up(generator):
    generator(generator.padding_batch())  # warm-up
    before = jax_events.COMPILES.count()
    rng = np.random.default_rng(1)
    for step in range(4):
        batch = make_batch(generator, [f"prompt {step} {'long ' * 40 * step}", "another"],
                           ["", f"negative {step}"], rng.uniform(0, 12, 2), rng.integers(0, 2**62, 2), [step, 0])
        images = generator(batch)
        assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    assert jax_events.COMPILES.count() - before == 0


def test_compile_counter_sees_a_compilation():
    jax_events.COMPILES.install()
    before = jax_events.COMPILES.count()
    jax.jit(lambda x: x * 3 + 1)(np.arange(7.0))
    assert jax_events.COMPILES.count() > before
    # count_here: only the calling thread's (a host compiles its sampler on another)
    here, before = jax_events.COMPILES.count_here(), jax_events.COMPILES.count()
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(lambda: (jax.jit(lambda x: x * 5 - 2)(np.arange(5.0)),
                                    jax_events.COMPILES.count_here())[1]).result() >= 1
    assert jax_events.COMPILES.count() > before and jax_events.COMPILES.count_here() == here


def test_the_sampler_lowered_from_shapes_is_the_program_of_the_weights(generator):
    from pipeline.generate import compile_cache
    from pipeline.generate.generator import lower_sampler, per_device_program
    from pipeline.model import sharding

    devices = generator.devices
    abstract = model_lib.load("tiny", abstract=True)  # configs only: no weight read
    from_shapes = lower_sampler(abstract, ProgramSpec(32, 32, 2, 1), devices)
    the_mesh = sharding.mesh(devices, 1)  # --fsdp 1: the replicated run is a program over a (D, 1) mesh
    fn = jax.jit(per_device_program(generator.model, ProgramSpec(32, 32, 2, 1), the_mesh),
                 out_shardings=sharding.batch_sharding(the_mesh, 4))
    from_weights = fn.lower(generator.params, *generator._device_shaped(generator.padding_batch()))
    assert from_shapes.as_text() == from_weights.as_text()
    assert compile_cache.executable_key(from_shapes, devices) == compile_cache.executable_key(from_weights, devices)
    # a program is used only with the params and devices it was lowered for
    program = generator.program
    assert program.takes(generator.params, devices) and not program.takes(generator.params, devices[:1])
    half = jax.tree_util.tree_map(lambda x: x.astype(np.float16) if x.dtype == np.float32 else x,
                                  generator.params["vae"])
    assert not program.takes({**generator.params, "vae": half}, devices)
    before = jax_events.COMPILES.count()
    again = Generator(generator.model, ProgramSpec(32, 32, 2, 1), params=generator.params, program=program)
    assert again.program is program and jax_events.COMPILES.count() == before


def test_image_depends_on_its_own_key_only(generator):
    a = make_batch(generator, ["a cat", "a dog"], ["", ""], [7.5, 7.5], [11, 2**40], [0, 5])
    b = make_batch(generator, ["a dog", "a cat"], ["", ""], [7.5, 7.5], [2**40, 11], [5, 0])
    c = make_batch(generator, ["a cat", "a dog"], ["", ""], [7.5, 7.5], [11, 2**40], [1, 5])
    ia, ib, ic = generator(a), generator(b), generator(c)
    np.testing.assert_array_equal(ia[0], ib[1])  # same image on another device
    np.testing.assert_array_equal(ia[1], ib[0])
    assert not np.array_equal(ia[0], ic[0])  # another image index: another image


def test_wrong_batch_size_is_an_error(generator):
    batch = make_batch(generator, ["x"], [""], [1.0], [1], [0])
    with pytest.raises(ValueError, match="a batch holds 2 images"):
        generator(batch)


def test_guidance_at_most_1_uses_the_prompt_alone_as_diffusers_does(generator):
    fox_and_whale = ["a red fox", "a blue whale in the ocean"]
    for g in (0.0, 1.0):
        images = generator(make_batch(generator, fox_and_whale, ["", ""], [g, g], [5, 5], [0, 0]))
        assert not np.array_equal(images[0], images[1])  # one seed, two prompts: two images
        negatives = generator(make_batch(generator, ["a red fox"] * 2, ["", "blurry, dark"], [g, g], [5, 5], [0, 0]))
        np.testing.assert_array_equal(negatives[0], negatives[1])  # the negative prompt plays no part
    guided = generator(make_batch(generator, ["a red fox"] * 2, ["", "blurry, dark"], [7.5, 7.5], [5, 5], [0, 0]))
    assert not np.array_equal(guided[0], guided[1])  # above 1 it guides
    # each image's own guidance decides, never its neighbour's
    mixed = generator(make_batch(generator, ["a red fox"] * 2, ["blurry"] * 2, [0.5, 7.5], [5, 5], [0, 0]))
    low = generator(make_batch(generator, ["a red fox"] * 2, ["blurry"] * 2, [0.5, 0.5], [5, 5], [0, 0]))
    high = generator(make_batch(generator, ["a red fox"] * 2, ["blurry"] * 2, [7.5, 7.5], [5, 5], [0, 0]))
    np.testing.assert_array_equal(mixed[0], low[0])
    np.testing.assert_array_equal(mixed[1], high[1])


def test_a_rule_the_family_does_not_take_is_refused(generator):
    for rule in ("zimage", "sometimes"):
        with pytest.raises(ValueError, match="guidance_rule"):
            Generator(generator.model, ProgramSpec(32, 32, 2, 1, guidance_rule=rule))


def test_a_guidance_free_program_encodes_no_negative_prompt_and_halves_the_unet_batch(generator, monkeypatch):
    encoded, unet_batches = [], []
    model = generator.model
    real_encode = model.family.make_encode_fn

    def spy_encode(m):
        encode = real_encode(m)
        return lambda params, ids: (encoded.append(ids.shape[0]), encode(params, ids))[1]

    class SpyUnet:  # records the batch of every UNet call while the program is traced
        def __getattr__(self, name):
            return getattr(model.nets.unet, name)

        def apply(self, variables, sample, *args, **kwargs):
            unet_batches.append(sample.shape[0])
            return model.nets.unet.apply(variables, sample, *args, **kwargs)

    monkeypatch.setattr(model.family, "make_encode_fn", spy_encode)
    spied = dataclasses.replace(model, nets=dataclasses.replace(model.nets, unet=SpyUnet()))
    free = Generator(spied, ProgramSpec(32, 32, 2, 1, guided=False))
    n = free.per_device_batch  # at --fsdp 1 the program is written per device: traced for its own B rows
    assert (encoded, unet_batches) == ([n], [n])  # the prompt alone, a UNet batch of N
    encoded.clear(), unet_batches.clear()
    Generator(spied, ProgramSpec(32, 32, 2, 1, guided=True))
    assert (encoded, unet_batches) == ([n, n], [2 * n])  # prompt and negative prompt, batch 2N
    fox_and_whale = make_batch(free, ["a red fox", "a blue whale in the ocean"], ["", ""], [0.0, 0.0], [5, 5], [0, 0])
    images = free(fox_and_whale)
    assert not np.array_equal(images[0], images[1])  # one seed, two prompts: two images
    negatives = free(make_batch(free, ["a red fox"] * 2, ["", "blurry, dark"], [1.0, 0.0], [5, 5], [0, 0]))
    np.testing.assert_array_equal(negatives[0], negatives[1])  # negatives and guidance are not read
    np.testing.assert_array_equal(negatives[0], images[0])
    # the same prediction as the guided program's at guidance <= 1, in another batch shape
    guided_images = generator(make_batch(generator, ["a red fox"] * 2, ["", ""], [0.0, 0.0], [5, 5], [0, 0]))
    assert np.abs(guided_images[0].astype(int) - images[0].astype(int)).max() <= 1


@pytest.mark.parametrize("choice", ["euler_a", "lcm"])
def test_stochastic_samplers_draw_each_images_noise_from_its_own_key(model_cache, choice):
    gen = Generator(model_lib.load("tiny", dtype="fp32", scheduler=choice), ProgramSpec(32, 32, 3, 1))
    a = gen(make_batch(gen, ["a cat", "a dog"], ["", ""], [7.5, 7.5], [11, 2**40], [0, 5]))
    b = gen(make_batch(gen, ["a dog", "a cat"], ["", ""], [7.5, 7.5], [2**40, 11], [5, 0]))
    np.testing.assert_array_equal(a[0], b[1])  # same image on another device, next to another neighbour
    np.testing.assert_array_equal(a[1], b[0])
    c = gen(make_batch(gen, ["a cat", "a dog"], ["", ""], [7.5, 7.5], [11, 2**40], [1, 5]))
    assert not np.array_equal(a[0], c[0])
    assert a.std() > 1  # not a constant image
