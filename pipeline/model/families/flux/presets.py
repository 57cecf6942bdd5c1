"""Built-in random FLUX.1 models, saved as diffusers' ``FluxPipeline.save_pretrained`` lays
a checkpoint out: ``--model tiny-flux`` and friends.

- ``tiny-flux``: FLUX.1 [schnell]'s architecture (CLIP text encoder, T5 encoder,
  FluxTransformer2DModel without guidance embedding, a 16-channel VAE without quant
  convs, the static-shift flow-matching scheduler) at sizes that compile in seconds on
  a CPU: 2 double and 2 single blocks of 2 heads x 12, a 2-layer T5 and CLIP, a 2-block
  VAE (scale factor 2: sizes must be multiples of 4).
- ``tiny-flux-dev``: the same with [dev]'s guidance embedding and dynamic shifting.
- ``random-flux`` and ``random-flux-dev``: FLUX.1 [schnell]'s and [dev]'s real
  configs (19 double and 38 single blocks of 24 heads x 128, T5-v1.1-XXL, CLIP-L, the
  16-channel VAE, the checkpoints' scheduler configs), for shape-only work (the TPU
  check, FLOP counts): ``build(..., weights=False)`` writes their configs and tokenizers
  only, never their 34 GB of weights.

The weights are random, drawn from numpy leaf by leaf from a fixed seed and the
parameter's name, and stored in PyTorch's names and layouts (``to_torch`` of each
network) in the preset's dtype (bf16, as FLUX.1's own files): loading them takes the
path a user's checkpoint takes. Their images are noise. The tokenizers are tiny: CLIP's
byte-level vocabulary (``builtin.clip_vocabulary``) and a ~140-piece Unigram vocabulary
for T5 (``t5_backend``), written as transformers' ``save_pretrained`` writes them.

This module imports no jax at import time: the torch-only fixture script
(tests/fixtures/make_flux_fixtures.py) builds PyTorch pipelines from its presets.
"""
from __future__ import annotations

import os

from pipeline.model.loading import builtin
from pipeline.model.sampling import flow

SEED = 0
CLIP_MAX_LENGTH = builtin.CLIP_MAX_LENGTH  # 77, FluxPipeline's CLIP length
T5_MAX_LENGTH = 512  # the T5 tokenizer's model_max_length, as FLUX.1's

SCHNELL_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                         num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
DEV_SCHEDULER = dict(SCHNELL_SCHEDULER, shift=3.0, use_dynamic_shifting=True)

# Every key FluxTransformer2DModel and AutoencoderKL take, at diffusers 0.39's defaults
# (FlowMatchEulerDiscreteScheduler's: ``flow.DEFAULTS``): save_pretrained writes them all
_TRANSFORMER_DEFAULTS = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                             attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                             pooled_projection_dim=768, guidance_embeds=False, axes_dims_rope=[16, 56, 56])
_VAE_DEFAULTS = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"],
                     up_block_types=["UpDecoderBlock2D"], block_out_channels=[64], layers_per_block=1, act_fn="silu",
                     latent_channels=4, norm_num_groups=32, sample_size=32, scaling_factor=0.18215, shift_factor=None,
                     latents_mean=None, latents_std=None, force_upcast=True, use_quant_conv=True,
                     use_post_quant_conv=True, mid_block_add_attention=True)

_TINY_TRANSFORMER = dict(in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=12,
                         num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
                         axes_dims_rope=[2, 4, 6])
_TINY_T5 = dict(vocab_size=160, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
_TINY_CLIP = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=2, projection_dim=16)
_TINY_VAE = dict(latent_channels=16, block_out_channels=[8, 8], down_block_types=["DownEncoderBlock2D"] * 2,
                 up_block_types=["UpDecoderBlock2D"] * 2, norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
                 shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)

# FLUX.1's real sizes (black-forest-labs/FLUX.1-schnell's component configs)
_FLUX_TRANSFORMER = dict(in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                         num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                         axes_dims_rope=[16, 56, 56])
_T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
_CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
               projection_dim=768, vocab_size=49408)
_FLUX_VAE = dict(latent_channels=16, block_out_channels=[128, 256, 512, 512],
                 down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                 layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                 use_quant_conv=False, use_post_quant_conv=False)

