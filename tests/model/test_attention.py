"""The attention seam: kernel choice, and every CPU-runnable kernel against the whole matrix.

``xla`` is checked against attention written out in numpy (self, cross, causal, bf16); the
tiny models' whole UNet and VAE then check chunked and flash against the networks outside a
seam (``xla``), all variants of a network in one jitted program, so each model compiles
once. Chunked runs with a budget small enough that every call splits into several query
blocks (uneven ones included), and the Pallas kernel, interpreted, with 128-token blocks,
so a 256-token call spans 2 x 2 blocks and 77 text tokens are padded and masked. CLIP's
causal attention runs through every kernel too.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model.layers import attention
from pipeline.model import load as model_lib
from pipeline.generate.spec import ProgramSpec

MiB = 2 ** 20
BUDGET = 64 * 1024  # bytes of scores per chunk in the parity tests: 4 rows of the largest call
BLOCK = 128  # the Pallas kernel's smallest block
VARIANTS = ("chunked", "flash")  # xla: test_xla_is_attention_written_out


@pytest.mark.parametrize("requested,platform,q,kv,heads,head_dim,batch,dtype_bytes,expected", [
    # asked for by name: taken as asked, everywhere
    ("xla", "tpu", 16384, 16384, 8, 40, 2, 4, "xla"),
    ("chunked", "cpu", 64, 64, 8, 40, 2, 4, "chunked"),
    ("chunked", "cuda", 4096, 4096, 8, 64, 2, 2, "chunked"),
    # flash: the Pallas kernel on TPU (and interpreted on CPU), cuDNN on GPU where it fits
    ("flash", "tpu", 64, 77, 8, 160, 2, 2, "pallas"),
    ("flash", "cpu", 256, 256, 8, 4, 2, 4, "pallas"),
    ("flash", "gpu", 4096, 77, 8, 64, 2, 2, "cudnn"),
    ("flash", "gpu", 4096, 4096, 8, 64, 2, 4, "chunked"),  # cuDNN takes no float32: the memory rule
    ("flash", "gpu", 256, 256, 8, 160, 2, 2, "xla"),  # head dim above 128
    # auto on TPU: the kernel from 4096 query and key tokens on
    ("auto", "tpu", 4096, 4096, 8, 40, 2, 2, "pallas"),
    ("auto", "tpu", 4096, 4096, 1, 512, 1, 4, "pallas"),  # the VAE at 512x512
    ("auto", "tpu", 1024, 1024, 8, 80, 2, 2, "xla"),
    ("auto", "tpu", 4096, 77, 8, 40, 2, 2, "xla"),  # cross-attention: a small matrix
    ("auto", "tpu", 2048, 2048, 8, 40, 64, 4, "chunked"),  # short but over the budget
    # auto on GPU: cuDNN where it fits, else the memory rule
    ("auto", "gpu", 4096, 4096, 8, 40, 2, 2, "cudnn"),
    ("auto", "rocm", 256, 77, 8, 64, 2, 2, "cudnn"),
    ("auto", "gpu", 4096, 4096, 8, 4, 2, 2, "chunked"),  # head dim not a multiple of 8
    ("auto", "gpu", 64, 64, 8, 40, 2, 4, "xla"),
    # auto on CPU: chunked above its budget (16 MiB: cache-sized blocks); exactly at it, xla
    ("auto", "cpu", 4096, 4096, 8, 40, 2, 4, "chunked"),
    ("auto", "cpu", 4096, 77, 8, 40, 2, 4, "chunked"),
    ("auto", "cpu", 1024, 77, 8, 40, 2, 4, "xla"),
    ("auto", "cpu", 1024, 1024, 8, 80, 2, 4, "chunked"),
    ("auto", "cpu", 512, 512, 8, 80, 2, 4, "xla"),  # 2 * 8 * 512^2 * 4 bytes = 16 MiB
    ("auto", "cpu", 512, 513, 8, 80, 2, 4, "chunked"),
    ("auto", "tpu", 2048, 2048, 8, 80, 2, 4, "xla"),  # 256 MiB: the TPU's budget
])
def test_choose(requested, platform, q, kv, heads, head_dim, batch, dtype_bytes, expected):
    assert attention.choose(requested, platform, q, kv, heads, head_dim, batch=batch,
                            dtype_bytes=dtype_bytes) == expected


def test_choose_follows_the_budget_and_refuses_unknown_names():
    args, sizes = ("cpu", 4096, 4096, 8, 40), dict(batch=2, dtype_bytes=4)  # a 1 GiB matrix
    assert attention.choose("auto", *args, **sizes, budget_bytes=1024 * MiB) == "xla"
    assert attention.choose("auto", *args, **sizes, budget_bytes=1024 * MiB - 1) == "chunked"
    with pytest.raises(ValueError, match="attention must be one of"):
        attention.choose("splash", *args, **sizes)
    with pytest.raises(ValueError, match="unknown platform"):
        attention.choose("auto", "metal", *args[1:], **sizes)


def test_flash_is_refused_for_jobs_on_cpu(tmp_path, capsys):
    attention.check_platform("flash", "tpu")
    attention.check_platform("flash", "cuda")
    for name in ("auto", "xla", "chunked"):
        attention.check_platform(name, "cpu")
    with pytest.raises(ValueError, match="--attention flash needs a TPU"):
        attention.check_platform("flash", "cpu")
    # every host, beam worker and reproduce builds a Generator: refused there before any work
    from pipeline.generate.generator import Generator

    with pytest.raises(ValueError, match="--attention flash needs a TPU"):
        Generator(None, ProgramSpec(32, 32, 1, 1, attention="flash"))
    # a local run's hosts are CPU processes: refused before anything is planned or written
    from jobs import cli

    out = tmp_path / "out"
    assert cli.main(["run", "--attention", "flash", "--out", str(out), "--no-progress"]) == 1
    assert "--attention flash needs a TPU" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("batch,heads,q,kv,dtype_bytes,budget", [
    (2, 8, 4096, 4096, 4, 256 * MiB), (2, 8, 16384, 16384, 4, 256 * MiB), (1, 1, 16384, 16384, 2, 256 * MiB),
    (2, 8, 256, 77, 4, BUDGET), (2, 8, 257, 256, 4, BUDGET), (2, 8, 64, 64, 4, 10 ** 9), (2, 8, 64, 64, 4, 1)])
def test_query_blocks_are_the_fewest_that_fit(batch, heads, q, kv, dtype_bytes, budget):
    blocks, rows = attention.query_blocks(batch, heads, q, kv, dtype_bytes, budget)
    row = attention.score_bytes(batch, heads, 1, kv, dtype_bytes)
    assert blocks * rows >= q > (blocks - 1) * rows  # every row, and no empty block
    assert rows == 1 or rows * row <= budget
    fewer = blocks - 1
    assert fewer == 0 or -(-q // fewer) * row > budget  # one block fewer would not fit


def _qkv(shape, kv_tokens, seed=0, dtype=jnp.float32):
    batch, q_tokens, heads, head_dim = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], shape)
    k, v = (jax.random.normal(key, (batch, kv_tokens, heads, head_dim)) for key in keys[1:])
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def test_kernels_on_awkward_shapes():
    """Uneven query blocks; for the Pallas kernel, queries and keys padded to whole blocks
    (2 x 2 of them), padded keys masked, a head dim above 128 padded to 256."""
    q, k, v = _qkv((1, 130, 2, 160), 200)
    scale = 160 ** -0.5
    reference = attention.attend(q, k, v, scale, "xla")
    budget = 2 * 200 * 4 * 9  # 9 rows of scores
    chunked = jax.jit(lambda q, k, v: attention.attend(q, k, v, scale, "chunked", budget_bytes=budget))(q, k, v)
    assert attention.query_blocks(1, 2, 130, 200, 4, budget) == (15, 9)  # 135 rows, 5 of them padding
    np.testing.assert_allclose(chunked, reference, atol=1e-6)
    pallas = jax.jit(lambda q, k, v: attention.attend(q, k, v, scale, "pallas", block_tokens=BLOCK, interpret=True))
    np.testing.assert_allclose(pallas(q, k, v), reference, atol=1e-5)


def _dot_batching_dims(platform: str) -> set[str]:
    """The batching dims of every product in a seam's xla attention (the tiny UNet's shape),
    as lowered for ``platform``."""
    import re

    q, k, v = _qkv((2, 256, 8, 4), 77)

    def call(q, k, v):
        with attention.use("xla", platform=platform):
            return attention.compute("unet", q, k, v, 0.5)

    text = jax.jit(call).lower(q, k, v).as_text()
    return set(re.findall(r"batching_dims = (\[[^]]*\] x \[[^]]*\])", text))


def test_on_cpu_xla_runs_its_products_heads_first_within_rounding_of_the_other_layout():
    """On CPU devices the xla kernel lays q, k, v out [batch, heads, tokens, head_dim] before
    its products (XLA:CPU runs the [batch, tokens, heads, head_dim] products of many small
    heads several times slower); the TPU program keeps its layout. Both agree within
    float rounding."""
    assert _dot_batching_dims("cpu") == {"[0, 1] x [0, 1]"}
    assert _dot_batching_dims("tpu") == {"[0, 2] x [0, 2]", "[0, 2] x [0, 1]"}
    q, k, v = _qkv((2, 256, 8, 4), 77, seed=2)
    for kernel in ("xla", "chunked"):  # chunked in one block is xla
        first = attention.attend(q, k, v, 0.5, kernel, heads_first=True)
        np.testing.assert_allclose(first, attention.attend(q, k, v, 0.5, kernel), atol=1e-6)


def test_bf16_kernels_stay_within_bf16_rounding():
    """In bf16, xla and chunked compute scores and softmax in bf16, as PyTorch does; the
    Pallas kernel keeps scores and its running sums in float32. All stay within a few
    bf16 roundings of the float32 result."""
    q, k, v = _qkv((2, 256, 2, 64), 256, seed=1)
    exact = attention.attend(q, k, v, 0.125, "xla")
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    for kernel, options in [("xla", {}), ("chunked", {"budget_bytes": BUDGET}),
                            ("pallas", {"block_tokens": BLOCK, "interpret": True})]:
        out = jax.jit(lambda q, k, v: attention.attend(q, k, v, 0.125, kernel, **options))(*bf16)
        assert out.dtype == jnp.bfloat16
        error = np.abs(np.asarray(out, np.float32) - np.asarray(exact))
        assert 0 < error.max() < 0.05, kernel  # really bf16; a bf16 step at 1 is 1/128


def _written_out(q, k, v, scale, causal=False):
    """softmax(q k^T scale) v in float64 numpy, q, k, v [batch, tokens, heads, head_dim]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2 ** -5)])
