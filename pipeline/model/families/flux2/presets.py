"""Built-in random FLUX.2 [klein] models, saved as diffusers' ``Flux2KleinPipeline.save_pretrained``
lays a checkpoint out: ``--model tiny-klein``, ...

- ``tiny-klein`` (distilled, ``is_distilled: true``) and ``tiny-klein-base`` (a base model,
  which guides): FLUX.2 [klein]'s architecture (a Qwen3 causal LM as text encoder, read at
  hidden states 9, 18 and 27; ``Flux2Transformer2DModel`` without guidance embedding;
  ``AutoencoderKLFlux2``; klein's dynamically shifted flow-matching scheduler) at sizes that
  compile in seconds on a CPU: a 28-layer Qwen3 of width 16, 2 double and 2 single blocks
  of 2 heads x 16, a 2-block VAE of 4 latent channels (scale factor 2; latents
  2x2-patched: sizes must be multiples of 4);
- ``random-klein-4b`` and ``random-klein-9b``: the real sizes, configs and tokenizer only
  (shapes for the TPU check and FLOP counts; ``shapes_only``), FLUX.2 [klein] 4B and 9B:
  the transformers of diffusers' ``scripts/convert_flux2_to_diffusers.py``
  (``get_flux2_transformer_config``, "klein-4b" and "klein-9b", as of diffusers' "Flux2
  klein" commit, 2026-01-15; BFL's ``Klein4BParams``/``Klein9BParams`` in
  ``src/flux2/model.py`` agree), the VAE that script builds (``AutoencoderKLFlux2()``'s
  defaults: 32 latent channels, blocks 128-256-512-512), and Qwen's published configs of
  the text encoders BFL's ``FLUX2_MODEL_INFO`` names: Qwen/Qwen3-4B (hidden 2560, 36
  layers, 32 heads, 8 KV heads, head_dim 128, intermediate 9728, tied embeddings) for the
  4B and Qwen/Qwen3-8B (hidden 4096, intermediate 12288, untied) for the 9B, vocabulary
  151,936, both stored bfloat16. Their model cards' licences: Apache-2.0 (4B) and the FLUX
  Non-Commercial License (9B).

The weights are random, drawn from numpy leaf by leaf from a fixed seed and the
parameter's name (``builtin.random_weights``), stored float32 in PyTorch's names and
layouts (``to_torch`` of each network): loading them takes the path
a user's checkpoint takes. Their images are noise. The tokenizer is a byte-level BPE
vocabulary without merges plus Qwen's chat tokens (``tokenizer``), with the part of
Qwen3's chat template that ``Flux2KleinPipeline`` uses (``CHAT_TEMPLATE``).

This module imports no jax at import time: the torch-only fixture script
(tests/fixtures/make_flux2_pipeline_fixtures.py) builds PyTorch pipelines from it.
"""
from __future__ import annotations


from pipeline.model.families import qwen_presets
from pipeline.model.loading import builtin
from pipeline.model.sampling import flow

SEED = 0
TOKENIZER_MAX_LENGTH = 512  # Flux2KleinPipeline's tokenizer_max_length, its default max_sequence_length
# FLUX.2 [klein]'s scheduler config (FlowMatchEulerDiscreteScheduler, every key at 0.39's names)
KLEIN_SCHEDULER = dict(flow.DEFAULTS, shift=3.0, use_dynamic_shifting=True)
_TINY_QWEN3 = dict(qwen_presets.TINY_QWEN3, num_hidden_layers=28)
_TINY_TRANSFORMER = dict(patch_size=1, in_channels=16, out_channels=None, num_layers=2, num_single_layers=2,
                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                         timestep_guidance_channels=64, mlp_ratio=3.0, axes_dims_rope=[4, 4, 4, 4], rope_theta=2000,
                         eps=1e-6, guidance_embeds=False)
_TINY_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                 up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], decoder_block_out_channels=None,
                 layers_per_block=1, act_fn="silu", latent_channels=4, norm_num_groups=8, sample_size=32,
                 force_upcast=True, use_quant_conv=True, use_post_quant_conv=True, mid_block_add_attention=True,
                 batch_norm_eps=1e-4, batch_norm_momentum=0.1, patch_size=[2, 2])

# the real sizes (see the module docstring for where each number comes from)
_QWEN3_4B = qwen_presets.QWEN3_4B
_QWEN3_8B = dict(_QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
_KLEIN_4B = dict(patch_size=1, in_channels=128, out_channels=None, num_layers=5, num_single_layers=20,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=7680,
                 timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32], rope_theta=2000,
                 eps=1e-6, guidance_embeds=False)
_KLEIN_9B = dict(_KLEIN_4B, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288)
_FLUX2_VAE = dict(_TINY_VAE, down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                  block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=32,
                  norm_num_groups=32, sample_size=1024)
APACHE, NON_COMMERCIAL = "apache-2.0", "flux-non-commercial-license"

# Built-in random models, by --model name. Bump a name's version when its recipe changes.
_TINY = dict(weights_dtype="float32", qwen3=_TINY_QWEN3, transformer=_TINY_TRANSFORMER, vae=_TINY_VAE,
             scheduler=KLEIN_SCHEDULER)
PRESETS = {
    "tiny-klein": dict(_TINY, version="tiny-klein-v2", default_size=32, distilled=True),
    "tiny-klein-base": dict(_TINY, version="tiny-klein-base-v2", default_size=32, distilled=False),
    "random-klein-4b": dict(version="random-klein-4b-v2", distilled=True, weights_dtype="bfloat16", qwen3=_QWEN3_4B,
                            transformer=_KLEIN_4B, vae=_FLUX2_VAE, scheduler=KLEIN_SCHEDULER, license=APACHE,
                            shapes_only=True),
    "random-klein-9b": dict(version="random-klein-9b-v2", distilled=True, weights_dtype="bfloat16", qwen3=_QWEN3_8B,
                            transformer=_KLEIN_9B, vae=_FLUX2_VAE, scheduler=KLEIN_SCHEDULER,
                            license=NON_COMMERCIAL, shapes_only=True),
}


# how Flux2KleinPipeline.save_pretrained lays a checkpoint out
CHECKPOINT = qwen_presets.Checkpoint("Flux2KleinPipeline", text_encoder="Qwen3ForCausalLM",
                                     transformer="Flux2Transformer2DModel", vae="AutoencoderKLFlux2")


def build(directory: str, name: str = "tiny-klein", weights: bool = True) -> None:
    """Write the random model ``name`` into ``directory`` in diffusers' Flux2KleinPipeline
    layout: model_index.json (with the preset's ``is_distilled``), scheduler/, tokenizer/,
    text_encoder/, transformer/, vae/. ``weights=False``: configs and tokenizer only."""
    from pipeline.model.families.flux2 import transformer as flux2

    preset = PRESETS[name]
    qwen_presets.write(directory, name, preset, CHECKPOINT.model_index(is_distilled=preset["distilled"]),
                       checkpoint=CHECKPOINT, transformer=(flux2.NETWORK, flux2.Flux2Config), seed=SEED,
                       weights=weights)


def ensure(name: str, shapes: bool = False) -> str:
    """The folder of the built-in model ``name``, built once per machine (``builtin.ensure_preset``)."""
    return builtin.ensure_preset(PRESETS, name, build, shapes)
