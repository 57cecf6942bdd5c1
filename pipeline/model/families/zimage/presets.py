"""Built-in random Z-Image models, saved as diffusers' ``ZImagePipeline.save_pretrained``
lays a checkpoint out: ``--model tiny-zimage``, ``random-zimage``.

- ``tiny-zimage``: Z-Image's architecture (a Qwen3 ``Qwen3Model`` text encoder, read at its
  second-to-last layer; ``ZImageTransformer2DModel``: refiners, single-stream blocks,
  learned pad tokens; FLUX.1's 16-channel-style ``AutoencoderKL``, here 4 channels; the
  Turbo scheduler) at sizes that compile in seconds on a CPU: a 4-layer Qwen3 of width 16
  (head_dim 8, 4 heads, 2 KV heads), a transformer of width 32 (2 heads of 16), 1 refiner
  layer each side and 2 main layers, a 2-block VAE (scale factor 2: sizes are multiples
  of 4).
- ``random-zimage``: Z-Image-Turbo's real sizes, configs and tokenizer only (shapes, for the
  TPU check and FLOP counts): ``ZImageTransformer2DModel``'s defaults in diffusers 0.39,
  which are Tongyi-MAI/Z-Image-Turbo's transformer (dim 3840, 30 layers, 2 refiner layers,
  30 heads, cap_feat_dim 2560, axes_dims 32/48/48, axes_lens 1024/512/512: 6.15B
  parameters), Qwen/Qwen3-4B as ``Qwen3Model`` (hidden 2560, 36 layers, 32 heads, 8 KV
  heads, head_dim 128, intermediate 9728, vocabulary 151,936), FLUX.1's VAE (16 latent
  channels, blocks 128-256-512-512, scaling 0.3611, shift 0.1159, no quant convs) and the
  Turbo scheduler config (FlowMatchEulerDiscreteScheduler, shift 3.0, no dynamic shifting).
  Apache-2.0.

Weights are random, drawn leaf by leaf from a fixed seed and the parameter's name
(``builtin.random_flat_params``), the pad tokens too (not zero), stored float32 in
PyTorch's names and layouts: loading them takes the path a user's checkpoint takes. The
tokenizer is the shared byte-level Qwen tokenizer (``loading.qwen_tokenizer``).

Imports no jax at import time (the torch-only fixture script builds pipelines from it).
"""
from __future__ import annotations


from pipeline.model.families import qwen_presets
from pipeline.model.loading import builtin
from pipeline.model.sampling import flow

SEED = 0
TOKENIZER_MAX_LENGTH = 512  # ZImagePipeline's default max_sequence_length
# Z-Image-Turbo's scheduler config (every key at diffusers 0.39's names)
TURBO_SCHEDULER = dict(flow.DEFAULTS, shift=3.0)
_TINY_QWEN3 = dict(qwen_presets.TINY_QWEN3, num_hidden_layers=4)
_TINY_TRANSFORMER = dict(all_patch_size=[2], all_f_patch_size=[1], in_channels=4, dim=32, n_layers=2,
                         n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16,
                         siglip_feat_dim=None, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6],
                         axes_lens=[1024, 64, 64])
_TINY_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                 up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
                 act_fn="silu", latent_channels=4, norm_num_groups=8, sample_size=32, scaling_factor=0.3611,
                 shift_factor=0.1159, latents_mean=None, latents_std=None, force_upcast=True, use_quant_conv=False,
                 use_post_quant_conv=False, mid_block_add_attention=True)
_TURBO_TRANSFORMER = dict(_TINY_TRANSFORMER, in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30,
                          n_kv_heads=30, cap_feat_dim=2560, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])
_FLUX_VAE = dict(_TINY_VAE, down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                 block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=16, norm_num_groups=32,
                 sample_size=1024)

# Built-in random models, by --model name. Bump a name's version when its recipe changes.
PRESETS = {
    "tiny-zimage": dict(version="tiny-zimage-v2", default_size=32, weights_dtype="float32", qwen3=_TINY_QWEN3,
                        transformer=_TINY_TRANSFORMER, vae=_TINY_VAE, scheduler=TURBO_SCHEDULER),
    "random-zimage": dict(version="random-zimage-v2", weights_dtype="bfloat16", qwen3=qwen_presets.QWEN3_4B,
                          transformer=_TURBO_TRANSFORMER, vae=_FLUX_VAE, scheduler=TURBO_SCHEDULER,
                          license="apache-2.0", shapes_only=True),
}


# how ZImagePipeline.save_pretrained lays a checkpoint out
CHECKPOINT = qwen_presets.Checkpoint("ZImagePipeline", text_encoder="Qwen3Model",
                                     transformer="ZImageTransformer2DModel", vae="AutoencoderKL")


def build(directory: str, name: str = "tiny-zimage", weights: bool = True) -> None:
    """Write the random model ``name`` into ``directory`` in diffusers' ZImagePipeline
    layout. ``weights=False``: configs and tokenizer only."""
    from pipeline.model.families.zimage import transformer as zimage

    qwen_presets.write(directory, name, PRESETS[name], CHECKPOINT.model_index(), checkpoint=CHECKPOINT,
                       transformer=(zimage.NETWORK, zimage.ZImageConfig), seed=SEED, weights=weights)


def ensure(name: str, shapes: bool = False) -> str:
    """The folder of the built-in model ``name``, built once per machine (``builtin.ensure_preset``)."""
    return builtin.ensure_preset(PRESETS, name, build, shapes)
