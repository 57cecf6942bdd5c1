"""The shared VAE decoder's variants are config-driven: FLUX.1's AutoencoderKL (no quant
convs, scaling and shift) and FLUX.2's AutoencoderKLFlux2 (latents 2x2-patched and
normalised by a batch norm's running statistics, decoder channels of its own) are one
module. The FLUX.2 variant's decode is the plain decoder's on the latents un-normalised and
unpatched, as diffusers' FLUX.2 pipelines compute them (checked here with numpy)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model.layers import vae

TINY = dict(block_out_channels=[8, 16], decoder_block_out_channels=[16, 16], up_block_types=["UpDecoderBlock2D"] * 2,
            layers_per_block=1, norm_num_groups=8, latent_channels=4, batch_norm_eps=1e-3)


def patchify(latents):
    """diffusers' ``Flux2Pipeline._patchify_latents``, in numpy."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def test_the_flux2_config_is_a_variant_of_the_decoder():
    config = vae.VaeConfig.from_dict({"_class_name": "AutoencoderKLFlux2", **TINY})
    assert (config.patch_size, config.batch_norm_eps, config.latent_input_channels) == (2, 1e-3, 16)
    assert config.decoder_channels == (16, 16) and config.block_out_channels == (8, 16) and config.scale_factor == 2
    assert (config.scaling_factor, config.shift_factor, config.use_post_quant_conv) == (1.0, 0.0, True)
    assert vae.VaeConfig.from_dict({"_class_name": "AutoencoderKLFlux2"}).latent_channels == 32  # diffusers' default
    plain = vae.VaeConfig.from_dict({"_class_name": "AutoencoderKL", "shift_factor": 0.0,
                                     **{k: v for k, v in TINY.items() if k != "batch_norm_eps"}})
    assert plain.batch_norm_eps is None and plain.patch_size == 1
    with pytest.raises(ValueError, match="patch_size"):
        vae.VaeConfig.from_dict({"_class_name": "AutoencoderKLFlux2", **TINY, "patch_size": [1, 1]})
    with pytest.raises(ValueError, match="_class_name='AutoencoderDC' is neither"):
        vae.VaeConfig.from_dict({"_class_name": "AutoencoderDC"})
    shapes = vae.NETWORK.param_shapes(config)
    assert shapes[("bn", "running_mean")] == shapes[("bn", "running_var")] == (16,)
    assert ("bn", "running_mean") not in vae.NETWORK.param_shapes(plain)


def test_the_flux2_decode_unnormalises_and_unpatches_before_the_plain_decoder():
    config = vae.VaeConfig.from_dict({"_class_name": "AutoencoderKLFlux2", **TINY})
    plain = vae.VaeConfig.from_dict({"_class_name": "AutoencoderKL", **{k: v for k, v in TINY.items()
                                                                          if k != "batch_norm_eps"},
                                     "scaling_factor": 1.0, "shift_factor": 0.0})
    rng = np.random.default_rng(0)
    params = vae.VaeDecoder(config).init(jax.random.PRNGKey(1), jnp.zeros((1, 16, 2, 2)))["params"]
    mean, var = rng.normal(size=16).astype(np.float32), rng.uniform(0.5, 2.0, 16).astype(np.float32)
    params = {**params, "bn": {"running_mean": mean, "running_var": var}}  # statistics that are not 0 and 1
    patched = rng.normal(size=(2, 16, 3, 4)).astype(np.float32)
    images = vae.vae_decode(vae.VaeDecoder(config), params, patched, config)
    unnormalised = patched * np.sqrt(var + np.float32(1e-3))[None, :, None, None] + mean[None, :, None, None]
    latents = np.asarray(vae.unpatch(unnormalised, 2))
    np.testing.assert_array_equal(patchify(latents), unnormalised)  # unpatch is diffusers' patchify's inverse
    expected = vae.vae_decode(vae.VaeDecoder(plain), {k: v for k, v in params.items() if k != "bn"}, latents, plain)
    assert images.shape == (2, 12, 16, 3)
    np.testing.assert_allclose(np.asarray(images), np.asarray(expected), atol=1e-6)


def test_the_statistics_load_from_and_write_to_pytorch_names():
    config = vae.VaeConfig.from_dict({"_class_name": "AutoencoderKLFlux2", **TINY})
    params = jax.tree_util.tree_map(np.asarray, vae.VaeDecoder(config).init(jax.random.PRNGKey(2),
                                                                            jnp.zeros((1, 16, 1, 1)))["params"])
    state = vae.NETWORK.to_torch(params)
    assert state["bn.running_mean"].shape == (16,) and state["bn.num_batches_tracked"].dtype == np.int64
    back = vae.NETWORK.from_torch(state, config, "vae")
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