# Built-in random models, by --model name. Bump a name's version when its recipe changes.
PRESETS = {
    "tiny-flux": dict(version="tiny-flux-v2", variant="schnell", weights_dtype="bfloat16", text=_TINY_CLIP,
                      t5=_TINY_T5, transformer=_TINY_TRANSFORMER, vae=_TINY_VAE, scheduler=SCHNELL_SCHEDULER),
    "tiny-flux-dev": dict(version="tiny-flux-dev-v2", variant="dev", weights_dtype="bfloat16", text=_TINY_CLIP,
                          t5=_TINY_T5, transformer=dict(_TINY_TRANSFORMER, guidance_embeds=True), vae=_TINY_VAE,
                          scheduler=DEV_SCHEDULER),
    # FLUX.1's sizes: configs only (build(..., weights=False)), for the TPU check and FLOP counts
    "random-flux": dict(version="random-flux-v2", variant="schnell", weights_dtype="bfloat16", text=_CLIP_L,
                        t5=_T5_XXL, transformer=_FLUX_TRANSFORMER, vae=_FLUX_VAE, scheduler=SCHNELL_SCHEDULER,
                        shapes_only=True),
    "random-flux-dev": dict(version="random-flux-dev-v2", variant="dev", weights_dtype="bfloat16", text=_CLIP_L,
                            t5=_T5_XXL, transformer=dict(_FLUX_TRANSFORMER, guidance_embeds=True), vae=_FLUX_VAE,
                            scheduler=DEV_SCHEDULER, shapes_only=True),
}

# The T5 vocabulary: whole words (preferred by the Unigram scores), and every single
# character, alone and starting a word, so that any plain text tokenises without <unk>
_T5_WORDS = ("a", "the", "in", "of", "on", "and", "with", "under", "red", "blue", "green", "fox", "snow", "whale",
             "ocean", "deep", "bright", "full", "moon", "painting", "photo", "cat", "dog", "tree", "city", "night",
             "light", "soft", "tiny", "many", "swimming", "watercolor", "details")
_T5_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789,.!?'-:;()"


def transformer_config(name: str) -> dict:
    """The preset's ``transformer/config.json`` (without diffusers' metadata keys)."""
    return dict(_TRANSFORMER_DEFAULTS, **PRESETS[name]["transformer"])


def vae_config(name: str) -> dict:
    """The preset's ``vae/config.json`` (without diffusers' metadata keys)."""
    return dict(_VAE_DEFAULTS, **PRESETS[name]["vae"])


def scheduler_config(name: str) -> dict:
    """The preset's ``scheduler/scheduler_config.json`` (without diffusers' metadata keys)."""
    return dict(flow.DEFAULTS, **PRESETS[name]["scheduler"])


def t5_config(name: str) -> dict:
    """The keyword arguments of transformers' ``T5Config`` for the preset's text_encoder_2."""
    return dict(PRESETS[name]["t5"])


def clip_config(name: str) -> dict:
    """The preset's ``text_encoder/config.json`` (transformers' ``CLIPTextConfig`` keys), its
    special ids the built-in CLIP vocabulary's."""
    vocab = builtin.clip_vocabulary()
    config = dict(PRESETS[name]["text"])
    config.setdefault("vocab_size", len(vocab))
    bos, eos = (vocab[token] for token in builtin.CLIP_SPECIAL)
    return dict(dict(hidden_act="quick_gelu", layer_norm_eps=1e-05, model_type="clip_text_model",
                     attention_dropout=0.0, initializer_factor=1.0, initializer_range=0.02), **config,
                max_position_embeddings=CLIP_MAX_LENGTH, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)


