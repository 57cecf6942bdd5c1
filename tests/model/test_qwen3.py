"""promptmill's own Qwen3 (``pipeline.model.layers.text.qwen3``) against transformers' PyTorch
``Qwen3Model``, on checkpoints it wrote.

``tests/fixtures/qwen3`` holds a tiny random Qwen3 (28 layers, head_dim 8 != hidden 16 / 4
heads, 2 key-value heads) saved by transformers as a ``Qwen3Model`` and as a
``Qwen3ForCausalLM``, and the hidden states ``Qwen3Model(output_hidden_states=True)`` gave
for a batch with right and left padding, with eager and SDPA attention
(``make_qwen3_fixtures.sh``; these tests need no torch). Loaded by the naming rule
(``convert``), every hidden state matches, padded positions included; running the first N
layers gives the first N + 1; the ForCausalLM file loads the same weights; the config
refuses, by key, what the module does not do.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model.layers.text import qwen3
from pipeline.model.loading import weights
from tests.conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "qwen3")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def data():
    return dict(np.load(os.path.join(FIXTURES, "hidden_states.npz")))


@pytest.fixture(scope="module")
def raw_config():
    with open(os.path.join(FIXTURES, "model", "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def config(raw_config):
    return qwen3.Qwen3Config.from_dict(raw_config)


def state_of(variant):
    return weights.read_mapped(os.path.join(FIXTURES, variant, "model.safetensors"))


@pytest.fixture(scope="module")
def params(config):
    return qwen3.from_torch(state_of("model"), config)


@pytest.fixture(scope="module")
def full_run(params, config, data):
    module = qwen3.Qwen3Encoder(config, jnp.float32)
    return np.asarray(jax.jit(module.apply)({"params": params}, data["input_ids"], data["attention_mask"]))


def test_config_from_the_fixture(config):
    assert config == qwen3.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=28,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                                       rope_theta=1e6, attention_bias=False)


def test_every_hidden_state_matches_transformers(full_run, data, config):
    """Eager attention's hidden states, all 29, at every position (padded ones and the
    left-padded row's fully masked queries included)."""
    expected = data["hidden_states_eager"]
    assert full_run.shape == expected.shape == (config.num_hidden_layers + 1, 3, 12, 16)
    np.testing.assert_allclose(full_run, expected, rtol=0, atol=TOLERANCE)
    # the fixture is not degenerate: padding changes what the padded rows see
    assert np.abs(expected[-1, 1] - expected[-1, 0]).max() > 0.1


def test_sdpa_matches_where_a_query_sees_a_key(full_run, data):
    """transformers' default SDPA attention agrees except at queries that see no key
    (zero attention output there in torch >= 2.5; uniform weights in eager and here)."""
    seen = ~data["fully_masked"]
    assert seen[:2].all() and not seen[2].all()  # right padding never masks a whole query row
    np.testing.assert_allclose(full_run[:, seen], data["hidden_states_sdpa"][:, seen], rtol=0, atol=TOLERANCE)


def test_no_mask_means_no_padding(params, config, data):
    module = qwen3.Qwen3Encoder(config, jnp.float32, layers=3)
    part = qwen3.truncate(params, config, 3)
    ids = data["input_ids"][:1]
    np.testing.assert_array_equal(np.asarray(module.apply({"params": part}, ids)),
                                  np.asarray(module.apply({"params": part}, ids, np.ones_like(ids))))


@pytest.mark.parametrize("layers", [1, 9, 27])
def test_first_layers_only(layers, config, data, full_run):
    """N layers: the first N + 1 hidden states, without the final norm; the weights of the
    layers beyond N (and the final norm's) are neither created nor read."""
    class Watched(Mapping):
        def __init__(self, state):
            self.state, self.read = state, set()

        def __getitem__(self, name):
            self.read.add(name)
            return self.state[name]

        def __iter__(self):
            return iter(self.state)

        def __len__(self):
            return len(self.state)

    state = Watched(state_of("model"))
    params = qwen3.from_torch(state, config, layers=layers)
    assert "norm" not in params
    assert all(a.shape[0] == layers for a in jax.tree_util.tree_leaves(params["layers"]))
    assert qwen3.param_shapes(config, layers) == {path: tuple(a.shape) for path, a in
                                                  qwen3.convert.flatten(params).items()}
    assert not any(name == "norm.weight" or any(name.startswith(f"layers.{i}.")
                                                for i in range(layers, config.num_hidden_layers))
                   for name in state.read)
    out = np.asarray(qwen3.Qwen3Encoder(config, jnp.float32, layers=layers).apply(
        {"params": params}, data["input_ids"], data["attention_mask"]))
    assert out.shape[0] == layers + 1
    np.testing.assert_allclose(out, full_run[:layers + 1], rtol=0, atol=1e-5)  # another compilation
    np.testing.assert_allclose(out, data["hidden_states_eager"][:layers + 1], rtol=0, atol=TOLERANCE)


def test_hidden_states_helper(params, config, data):
    expected = data["hidden_states_eager"]
    for indices in ((9, 18, 27), (0,), (28, 3)):
        got = qwen3.hidden_states(params, config, data["input_ids"], data["attention_mask"], indices=indices)
        assert len(got) == len(indices)
        for index, state in zip(indices, got):
            np.testing.assert_allclose(np.asarray(state), expected[index], rtol=0, atol=TOLERANCE)
    assert qwen3.layers_for(config, (9, 18, 27)) == 27
    assert qwen3.layers_for(config, (0,)) == 1
    for bad in ((29,), (-1,), (True,)):
        with pytest.raises(ValueError, match="hidden state"):
            qwen3.layers_for(config, bad)
    for bad in (0, 29):
        with pytest.raises(ValueError, match="layers"):
            qwen3.Qwen3Encoder(config, layers=bad).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))


