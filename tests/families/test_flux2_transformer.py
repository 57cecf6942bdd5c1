"""promptmill's own FLUX.2 transformer (``pipeline.model.families.flux2.transformer``)
against diffusers' PyTorch ``Flux2Transformer2DModel``, on checkpoints it wrote.

``tests/fixtures/flux2`` holds two tiny random transformers saved by diffusers 0.39
(``make_flux2_fixtures.sh``; these tests need no torch): ``klein``, built as FLUX.2
[klein] is (no guidance embedding, rope_theta 2000, 4 rotary axes, mlp_ratio 3) but
narrow, and ``guided`` (``guidance_embeds``, out_channels unlike in_channels, other
depths, mlp_ratio, rope_theta and eps), each with inputs (Flux2KleinPipeline's position
ids) and the output diffusers gave. Loaded by the naming rule (``convert``), the outputs
match; the weights round-trip; the config refuses, by key, what the module does not do.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model.families.flux2 import transformer as flux2
from pipeline.model.layers import attention
from pipeline.model.loading import convert, weights
from tests.conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "flux2")
VARIANTS = ("klein", "guided")
TOLERANCE = 1e-4


def raw_config(variant):
    with open(os.path.join(FIXTURES, variant, "config.json")) as f:
        return json.load(f)


def state_of(variant):
    return weights.read_mapped(os.path.join(FIXTURES, variant, "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def loaded():
    """{variant: (config, params, data)}."""
    out = {}
    for variant in VARIANTS:
        config = flux2.Flux2Config.from_dict(raw_config(variant))
        out[variant] = (config, flux2.NETWORK.from_torch(state_of(variant), config, "transformer"),
                        dict(np.load(os.path.join(FIXTURES, f"{variant}.npz"))))
    return out


def run(config, params, data, *, ids=None, unroll=1, dtype=jnp.float32):
    module = flux2.Flux2Transformer(config, dtype, unroll=unroll)
    img_ids, txt_ids = ids if ids is not None else (data["img_ids"], data["txt_ids"])
    guidance = data.get("guidance")

    @jax.jit
    def apply(params, hidden, context, timestep, guidance, *traced_ids):
        i, t = traced_ids if traced_ids else (img_ids, txt_ids)
        return module.apply({"params": params}, hidden, context, timestep, i, t, guidance=guidance)

    traced = (img_ids, txt_ids) if not isinstance(img_ids, np.ndarray) else ()
    return np.asarray(apply(params, data["hidden_states"], data["encoder_hidden_states"], data["timestep"],
                            guidance, *traced))


def test_configs_from_the_fixtures(loaded):
    assert loaded["klein"][0] == flux2.Flux2Config(
        in_channels=8, out_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=12, timestep_guidance_channels=64, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000.0, eps=1e-6, guidance_embeds=False)
    assert loaded["guided"][0] == flux2.Flux2Config(
        in_channels=8, out_channels=6, num_layers=1, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=12, timestep_guidance_channels=32, mlp_ratio=2.5,
        axes_dims_rope=(2, 6, 6, 2), rope_theta=1000.0, eps=1e-5, guidance_embeds=True)
    assert loaded["guided"][0].mlp_hidden_dim == 80


def test_config_defaults_are_diffusers():
    """Missing keys take ``Flux2Transformer2DModel``'s defaults (FLUX.2 [dev]'s shape)."""
    config = flux2.Flux2Config.from_dict({"_class_name": "Flux2Transformer2DModel"})
    assert config == flux2.Flux2Config(
        in_channels=128, out_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
        num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32), rope_theta=2000.0, eps=1e-6, guidance_embeds=True)
    assert (config.inner_dim, config.out_channels, config.rope_theta, config.guidance_embeds) == (6144, 128, 2000, True)
    assert flux2.Flux2Config.from_dict({"in_channels": 64}).out_channels == 64
    # keys diffusers' class does not take are ignored, as from_config ignores them
    assert flux2.Flux2Config.from_dict({"_diffusers_version": "0.39.0", "whatever": 1}) == config


@pytest.mark.parametrize("key,value", [
    ("_class_name", "FluxTransformer2DModel"), ("patch_size", 2), ("in_channels", 0), ("in_channels", True),
    ("num_layers", -1), ("num_single_layers", 1.5), ("out_channels", 0), ("attention_head_dim", 120),
    ("axes_dims_rope", (32, 32, 32, 31)), ("axes_dims_rope", []), ("timestep_guidance_channels", 255),
    ("mlp_ratio", 0), ("mlp_ratio", "3"), ("rope_theta", 0), ("eps", -1e-6), ("guidance_embeds", 1),
])
def test_config_refuses_what_it_does_not_do(key, value):
    with pytest.raises(ValueError, match=key):
        flux2.Flux2Config.from_dict({key: value})


@pytest.mark.parametrize("variant", VARIANTS)
def test_param_shapes_are_the_state_dicts(variant, loaded):
    config, params, _ = loaded[variant]
    state = state_of(variant)
    shapes = flux2.NETWORK.param_shapes(config)
    assert convert.torch_shapes(shapes, flux2.TORCH_NAMES) == {name: tuple(a.shape) for name, a in state.items()}
    assert shapes == convert.flat_shapes(params)
    # FLUX.2's layout: shared modulation outside the blocks, no biases, guidance only when embedded
    assert "double_stream_modulation_img.linear.weight" in state
    assert not any(name.endswith(".bias") for name in state)
    assert any(name.startswith("time_guidance_embed.guidance_embedder.") for name in state) == \
        config.guidance_embeds


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_diffusers(variant, loaded):
    config, params, data = loaded[variant]
    got = run(config, params, data)
    expected = data["sample"]
    assert got.shape == expected.shape == (2, 12, config.out_channels)
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)
    assert np.abs(expected).max() > 0.5 and np.abs(expected[0] - expected[1]).max() > 0.1  # not degenerate


def test_the_fixture_tests_the_rotation(loaded):
    """The positions and rope_theta matter at the fixture's size: another theta, or text
    ids without their sequence axis, moves the output far past the tolerance."""
    config, params, data = loaded["klein"]
    other = run(dataclasses.replace(config, rope_theta=10000.0), params, data)
    assert np.abs(other - data["sample"]).max() > 100 * TOLERANCE
    flat_text = run(config, params, data, ids=(data["img_ids"], np.zeros_like(data["txt_ids"])))
    assert np.abs(flat_text - data["sample"]).max() > 100 * TOLERANCE


def test_traced_ids_and_unrolled_stacks_agree(loaded):
    """Position ids traced (float32 tables on the device) and stacks unrolled give the same
    output within the tolerance."""
    config, params, data = loaded["guided"]
    traced = run(config, params, data, ids=(jnp.asarray(data["img_ids"]), jnp.asarray(data["txt_ids"])))
    np.testing.assert_allclose(traced, data["sample"], rtol=0, atol=TOLERANCE)
    unrolled = run(config, params, data, unroll=3)
    np.testing.assert_allclose(unrolled, data["sample"], rtol=0, atol=TOLERANCE)


def test_position_id_helpers_are_the_pipelines(loaded):
    data = loaded["klein"][2]
    np.testing.assert_array_equal(flux2.latent_image_ids(3, 4), data["img_ids"])
    np.testing.assert_array_equal(flux2.text_ids(5), data["txt_ids"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_to_torch_round_trips(variant, loaded):
    config, params, _ = loaded[variant]
    state = state_of(variant)
    back = flux2.NETWORK.to_torch(params)
    assert set(back) == set(state)
    for name, array in state.items():
        assert back[name].dtype == array.dtype
        np.testing.assert_array_equal(back[name], array)
    again = flux2.NETWORK.from_torch(back, config, "transformer")
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, again, params))


def test_from_torch_refuses_a_wrong_state(loaded):
    config = loaded["klein"][0]
    state = dict(state_of("klein"))
    missing = {k: v for k, v in state.items() if k != "single_transformer_blocks.1.attn.to_out.weight"}
    with pytest.raises(weights.WeightsError, match="single_transformer_blocks.1.attn.to_out.weight"):
        flux2.NETWORK.from_torch(missing, config, "transformer")
    with pytest.raises(weights.WeightsError, match="does not have"):
        flux2.NETWORK.from_torch({**state, "x_embedder.bias": np.zeros(32, np.float32)}, config, "transformer")
    # the guided checkpoint is not the klein config's
    with pytest.raises(weights.WeightsError):
        flux2.NETWORK.from_torch(state_of("guided"), config, "transformer")


def test_guidance_only_when_embedded(loaded):
    for variant, guidance in (("klein", np.ones(2, np.float32)), ("guided", None)):
        config, params, data = loaded[variant]
        module = flux2.Flux2Transformer(config)
        with pytest.raises(ValueError, match="guidance"):
            module.apply({"params": params}, data["hidden_states"], data["encoder_hidden_states"], data["timestep"],
                         data["img_ids"], data["txt_ids"], guidance=guidance)


def test_attends_through_the_seam(loaded):
    """Under ``attention.use`` every attention call goes through the seam (site "flux2"),
    with diffusers' result."""
    config, params, data = loaded["klein"]
    budget = 2 * 2 * 17 * 4 * 4  # 4 query rows of scores per block
    with attention.use("chunked", platform="cpu", budget_bytes=budget) as calls:
        got = run(config, params, data)
    np.testing.assert_allclose(got, data["sample"], rtol=0, atol=TOLERANCE)
    assert {(c.site, c.kernel, c.batch, c.q_tokens, c.kv_tokens, c.heads, c.head_dim) for c in calls} == \
        {("flux2", "chunked", 2, 17, 17, 2, 16)}
    assert len(calls) >= 2  # the double and the single blocks' attention (a scan may trace its body twice)
    assert attention.query_blocks(2, 2, 17, 17, 4, budget)[0] > 1  # chunked for real
