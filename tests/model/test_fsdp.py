"""FSDP inside a host (``--fsdp N``): the sharding rule, and the sharded program against
the replicated one on CPU devices (two, in this process).

The sharded runs end to end (1x4 vs 2x2 hosts x devices, byte for byte, and ``reproduce``)
are in test_flux.py, beside the replicated ones they are compared with.
"""
import jax
import numpy as np
import pytest

from pipeline.core.settings import AUTO, Settings
from pipeline.generate import fit
from pipeline.generate.generator import Generator
from pipeline.model import load as model_lib, sharding
from pipeline.generate.spec import ProgramSpec


@pytest.mark.parametrize("shape,fsdp,axis", [
    ((3072, 3072), 2, 1),  # a square matrix: the last axis on a tie
    ((4096, 3072), 4, 0),  # the larger of the two
    ((19, 3072, 12288), 8, 2),  # a scanned stack: never its blocks axis
    ((3, 3, 320, 640), 2, 3),  # a convolution: input or output channels
    ((3, 3, 4, 320), 8, 3),  # 8 divides only the output channels
    ((768,), 2, None),  # a vector (bias, norm): replicated
    ((7, 9), 2, None),  # too small
    ((302, 301), 4, None),  # 4 divides neither axis
    ((3072, 3072), 1, None),
])
def test_a_weight_is_split_along_the_larger_axis_n_divides(shape, fsdp, axis):
    assert sharding.leaf_axis(shape, fsdp) == axis


