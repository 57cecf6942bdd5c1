"""promptmill's own FLUX.1 networks (``pipeline.model.layers``, CLIP's in ``layers.text``) against diffusers' and
transformers' PyTorch modules, on checkpoints they wrote.

``tests/fixtures/flux`` holds a tiny FLUX.1 [schnell]-like (bf16) and [dev]-like (fp16)
checkpoint written by diffusers' ``FluxPipeline.save_pretrained``, and what its networks
gave in the PyTorch pipeline (``make_flux_fixtures.sh``; these tests need no torch). Each
network is loaded from the PyTorch safetensors by the naming rule (``nets.convert``) and
run in float32 on the inputs the PyTorch one got: T5's last hidden state, CLIP's pooled
output, the transformer's first call and the VAE's decode match. The conversion keeps
each array's stored dtype, round-trips exactly, reads sharded files, and names the
weight it refuses; each config refuses, by key, what the module does not do.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model.layers import attention
from pipeline.model.loading import weights
from pipeline.model.families.flux import sampling as fs
from pipeline.model.loading import convert
from pipeline.model.families.flux import transformer as flux
from pipeline.model.layers import patching, rotary
from pipeline.model.layers import vae
from pipeline.model.layers.text import t5
from tests.conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "flux")
VARIANTS = ("schnell", "dev")
STORED = {"schnell": "bfloat16", "dev": "float16"}


def float32(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), tree)


def state(variant: str, component: str) -> dict:
    library = "transformers" if component.startswith("text_encoder") else "diffusers"
    return weights.read_safetensors_weights(os.path.join(FIXTURES, variant, component), library)


def cases(variant: str) -> list[dict]:
    return [dict(np.load(path)) for path in sorted(glob.glob(os.path.join(FIXTURES, f"{variant}-*.npz")))]


@pytest.fixture(scope="module")
def loaded():
    """variant -> (nets, float32 params, text fixture)."""
    out = {}
    for variant in VARIANTS:
        directory = os.path.join(FIXTURES, variant)
        nets = fs.read_nets(directory)
        out[variant] = nets, float32(fs.read_params(directory, nets)), dict(np.load(
            os.path.join(FIXTURES, f"{variant}.text.npz")))
    return out


# What each variant's probe runs: schnell at the second size with the XLA attention (no
# seam), dev at the first size with its embedded guidance, its attention through the
# seam's chunked kernel (blocks of about 14 query rows)
PROBES = {"schnell": ("schnell-g0-s2-24x40", None), "dev": ("dev-g3.5-s2-32x32", "chunked")}
CHUNK_BUDGET = 2 * 2 * 88 * 4 * 14  # batch x heads x keys x bytes x rows


@pytest.fixture(scope="module")
def probed(loaded):
    """variant -> (case, outputs, attention calls): one program per variant runs each network
    on what its PyTorch counterpart got in one case (``PROBES``): T5 and CLIP on the prompts'
    ids, the transformer's first call, and the VAE's decode of the last step's latents."""
    out = {}
    for variant, (name, kernel) in PROBES.items():
        nets, params, text = loaded[variant]
        case = dict(np.load(os.path.join(FIXTURES, f"{name}.npz")))
        rows, cols = int(case["height"]) // 2, int(case["width"]) // 2
        image_ids, txt_ids = flux.latent_image_ids(rows // 2, cols // 2), flux.text_ids(text["t5_ids"].shape[1])
        calls = []

        def run(params, t5_ids, clip_ids, x, t, guidance, final, nets=nets, kernel=kernel, image_ids=image_ids,
                txt_ids=txt_ids, calls=calls):
            seam = attention.use(kernel, platform="cpu", budget_bytes=CHUNK_BUDGET) if kernel else \
                contextlib.nullcontext([])
            with seam as traced:
                velocity = nets.transformer.apply({"params": params["transformer"]}, x, text["prompt_embeds"],
                                                  text["pooled_prompt_embeds"], t, image_ids, txt_ids, guidance=guidance)
            calls.extend(traced)
            return dict(t5=nets.t5.apply({"params": params["text_encoder_2"]}, t5_ids),
                        pooled=nets.clip.apply({"params": params["text_encoder"]}, clip_ids).pooled,
                        transformer=velocity,
                        images=vae.vae_decode(nets.vae, params["vae"], final, nets.vae.config))

        guidance = case["transformer_guidance"][0] if nets.guidance_embeds else None
        outputs = jax.jit(run)(params, text["t5_ids"], text["clip_ids"], patching.pack_latents(case["latents"]),
                               case["transformer_timestep"][0], guidance,
                               patching.unpack_latents(case["step_latents"][-1], rows, cols))
        out[variant] = case, jax.tree_util.tree_map(np.asarray, outputs), calls
    return out


# ---- T5

def test_relative_position_buckets_equal_transformers():
    fixture = np.load(os.path.join(FIXTURES, "t5_buckets.npz"))
    span = int(fixture["relative_position"][-1])
    table = t5.relative_position_buckets(span + 1, 32, 128)
    # the last query's row holds the relative positions -span..0, the first query's 0..span
    np.testing.assert_array_equal(np.concatenate([table[-1, :-1], table[0]]), fixture["buckets"])
    # each row is the same function of key - query
    assert table[3, 10] == table[0, 7] and table[10, 3] == table[7, 0] and table[10, 3] != table[3, 10]


@pytest.mark.parametrize("variant", VARIANTS)
def test_t5_last_hidden_state_matches_transformers(loaded, probed, variant):
    _, _, text = loaded[variant]
    ours = probed[variant][1]["t5"]
    assert ours.dtype == np.float32 and ours.shape == text["prompt_embeds"].shape
    np.testing.assert_allclose(ours, text["prompt_embeds"], rtol=0, atol=1e-4)


def test_t5_config_follows_transformers_and_refuses_what_it_lacks():
    base = dict(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    config = t5.T5Config.from_dict({**base, "feed_forward_proj": "gated-gelu"})
    assert (config.dense_act_fn, config.is_gated_act) == ("gelu_new", True)
    assert (t5.T5Config.from_dict(base).dense_act_fn, t5.T5Config.from_dict(base).is_gated_act) == ("relu", False)
    # saved values of dense_act_fn and is_gated_act win over feed_forward_proj, as in transformers
    saved = t5.T5Config.from_dict({**base, "feed_forward_proj": "gated-gelu", "dense_act_fn": "relu",
                                   "is_gated_act": False})
    assert (saved.dense_act_fn, saved.is_gated_act) == ("relu", False)
    for key, value in (("feed_forward_proj", "gated-mish"), ("dense_act_fn", "mish"), ("model_type", "umt5"),
                       ("pruned_heads", {"0": [1]}), ("num_heads", 0), ("layer_norm_epsilon", -1),
                       ("feed_forward_proj", "gelu-gated")):
        with pytest.raises(ValueError, match=key):
            t5.T5Config.from_dict({**base, key: value})


# ---- CLIP (our own, pooled at the end token)

@pytest.mark.parametrize("variant", VARIANTS)
def test_clip_pooled_output_matches_transformers(loaded, probed, variant):
    np.testing.assert_allclose(probed[variant][1]["pooled"], loaded[variant][2]["pooled_prompt_embeds"], rtol=0,
                               atol=1e-5)


# ---- the transformer

@pytest.mark.parametrize("variant", VARIANTS)
def test_transformer_matches_diffusers(probed, variant):
    """The first transformer call: within 1e-3 (the largest difference is about 4e-5);
    schnell without guidance at 24x40, dev with guidance 3.5 at 32x32 (the end-to-end
    tests, test_flux_sampling.py, cover every case)."""
    case, outputs, _ = probed[variant]
    np.testing.assert_allclose(outputs["transformer"], case["transformer_output_0"], rtol=0, atol=1e-3)


def test_packing_and_position_ids_are_diffusers(loaded):
    case = next(c for c in cases("schnell") if "transformer_input_0" in c)
    np.testing.assert_array_equal(np.asarray(patching.pack_latents(case["latents"])), case["transformer_input_0"])
    np.testing.assert_array_equal(np.asarray(patching.pack_latents(jnp.asarray(case["latents"]))),
                                  case["transformer_input_0"])
    rows, cols = case["latents"].shape[2:]
    np.testing.assert_array_equal(patching.unpack_latents(case["transformer_input_0"], rows, cols), case["latents"])
    ids = flux.latent_image_ids(rows // 2, cols // 2)
    assert ids.dtype == np.float32 and ids.shape == (rows // 2 * cols // 2, 3)
    assert ids[cols // 2 + 1].tolist() == [0, 1, 1] and ids[-1].tolist() == [0, rows // 2 - 1, cols // 2 - 1]
    _, _, text = loaded["schnell"]
    np.testing.assert_array_equal(flux.text_ids(16), text["txt_ids"])


def test_rotary_tables_traced_and_on_the_host_agree():
    ids = np.concatenate([flux.text_ids(3), flux.latent_image_ids(64, 64)])
    host = rotary.rotary_tables(ids, (16, 56, 56))
    traced = jax.jit(lambda i: rotary.rotary_tables(i, (16, 56, 56)))(ids)
    for a, b in zip(host, traced):
        assert a.shape == (ids.shape[0], 128) and a.dtype == np.float32
        np.testing.assert_allclose(np.asarray(b), a, rtol=0, atol=5e-5)


def test_transformer_attends_through_the_seam(probed):
    """Under ``attention.use`` every attention call of the transformer goes through the seam's
    kernel with the same result (``test_transformer_matches_diffusers``); outside one,
    through XLA's."""
    case, _, calls = probed["dev"]
    tokens = 24 + (int(case["height"]) // 4) * (int(case["width"]) // 4)
    assert {(c.site, c.kernel, c.batch, c.q_tokens, c.kv_tokens, c.heads, c.head_dim) for c in calls} == \
        {("flux", "chunked", 2, tokens, tokens, 2, 12)}
    assert len(calls) >= 2  # the double and the single blocks' attention
    assert attention.query_blocks(2, 2, tokens, tokens, 4, CHUNK_BUDGET)[0] > 1  # chunked for real
    assert probed["schnell"][2] == []


def test_bf16_transformer_stays_close(loaded):
    """A smoke check of bf16: the transformer with bf16 weights and compute (its norms and
    rotation in float32), within bf16's rounding of the float32 PyTorch output."""
    nets, params, text = loaded["schnell"]
    case = dict(np.load(os.path.join(FIXTURES, "schnell-g0-s1-32x32.npz")))
    rows, cols = int(case["height"]) // 2, int(case["width"]) // 2
    transformer = flux.FluxTransformer(nets.transformer.config, jnp.bfloat16)
    cast = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), params["transformer"])
    velocity = jax.jit(transformer.apply)(
        {"params": cast}, patching.pack_latents(case["latents"]), text["prompt_embeds"], text["pooled_prompt_embeds"],
        case["transformer_timestep"][0], flux.latent_image_ids(rows // 2, cols // 2),
        flux.text_ids(text["t5_ids"].shape[1]))
    assert velocity.dtype == jnp.bfloat16
    reference = case["transformer_output_0"]
    error = np.abs(np.asarray(velocity, np.float32) - reference)
    assert error.mean() < 0.02 * np.abs(reference).mean() and error.max() < 0.1 * np.abs(reference).max()


def test_transformer_refuses_a_guidance_it_cannot_use(loaded):
    nets, params, text = loaded["schnell"]
    args = (np.zeros((1, 4, 64), np.float32), text["prompt_embeds"][:1], text["pooled_prompt_embeds"][:1],
            np.ones(1, np.float32), flux.latent_image_ids(2, 2), flux.text_ids(16))
    with pytest.raises(ValueError, match="guidance_embeds"):
        nets.transformer.apply({"params": params["transformer"]}, *args, guidance=np.ones(1, np.float32))
    dev = flux.FluxTransformer(loaded["dev"][0].transformer.config)
    with pytest.raises(ValueError, match="guidance"):
        dev.apply({"params": loaded["dev"][1]["transformer"]}, *args)


def test_flux_config_defaults_are_flux1_and_unsupported_values_are_refused():
    config = flux.FluxConfig.from_dict({"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.30.0"})
    assert (config.num_layers, config.num_single_layers, config.inner_dim, config.out_channels) == (19, 38, 3072, 64)
    assert flux.FluxConfig.from_dict({"out_channels": 16, "in_channels": 384}).out_channels == 16
    for key, value in (("patch_size", 2), ("axes_dims_rope", [16, 56, 58]), ("axes_dims_rope", [15, 57, 56]),
                       ("_class_name", "Flux2Transformer2DModel"), ("guidance_embeds", "yes"),
                       ("num_attention_heads", 0)):
        with pytest.raises(ValueError, match=key):
            flux.FluxConfig.from_dict({key: value})


# ---- the VAE

@pytest.mark.parametrize("variant", VARIANTS)
def test_vae_decode_matches_diffusers(probed, variant):
    """The last step's latents decoded, shifted and postprocessed: FluxPipeline's float
    images within 0.01 of a level."""
    case, outputs, _ = probed[variant]
    assert outputs["images"].shape == case["images_float"].shape
    np.testing.assert_allclose(outputs["images"] * 255, case["images_float"] * 255, rtol=0, atol=0.01)


def test_vae_config_refuses_what_the_decoder_does_not_do():
    config = json.load(open(os.path.join(FIXTURES, "schnell", "vae", "config.json")))
    parsed = vae.VaeConfig.from_dict(config)
    assert (parsed.latent_channels, parsed.scale_factor, parsed.use_post_quant_conv) == (16, 2, False)
    assert (parsed.scaling_factor, parsed.shift_factor) == (0.3611, 0.1159)
    # what FluxPipeline's decode never reads is no reason to refuse
    vae.VaeConfig.from_dict({**config, "force_upcast": False, "latents_mean": [0.0] * 16, "sample_size": 1024})
    # a post-quant conv, where a config has one, is decoded through and loaded by diffusers' names
    with_conv = vae.VaeConfig.from_dict({**config, "use_post_quant_conv": True})
    assert vae.NETWORK.param_shapes(with_conv)[("post_quant_conv", "kernel")] == (1, 1, 16, 16)
    assert ("post_quant_conv", "kernel") not in vae.NETWORK.param_shapes(parsed)
    stored = state("schnell", "vae")
    conv = {"post_quant_conv.weight": np.ones((16, 16, 1, 1), np.float32), "post_quant_conv.bias": np.zeros(16)}
    converted = vae.NETWORK.from_torch({**stored, **conv}, with_conv, "vae")
    assert converted["post_quant_conv"]["kernel"].shape == (1, 1, 16, 16)
    with pytest.raises(weights.WeightsError, match="missing.*post_quant_conv"):
        vae.NETWORK.from_torch(stored, with_conv, "vae")
    # a mid block without its attention is decoded without it
    plain = vae.VaeConfig.from_dict({**config, "mid_block_add_attention": False})
    assert not any("attentions" in path for path in vae.NETWORK.param_shapes(plain))
    assert any("attentions" in path for path in vae.NETWORK.param_shapes(parsed))
    for key, value in (("act_fn", "gelu"), ("mid_block_add_attention", "no"), ("shift_factor", None),
                       ("up_block_types", ["UpDecoderBlock2D", "AttnUpDecoderBlock2D"]), ("norm_num_groups", 3),
                       ("_class_name", "AutoencoderDC"), ("scaling_factor", 0)):  # FLUX.2's is a variant
        with pytest.raises(ValueError, match=key):
            vae.VaeConfig.from_dict({**config, key: value})


# ---- conversion

@pytest.mark.parametrize("variant", VARIANTS)
def test_conversion_keeps_the_stored_dtype_and_round_trips(loaded, variant):
    nets, _, _ = loaded[variant]
    for component, network, config in (("text_encoder_2", t5.NETWORK, nets.t5.config),
                                       ("transformer", flux.NETWORK, nets.transformer.config)):
        stored = state(variant, component)
        params = network.from_torch(stored, config, component)
        leaves = jax.tree_util.tree_leaves(params)
        assert {leaf.dtype.name for leaf in leaves} == {STORED[variant]}
        assert all(isinstance(leaf, np.ndarray) for leaf in leaves)  # on the host, not on a device
        back = network.to_torch(params)
        assert sorted(back) == sorted(stored)
        for name, array in stored.items():
            assert back[name].dtype == array.dtype and np.array_equal(back[name], array), name
    stacked = flux.NETWORK.from_torch(state(variant, "transformer"), nets.transformer.config,
                                      "transformer")["transformer_blocks"]
    assert stacked["attn"]["to_q"]["kernel"].shape == (2, 24, 24)
    np.testing.assert_array_equal(stacked["attn"]["to_q"]["kernel"][1],
                                  state(variant, "transformer")["transformer_blocks.1.attn.to_q.weight"].T)
    decoder = vae.NETWORK.from_torch(state(variant, "vae"), nets.vae.config, "vae")
    assert {leaf.dtype.name for leaf in jax.tree_util.tree_leaves(decoder)} == {STORED[variant]}


def test_conversion_names_the_weight_it_refuses(loaded):
    nets, _, _ = loaded["schnell"]
    stored = state("schnell", "transformer")
    config = nets.transformer.config
    missing = {k: v for k, v in stored.items() if k != "single_transformer_blocks.1.proj_mlp.bias"}
    with pytest.raises(weights.WeightsError, match=r"missing.*single_transformer_blocks\.1\.proj_mlp\.bias"):
        flux.NETWORK.from_torch(missing, config, "transformer")
    odd = {**stored, "x_embedder.weight": np.zeros((24, 63), np.float32)}
    with pytest.raises(weights.WeightsError, match=r"x_embedder\.weight has shape \(24, 63\).*\(24, 64\)"):
        flux.NETWORK.from_torch(odd, config, "transformer")
    extra = {**stored, "transformer_blocks.2.attn.to_q.weight": stored["transformer_blocks.0.attn.to_q.weight"]}
    with pytest.raises(weights.WeightsError, match=r"does not have.*transformer_blocks\.2\.attn\.to_q\.weight"):
        flux.NETWORK.from_torch(extra, config, "transformer")
    t5_state = state("schnell", "text_encoder_2")
    # the tied embedding may be saved under either name; a T5ForConditionalGeneration's decoder is skipped
    renamed = {("encoder.embed_tokens.weight" if k == "shared.weight" else k): v for k, v in t5_state.items()}
    assert t5.NETWORK.from_torch({**renamed, "decoder.final_layer_norm.weight": np.ones(16)}, nets.t5.config,
                                 "text_encoder_2")
    with pytest.raises(weights.WeightsError, match=r"missing.*relative_attention_bias"):
        t5.NETWORK.from_torch({k: v for k, v in t5_state.items() if "relative_attention_bias" not in k},
                              nets.t5.config, "text_encoder_2")
    with pytest.raises(weights.WeightsError, match=r"decoder\.up_blocks\.0\.resnets\.0\.conv1\.weight has shape"):
        vae.NETWORK.from_torch({**state("schnell", "vae"), "decoder.up_blocks.0.resnets.0.conv1.weight":
                                np.zeros((8, 8, 3, 1), np.float32)}, nets.vae.config, "vae")


def test_sharded_safetensors_read_through_their_index(tmp_path):
    """A checkpoint split as save_pretrained splits it (shards plus ``*.safetensors.index.json``
    and its weight_map) reads as the single file does; a missing shard, or an index putting a
    weight in a shard without it, is named."""
    stored = state("schnell", "transformer")
    names = sorted(stored)
    folder = tmp_path / "transformer"
    halves = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[:len(names) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        weights.write_safetensors(str(folder / file), {name: stored[name] for name in part}, align=False)
    index = {"metadata": {"total_size": 1}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    read = weights.read_safetensors_weights(str(folder), "diffusers")
    assert sorted(read) == names and all(np.array_equal(read[n], stored[n]) and read[n].dtype == stored[n].dtype
                                         for n in names)
    assert not any(read[n].flags.writeable for n in names)  # views of the read-only mapped files, not copies
    wrong = {**index, "weight_map": {**index["weight_map"], names[0]: list(halves)[1]}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(wrong))
    with pytest.raises(weights.WeightsError, match=names[0].replace(".", r"\.")):
        weights.read_safetensors_weights(str(folder), "diffusers")
    os.remove(folder / list(halves)[1])
    with pytest.raises(weights.WeightsError, match="00002-of-00002.safetensors is missing"):
        weights.read_sharded(str(folder), "diffusion_pytorch_model.safetensors.index.json")
    with pytest.raises(weights.WeightsError, match="no PyTorch safetensors"):
        weights.read_safetensors_weights(str(tmp_path), "transformers")


def test_the_naming_rule():
    names = convert.TorchNames(stacks=("transformer_blocks",), moved={"a/b/embedding": "x.y.weight"})
    assert convert.torch_name(("transformer_blocks", "attn", "to_out", "0", "kernel"), names, 7) == \
        "transformer_blocks.7.attn.to_out.0.weight"
    assert convert.torch_name(("norm_out", "linear", "bias"), names) == "norm_out.linear.bias"
    assert convert.torch_name(("a", "b", "embedding"), names) == "x.y.weight"
    assert convert.torch_shapes({("transformer_blocks", "ff", "kernel"): (3, 4, 5)}, names) == \
        {f"transformer_blocks.{i}.ff.weight": (5, 4) for i in range(3)}