def test_xla_is_attention_written_out(dtype, tolerance):
    """``xla`` is softmax(q k^T scale) v: self-attention, cross-attention (77 keys), causal
    (CLIP's), in both layouts; bf16 within bf16 roundings."""
    for q_tokens, kv_tokens, causal in ((64, 64, False), (64, 77, False), (77, 77, True)):
        q, k, v = _qkv((2, q_tokens, 2, 16), kv_tokens, seed=q_tokens, dtype=dtype)
        expected = _written_out(q, k, v, 0.25, causal)
        for heads_first in (False, True):
            out = attention.attend(q, k, v, 0.25, "xla", heads_first=heads_first, causal=causal)
            assert out.dtype == dtype
            np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tolerance)


def test_every_kernel_attends_causally():
    """CLIP's causal self-attention (query i sees keys 0..i) in every kernel: chunked blocks
    past the first see the keys up to their own rows, the Pallas kernel (interpreted, 77
    tokens padded to 128) and cuDNN's call (on XLA here) their own causal masks."""
    q, k, v = _qkv((2, 77, 4, 8), 77, seed=5)
    expected = _written_out(q, k, v, 0.3, causal=True)
    found = {kernel: attention.attend(q, k, v, 0.3, kernel, budget_bytes=2 * 4 * 77 * 4 * 10, interpret=True,
                                      causal=True) for kernel in ("xla", "chunked", "pallas")}
    found["cudnn-call"] = attention._cudnn(q, k, v, 0.3, implementation=None, causal=True)
    found["compute"] = attention.compute("text_encoder", q, k, v, 0.3, causal=True)
    assert attention.query_blocks(2, 4, 77, 77, 4, 2 * 4 * 77 * 4 * 10)[0] > 1  # chunked really chunks
    for kernel, out in found.items():
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, err_msg=kernel)
    assert np.abs(np.asarray(found["xla"]) - np.asarray(attention.attend(q, k, v, 0.3, "xla"))).max() > 0.1