def test_the_rule_shards_the_denoiser_and_large_text_encoders_only():
    gib = 2 ** 30
    sizes = {"text_encoder": gib // 4, "text_encoder_2": 9 * gib, "transformer": 22 * gib, "vae": gib // 6}
    assert sharding.sharded_components(sizes, 2) == ("text_encoder_2", "transformer")
    assert sharding.sharded_components({"text_encoder": gib // 4, "unet": 2 * gib, "vae": gib // 6}, 4) == ("unet",)
    assert sharding.sharded_components(sizes, 1) == ()


def test_an_n_that_does_not_divide_the_hosts_devices_is_refused():
    Settings(devices_per_host=4, fsdp=2).validate()
    Settings(devices_per_host=4, fsdp=AUTO).validate()
    with pytest.raises(ValueError, match=r"--fsdp 3 must divide the devices of a host \(4\).*possible: 1, 2, 4"):
        Settings(devices_per_host=4, fsdp=3).validate()
    with pytest.raises(ValueError, match="--fsdp must be a whole number >= 1 or auto"):
        Settings(fsdp=0).validate()
    from jobs import cli

    args = cli.build_parser().parse_args(["run", "--fsdp", "auto"])
    assert args.fsdp == AUTO


@pytest.fixture(scope="module")
def devices():
    found = jax.local_devices()
    assert len(found) >= 2  # tests/conftest.py gives this process two CPU devices
    return found[:2]


ROWS = [("a red fox in the snow", "", 3.5, 5, 0), ("a blue whale", "", 3.5, 9, 2)]


@pytest.mark.parametrize("name", ["tiny", "tiny-flux-dev"])
def test_fsdp_2_makes_the_images_of_fsdp_1_with_half_the_sharded_weights_on_each_device(name, devices,
                                                                                        model_cache):
    model = model_lib.load(name, dtype="fp32")
    rule = model.family.guidance_rule(model)
    images, programs = {}, {}
    for fsdp in (1, 2):
        generator = Generator(model, ProgramSpec(32, 32, 2, 1, rule, guided=False, fsdp=fsdp), devices)
        images[fsdp] = generator(generator.batch_of(ROWS))
        programs[fsdp] = fit.program_memory(generator.compiled)
    diff = np.abs(images[1].astype(int) - images[2].astype(int))
    assert diff.max() <= 2, diff.max()
    assert not np.array_equal(images[2][0], images[2][1])
    # each device holds every replicated weight and half of each sharded one (in the run's dtype)
    from pipeline.model.shapes import struct

    sizes = sharding.component_bytes(struct(model.params, model.param_dtype))
    sharded = [c for c in sharding.layout_of(model.params, 2).sharded]
    assert sharded == [next(c for c in sizes if c in sharding.DENOISERS)]
    saved = programs[1]["argument"] - programs[2]["argument"]
    assert 0.4 * sizes[sharded[0]] < saved <= 0.5 * sizes[sharded[0]]
    # the share the TPU check reports for a program XLA refused, from shapes: about XLA's own
    # figure (which leaves out the weights a program never reads, e.g. tiny's unused pooler)
    for fsdp in (1, 2):
        share = sharding.device_bytes(model.params, fsdp, model.param_dtype)
        assert 0.75 * share < programs[fsdp]["argument"] < share + 64 * 1024, (fsdp, share, programs[fsdp])


def test_a_device_holds_a_sharded_weights_share_and_every_replicated_weight():
    f32 = np.float32
    params = {"unet": {"kernel": jax.ShapeDtypeStruct((512, 64), f32), "bias": jax.ShapeDtypeStruct((64,), f32)},
              "vae": {"kernel": jax.ShapeDtypeStruct((512, 64), f32)},
              "text_encoder": {"ids": jax.ShapeDtypeStruct((77, 8), np.int32)}}
    matrix, bias, ids = 512 * 64 * 4, 64 * 4, 77 * 8 * 4
    assert sharding.device_bytes(params, 1) == 2 * matrix + bias + ids
    assert sharding.device_bytes(params, 4) == matrix // 4 + bias + matrix + ids
    # floating weights in the run's dtype; integers as they are
    assert sharding.device_bytes(params, 2, jax.numpy.bfloat16) == \
        matrix // 4 + bias // 2 + matrix // 2 + ids


def test_fsdp_auto_takes_the_smallest_n_that_fits(devices, model_cache, monkeypatch, tmp_path):
    measured, original = {}, fit.sampler_memory

    def sampler_memory(model, spec, *args, **kwargs):  # each program compiled once here
        if spec.fsdp not in measured:
            measured[spec.fsdp] = original(model, spec, *args, **kwargs)
        return measured[spec.fsdp]

    monkeypatch.setattr(fit, "sampler_memory", sampler_memory)
    model = model_lib.load("tiny", dtype="fp32", abstract=True)
    one = fit.sampler_memory(model, ProgramSpec(32, 32, 1, 1))["total"]
    two = fit.sampler_memory(model, ProgramSpec(32, 32, 1, 1, fsdp=2), devices=devices)["total"]
    assert two < one
    asked = Settings(out=str(tmp_path / "out"), width=32, height=32, steps=1, devices_per_host=2, fsdp=AUTO,
                     device_memory=(one + two) / 2 / fit.HEADROOM / fit.GIB)
    assert fit.resolve_fsdp(asked).fsdp == 2  # one image does not fit replicated; it does at 2
    assert fit.resolve_fsdp(asked.replace(device_memory=2 * one / fit.HEADROOM / fit.GIB)).fsdp == 1
    with pytest.raises(fit.FitError, match="--fsdp auto: one image per device needs"):
        fit.resolve_fsdp(asked.replace(device_memory=two / 4 / fit.GIB))


def test_the_pallas_kernel_runs_per_device_in_a_program_partitioned_over_a_mesh(devices):
    """XLA cannot partition a Pallas (Mosaic) kernel: under ``--fsdp`` the seam runs it on each
    device's own rows (shard_map); interpreted here, it gives XLA's attention."""
    from jax.sharding import NamedSharding, PartitionSpec

    from pipeline.model.layers import attention

    the_mesh = sharding.mesh(devices, 2)
    rng = np.random.default_rng(1)
    q, k, v = (jax.numpy.asarray(rng.standard_normal((4, 256, 2, 8)), jax.numpy.float32) for _ in range(3))

    def attend(q, k, v):
        with attention.use("flash", platform="cpu", block_tokens=128, mesh=the_mesh) as calls:
            out = attention.compute("flux", q, k, v, 0.35)
        assert [c.kernel for c in calls] == ["pallas"]
        return out

    rows = NamedSharding(the_mesh, PartitionSpec((sharding.DATA, sharding.FSDP)))
    out = jax.jit(attend, in_shardings=(rows, rows, rows), out_shardings=rows)(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(attention.attend(q, k, v, 0.35, "xla")), atol=1e-5)


def test_fsdp_shards_klein_s_qwen3_with_its_transformer_and_makes_the_images_of_fsdp_1(devices, model_cache,
                                                                                       monkeypatch):
    """FLUX.2 [klein]'s every network but the VAE is sharded: the real Qwen3-4B (27 of its
    layers, 6 GiB in bf16) is over the text-encoder bound, and the tiny one is made so here;
    the base model's guided program at --fsdp 2 makes the images of --fsdp 1."""
    real = model_lib.load("random-klein-4b", abstract=True, dtype="bf16")
    assert sharding.layout_of(real.params, 2).sharded == ("text_encoder", "transformer")
    monkeypatch.setattr(sharding, "ENCODER_SHARDED_FROM", 0)
    model = model_lib.load("tiny-klein-base", dtype="fp32")
    assert sharding.layout_of(model.params, 2).sharded == ("text_encoder", "transformer")
    rows = [("a red fox in the snow", "", 4.0, 5, 0), ("a blue whale", "blurry", 1.0, 9, 2)]
    images = {}
    for fsdp in (1, 2):
        generator = Generator(model, ProgramSpec(16, 16, 2, 1, "diffusers", fsdp=fsdp), devices)
        images[fsdp] = generator(generator.batch_of(rows))
    diff = np.abs(images[1].astype(int) - images[2].astype(int))
    assert diff.max() <= 2, diff.max()
    assert not np.array_equal(images[2][0], images[2][1])


def test_fsdp_shards_zimage_s_qwen3_and_transformer_and_makes_the_images_of_fsdp_1(devices, model_cache,
                                                                                  monkeypatch):
    """Z-Image's Qwen3-4B (35 of its layers) is over the text-encoder bound, as the tiny
    one is made here; the guided program at --fsdp 2, prompts of other lengths side by
    side, makes the images of --fsdp 1."""
    real = model_lib.load("random-zimage", abstract=True, dtype="bf16")
    assert sharding.layout_of(real.params, 2).sharded == ("text_encoder", "transformer")
    monkeypatch.setattr(sharding, "ENCODER_SHARDED_FROM", 0)
    model = model_lib.load("tiny-zimage", dtype="fp32", max_sequence_length=64)
    rows = [("a red fox in the snow, at dawn, in the hills", "", 3.0, 5, 0), ("owl", "blurry", 0.0, 9, 2)]
    images = {}
    for fsdp in (1, 2):
        generator = Generator(model, ProgramSpec(16, 16, 2, 1, "zimage", fsdp=fsdp), devices)
        images[fsdp] = generator(generator.batch_of(rows))
    diff = np.abs(images[1].astype(int) - images[2].astype(int))
    assert diff.max() <= 2, diff.max()
    assert not np.array_equal(images[2][0], images[2][1])