def test_causal_lm_file_loads_the_same(params, config):
    state = state_of("causal_lm")
    assert "lm_head.weight" in state and all(n.startswith("model.") for n in state if n != "lm_head.weight")
    other = qwen3.from_torch(state, config)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, other)
    part = qwen3.from_torch(state, config, layers=9)
    jax.tree_util.tree_map(np.testing.assert_array_equal, qwen3.truncate(params, config, 9), part)


def test_to_torch_round_trip(params, config):
    state = state_of("model")
    back = qwen3.to_torch(params, config)
    assert sorted(back) == sorted(state)
    for name in state:
        np.testing.assert_array_equal(back[name], state[name])
        assert back[name].dtype == state[name].dtype


def test_from_torch_names_what_it_refuses(config):
    state = dict(state_of("model"))
    missing = {k: v for k, v in state.items() if k != "layers.3.self_attn.q_norm.weight"}
    with pytest.raises(weights.WeightsError, match=r"missing.*layers\.3\.self_attn\.q_norm\.weight"):
        qwen3.from_torch(missing, config)
    with pytest.raises(weights.WeightsError, match="extra.weight"):
        qwen3.from_torch({**state, "extra.weight": np.zeros(1, np.float32)}, config)
    odd = {**state, "layers.0.self_attn.k_proj.weight": np.zeros((8, 16), np.float32)}
    with pytest.raises(weights.WeightsError, match="k_proj"):
        qwen3.from_torch(odd, config)
    # a layer beyond the ones asked for may be anything: it is skipped
    assert qwen3.from_torch({**missing}, config, layers=3)["layers"]["self_attn"]["q_norm"]["scale"].shape == (3, 8)


def test_config_refusals(raw_config):
    def refused(key, **changes):
        with pytest.raises(ValueError, match=key):
            qwen3.Qwen3Config.from_dict({**raw_config, **changes})

    refused("rope_scaling", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    refused("use_sliding_window", use_sliding_window=True, sliding_window=8)
    refused("layer_types", layer_types=["sliding_attention"] * 28)
    refused("hidden_act", hidden_act="gelu")
    refused("partial_rotary_factor", partial_rotary_factor=0.5)
    refused("model_type", model_type="qwen2")
    refused("num_key_value_heads", num_key_value_heads=3)
    refused("head_dim", head_dim=7)
    refused("head_dim", head_dim=0)
    refused("rms_norm_eps", rms_norm_eps=0)
    refused("rope_theta", rope_theta="big")
    refused("attention_bias", attention_bias="yes")
    refused("num_hidden_layers", num_hidden_layers=True)
    # what transformers derives: head_dim null -> hidden // heads; missing -> Qwen3Config's 128;
    # num_key_value_heads null -> as many as the query heads
    assert qwen3.Qwen3Config.from_dict({**raw_config, "head_dim": None}).head_dim == 4
    assert qwen3.Qwen3Config.from_dict({k: v for k, v in raw_config.items() if k != "head_dim"}).head_dim == 128
    assert qwen3.Qwen3Config.from_dict({**raw_config, "num_key_value_heads": None}).num_key_value_heads == 4
    # what does not change the hidden states is read by no one
    assert qwen3.Qwen3Config.from_dict({**raw_config, "sliding_window": 4096, "max_window_layers": 3,
                                        "hidden_act": "swish", "tie_word_embeddings": True}).num_hidden_layers == 28


def test_attention_bias_is_honoured(raw_config, config):
    biased = qwen3.Qwen3Config.from_dict({**raw_config, "attention_bias": True})
    shapes = qwen3.param_shapes(biased, layers=2)
    names = qwen3.convert.torch_shapes(shapes, qwen3.TORCH_NAMES)
    assert names["layers.1.self_attn.q_proj.bias"] == (32,)
    assert names["layers.1.self_attn.k_proj.bias"] == (16,)
    assert names["layers.1.self_attn.o_proj.bias"] == (16,)
    assert "layers.1.mlp.gate_proj.bias" not in names
    assert not any(name.endswith(".bias") for name in qwen3.convert.torch_shapes(qwen3.param_shapes(config),
                                                                                 qwen3.TORCH_NAMES))


def test_rope_rotates_halves_as_numpy():
    rng = np.random.RandomState(0)
    length, heads, head_dim, theta = 7, 3, 8, 1e6
    x = rng.standard_normal((2, length, heads, head_dim)).astype(np.float32)
    cos, sin = qwen3.rope_cos_sin(length, head_dim, theta)
    got = np.asarray(qwen3.apply_rope(jnp.asarray(x), cos, sin))
    half = head_dim // 2
    freqs = theta ** -(np.arange(half) * 2 / head_dim)  # frequency i turns dims i and i + half together
    angle = np.arange(length)[:, None] * freqs[None, :]  # [L, half]
    c, s = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
    first, second = x[..., :half], x[..., half:]
    expected = np.concatenate([first * c - second * s, second * c + first * s], axis=-1)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    # not FLUX's interleaved pairs
    assert np.abs(got[:, 1:] - np.asarray(_interleaved(x, angle))[:, 1:]).max() > 0.1


def _interleaved(x, angle):
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    c, s = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
    return np.stack([pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 1] * c + pairs[..., 0] * s],
                    axis=-1).reshape(x.shape)


def test_bfloat16_runs_close(params, config, data):
    module = qwen3.Qwen3Encoder(config, jnp.bfloat16, layers=4)
    out = module.apply({"params": qwen3.truncate(params, config, 4)}, data["input_ids"], data["attention_mask"])
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), data["hidden_states_eager"][:5], rtol=0, atol=0.25)