def test_the_seam_ends_with_its_block():
    from pipeline.model.families.sd.unet import Attention

    module = Attention(heads=2, head_dim=16)
    x = jax.ShapeDtypeStruct((1, 8, 32), jnp.float32)
    params = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)
    with attention.use("chunked", platform="cpu") as calls:
        jax.eval_shape(module.apply, params, x)  # tracing is enough: the seam acts while tracing
    jax.eval_shape(module.apply, params, x)
    assert calls == [attention.Call("unet", 1, 8, 8, 2, 16, "float32", "chunked")]
    assert attention.summary(calls * 3) == [{**dataclasses.asdict(calls[0]), "count": 3}]
    with pytest.raises(ValueError, match="attention must be one of"):
        with attention.use("fast"):
            pass


def test_own_networks_attend_through_the_active_seam_and_xla_outside_one():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 40, 2, 8)), jnp.float32) for _ in range(3))
    plain = attention.compute("flux", q, k, v, 0.5)  # no seam: xla
    np.testing.assert_allclose(plain, attention.attend(q, k, v, 0.5, "xla"), atol=0)
    with attention.use("chunked", platform="cpu", budget_bytes=2 * 40 * 4 * 8) as calls:
        chunked = attention.compute("flux", q, k, v, 0.5)
        with attention.use("xla", platform="cpu") as inner:
            attention.compute("t5", q, k, v, None)
        attention.compute("flux", q, k, v, 0.5)  # the outer seam again
    assert [c.site for c in inner] == ["t5"] and [c.kernel for c in inner] == ["xla"]
    assert [(c.site, c.kernel) for c in calls] == [("flux", "chunked")] * 2
    np.testing.assert_allclose(chunked, plain, atol=1e-6)
    attention.compute("flux", q, k, v, 0.5)
    assert len(calls) == 2  # the block has ended