def t5_backend():
    """The tiny T5 tokenizer, built with the ``tokenizers`` library, deterministic: a Unigram
    vocabulary of ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 (T5's ids), words, then single
    characters; SentencePiece-style word starts (``▁``), ``</s>`` appended to every sequence,
    no sentinel ``<extra_id_*>`` tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -6.0)]
    pieces += [("\u2581" + word, -3.0) for word in _T5_WORDS]
    pieces += [("\u2581" + c, -8.0) for c in _T5_CHARACTERS if c.islower() and c not in _T5_WORDS]
    pieces += [(c, -10.0) for c in _T5_CHARACTERS]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tokenizer.normalizer = normalizers.Replace(Regex(" {2,}"), " ")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    return tokenizer


def write_tokenizers(directory: str) -> None:
    """``tokenizer/`` (the built-in CLIP vocabulary) and ``tokenizer_2/`` (``t5_backend``, as
    ``T5TokenizerFast.save_pretrained`` writes it)."""
    from pipeline.model.loading import tokenizer

    tokenizer.write_clip(os.path.join(directory, "tokenizer"), builtin.clip_vocabulary(), [],
                         model_max_length=CLIP_MAX_LENGTH)
    tokenizer.write_json(os.path.join(directory, "tokenizer_2"), t5_backend(), "T5TokenizerFast",
                         {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}, T5_MAX_LENGTH,
                         special_map_as_strings=True, add_prefix_space=None, extra_ids=0,
                         additional_special_tokens=[])


def model_index() -> dict:
    """The ``model_index.json`` of a FluxPipeline checkpoint, as ``save_pretrained`` writes it."""
    return {"_class_name": "FluxPipeline", "_diffusers_version": builtin.DIFFUSERS_VERSION,
            "feature_extractor": [None, None], "image_encoder": [None, None],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}


def _stored(state: dict, dtype: str) -> dict:
    import ml_dtypes
    import numpy as np

    target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return {name: np.asarray(array).astype(target) for name, array in sorted(state.items())}


def build(directory: str, name: str = "tiny-flux", weights: bool = True) -> None:
    """Write the random model ``name`` into ``directory`` in diffusers' FluxPipeline layout:
    model_index.json, scheduler/, tokenizer/, tokenizer_2/, text_encoder/,
    text_encoder_2/, transformer/, vae/. ``weights=False``: configs and tokenizers only
    (``random-flux``'s 34 GB of weights are never written)."""
    from pipeline.model.families.flux import transformer as flux
    from pipeline.model.layers import vae
    from pipeline.model.layers.text import clip, t5
    from pipeline.model.loading import weights as weights_lib

    preset = PRESETS[name]
    dtype = preset["weights_dtype"]
    builtin.write_json(os.path.join(directory, "model_index.json"), model_index())
    meta = {"_diffusers_version": builtin.DIFFUSERS_VERSION}
    builtin.write_json(os.path.join(directory, "scheduler", "scheduler_config.json"),
                       {"_class_name": "FlowMatchEulerDiscreteScheduler", **meta, **scheduler_config(name)})
    builtin.write_json(os.path.join(directory, "transformer", "config.json"),
                       {"_class_name": "FluxTransformer2DModel", **meta, **transformer_config(name)})
    builtin.write_json(os.path.join(directory, "vae", "config.json"), {"_class_name": "AutoencoderKL", **meta,
                                                                       **vae_config(name)})
    write_tokenizers(directory)
    # T5EncoderModel turns these off in the config it saves: it is an encoder alone
    t5_json = dict(t5_config(name), is_encoder_decoder=False, use_cache=False, model_type="t5",
                   dense_act_fn="gelu_new", is_gated_act=True, layer_norm_epsilon=1e-6, pad_token_id=0,
                   eos_token_id=1, classifier_dropout=0.0, dropout_rate=0.1, initializer_factor=1.0,
                   num_decoder_layers=t5_config(name)["num_layers"])
    for component, config, architecture in (("text_encoder", clip_config(name), "CLIPTextModel"),
                                            ("text_encoder_2", t5_json, "T5EncoderModel")):
        builtin.write_json(os.path.join(directory, component, "config.json"),
                           {**config, "architectures": [architecture], "dtype": dtype,
                            "transformers_version": builtin.TRANSFORMERS_VERSION})
    if not weights:
        builtin.mark_shapes_only(directory, name)
        return

    t5_cfg = t5.T5Config.from_dict(t5_json)
    clip_cfg = clip.ClipTextConfig.from_dict(clip_config(name))
    flux_cfg = flux.FluxConfig.from_dict(transformer_config(name))
    vae_cfg = vae.VaeConfig.from_dict(vae_config(name))
    states = {
        "text_encoder": builtin.random_weights(clip.network(layers=clip_cfg.num_hidden_layers, final=True,
                                                            projection=False), clip_cfg, SEED),
        "text_encoder_2": builtin.random_weights(t5.NETWORK, t5_cfg, SEED + 1),
        "transformer": builtin.random_weights(flux.NETWORK, flux_cfg, SEED + 2),
        "vae": {**builtin.random_weights(vae.NETWORK, vae_cfg, SEED + 3),
                **builtin.random_torch_state(vae.encoder_shapes(vae_config(name)), SEED + 4)},
    }
    for component, state in states.items():
        library = "transformers" if component.startswith("text_encoder") else "diffusers"
        path = os.path.join(directory, component, weights_lib.SAFETENSORS_FILES[library])
        weights_lib.write_safetensors(path, _stored(state, dtype), align=False, metadata={"format": "pt"})


def ensure(name: str, shapes: bool = False) -> str:
    """The folder of the built-in model ``name``, built once per machine (``builtin.ensure_preset``;
    ``shapes``: its configs alone will do)."""
    return builtin.ensure_preset(PRESETS, name, build, shapes)