def test_a_recorder_sees_the_calls_of_every_seam_traced_inside_it():
    q = jnp.zeros((1, 8, 2, 4), jnp.float32)
    with attention.record() as recorded:
        with attention.use("xla", platform="cpu"):
            attention.compute("flux", q, q, q, 1.0)
        attention.compute("t5", q, q, q, 1.0)  # no seam: nothing to record
        with attention.use("chunked", platform="cpu"):
            attention.compute("flux", q, q, q, 1.0)
    with attention.use("xla", platform="cpu"):
        attention.compute("flux", q, q, q, 1.0)
    assert [c.kernel for c in recorded] == ["xla", "chunked"]


def _options(variant):
    return {"chunked": {"budget_bytes": BUDGET}, "flash": {"block_tokens": BLOCK}}.get(variant, {})


def _network_outputs(model, size, decode):
    """{variant: (UNet output, decoded images or None)} outside a seam ("xla") and for each
    of ``VARIANTS``, all in one program; and {variant: [Call]}."""
    from pipeline.model.layers import vae

    rng = np.random.default_rng(0)
    unet, config = model.nets.unet, model.nets.unet.config
    batch = 2
    latents = jnp.asarray(rng.standard_normal((batch, *model.latent_shape(size, size))), jnp.float32)
    context = jnp.asarray(rng.standard_normal((batch, 77, config.cross_attention_dim)), jnp.float32)
    added = {}
    if model.family.name == "sdxl":
        added = {"text_embeds": jnp.asarray(rng.standard_normal((batch, config.pooled_dim)), jnp.float32),
                 "time_ids": jnp.full((batch, 6), float(size))}
    calls = {}

    def networks(params, latents, context, added):
        prediction = unet.apply({"params": params["unet"]}, latents, jnp.array([500, 500]), context, **added)
        if not decode:
            return prediction, None
        return prediction, vae.vae_decode(model.nets.vae, params["vae"], latents, model.nets.vae.config)

    def everything(params, latents, context, added):
        outputs = {"xla": networks(params, latents, context, added)}
        for variant in VARIANTS:
            with attention.use(variant, platform="cpu", **_options(variant)) as calls[variant]:
                outputs[variant] = networks(params, latents, context, added)
        return outputs

    # XLA's backend optimisation off: these tests compare kernels, not XLA's optimiser, and
    # the program (three UNets) compiles a third faster
    compiled = jax.jit(everything).lower(model.params, latents, context, added).compile(
        {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True})
    outputs = compiled(model.params, latents, context, added)
    return jax.tree_util.tree_map(np.asarray, outputs), calls


@pytest.fixture(scope="module")
def tiny_model(model_cache):
    return model_lib.load("tiny")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return _network_outputs(tiny_model, 32, decode=True)


@pytest.fixture(scope="module")
def tiny_sdxl(model_cache):
    # 64x64: its attention sits one level down, at 16x16 = 256 tokens (its VAE is the tiny's)
    return _network_outputs(model_lib.load("tiny-sdxl"), 64, decode=False)


@pytest.mark.parametrize("name", ["tiny", "tiny_sdxl"])
def test_every_kernel_matches_the_whole_matrix(request, name):
    outputs, calls = request.getfixturevalue(name)
    reference, _ = outputs["xla"]
    assert np.abs(reference).max() > 0.5  # a real prediction, not zeros
    for variant in VARIANTS:
        np.testing.assert_allclose(outputs[variant][0], reference, atol=1e-3, err_msg=variant)
    # the memory-efficient kernels really ran, in pieces
    self_attention = max(calls["chunked"], key=lambda call: call.q_tokens * call.kv_tokens)
    assert self_attention.q_tokens == self_attention.kv_tokens == 256
    assert {call.kernel for call in calls["chunked"]} == {"chunked"}
    assert all(attention.query_blocks(c.batch, c.heads, c.q_tokens, c.kv_tokens, 4, BUDGET)[0] > 1
               for c in calls["chunked"])
    assert {call.kernel for call in calls["flash"]} == {"pallas"}
    assert {256, 77} <= {call.kv_tokens for call in calls["flash"]}  # keys in 2 blocks; padded text tokens


def test_decoded_images_match_across_kernels(tiny):
    outputs, calls = tiny
    assert [(c.site, c.q_tokens) for c in calls["chunked"] if c.site == "vae"] == [("vae", 256)]
    images = {name: np.round(decoded * 255).astype(int) for name, (_, decoded) in outputs.items()}
    for variant in VARIANTS:
        np.testing.assert_allclose(outputs[variant][1], outputs["xla"][1], atol=1e-3, err_msg=variant)
        assert np.abs(images[variant] - images["xla"]).max() <= 1
    assert len(np.unique(images["xla"])) > 20  # images, not a flat colour


def test_chunked_attention_bounds_the_programs_memory(tiny_model):
    """XLA's memory analysis of the tiny UNet call (CFG batch 2) and VAE decode at 64x64:
    outside a seam (xla) each call holds its whole matrix (the largest, 2 x 8 x 1024^2
    float32, is 64 MiB), chunked one 1 MiB block of it."""
    from pipeline.bench import memory

    whole = memory.part_memory(tiny_model, 64, 64, 1, attention=None)
    chunked = memory.part_memory(tiny_model, 64, 64, 1, attention="chunked", platform="cpu", budget_bytes=MiB)
    assert whole["denoiser_call"]["temp"] > 64 * MiB > 8 * MiB > chunked["denoiser_call"]["temp"]
    assert chunked["vae_decode"]["temp"] <= whole["vae_decode"]["temp"]
    for part in ("denoiser_call", "vae_decode"):
        # the same weights and inputs, whatever the attention
        assert chunked[part]["argument"] == whole[part]["argument"] > 0
        assert chunked[part]["total"] == (chunked[part]["argument"] + chunked[part]["output"]
                                          - chunked[part]["alias"] + chunked[part]["temp"])
    assert memory.in_gib({"temp": 3 * 2 ** 29}) == {"temp": 1.5}


def test_every_kernel_hides_each_items_keys_from_its_length_on():
    """key_lengths: item i attends to its first n_i keys only, in every kernel (the Pallas
    kernel interpreted, cuDNN's call on XLA), as if its other keys were not there; the
    hidden keys' values do not matter."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pipeline.model.layers import attention

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 40, 2, 8)), jnp.float32) for _ in range(3))
    lengths = jnp.asarray([40, 33, 1], jnp.int32)
    expected = np.stack([np.asarray(attention._xla(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], 0.3))[0]
                         for i, n in enumerate([40, 33, 1])])
    garbage = k.at[2, 1:].set(1e4), v.at[1, 33:].set(1e6)  # what is hidden weighs nothing
    found = {kernel: attention.attend(q, *garbage, 0.3, kernel, budget_bytes=4 * 2 * 8 * 40, interpret=True,
                                      key_lengths=lengths) for kernel in ("xla", "chunked", "pallas")}
    found["cudnn-call"] = attention._cudnn(q, *garbage, 0.3, lengths, implementation=None)
    found["compute"] = attention.compute("x", q, *garbage, 0.3, key_lengths=lengths)
    assert attention.query_blocks(3, 2, 40, 40, 4, 4 * 2 * 8 * 40)[0] > 1  # chunked really chunks
    for kernel, out in found.items():
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, err_msg=kernel)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    per_device = attention.attend(q, *garbage, 0.3, "pallas", interpret=True, mesh=mesh, key_lengths=lengths)
    np.testing.assert_allclose(np.asarray(per_device), expected, atol=2e-5)
