"""Built-in random-weight models, saved in diffusers format: ``--model tiny`` and friends.

``tiny`` has SD 1.x's architecture (CLIP tokenizer and text encoder, UNet2DCondition,
AutoencoderKL, DDIM scheduler) and ``tiny-sdxl`` SDXL's (two text encoders, pooled
embeddings, time ids), at sizes that compile in seconds on a CPU; ``random-sd15`` has
SD 1.5's real sizes, for benchmarks, and ``random-sdxl`` SDXL base's, shapes only. Each is
built from a fixed seed by promptmill's own networks and written as diffusers' and
transformers' ``save_pretrained`` lay a checkpoint out (configs as JSON, weights as
PyTorch-named safetensors, the encoder of the VAE included), so diffusers loads them too;
promptmill then loads them exactly like a user's checkpoint. Their weights are random, so
their images are noise: they exist for tests, demos and benchmarks.

This module imports no jax at import time: the torch-only fixture scripts build PyTorch
pipelines from its presets.
"""
from __future__ import annotations

import os

from pipeline.model.loading import builtin
from pipeline.model.loading.builtin import CLIP_MAX_LENGTH as MAX_LENGTH, CLIP_SPECIAL as SPECIAL
from pipeline.model.sampling import schedules
from pipeline.model.loading.builtin import mark_shapes_only

SEED = 0

_SD_SCHEDULE = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
_TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                  projection_dim=32)
_TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                 down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                 sample_size=32)

# Built-in random models, by --model name. Bump a name's version when its recipe changes.
PRESETS = {
    "tiny": dict(
        version="tiny-sd-v2", family="sd", text=_TINY_TEXT, vae=_TINY_VAE,
        unet=dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8),
        scheduler=("ddim", dict(_SD_SCHEDULE, clip_sample=False, set_alpha_to_one=False, steps_offset=1,
                                timestep_spacing="leading"))),
    "tiny-sdxl": dict(
        version="tiny-sdxl-v2", family="sdxl", text=_TINY_TEXT, text_2=dict(_TINY_TEXT, hidden_act="gelu"),
        vae=dict(_TINY_VAE, scaling_factor=0.13025),
        unet=dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
                  transformer_layers_per_block=(1, 2), use_linear_projection=True, cross_attention_dim=64,
                  addition_embed_type="text_time", addition_time_embed_dim=8,
                  projection_class_embeddings_input_dim=32 + 6 * 8),  # pooled text + 6 time ids
        scheduler=("euler", dict(_SD_SCHEDULE, timestep_spacing="leading", steps_offset=1))),
    # SD 1.5's architecture and sizes with random weights: for benchmarks, not tests.
    # SDXL base 1.0's architecture and sizes, shapes only: its weights (7 GB in bf16) are never
    # written. For the TPU check, FLOP counts and memory benchmarks, which need its shapes alone.
    "random-sdxl": dict(
        version="random-sdxl-v2", family="sdxl", shapes_only=True,
        text=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                  projection_dim=768, vocab_size=49408, hidden_act="quick_gelu"),
        text_2=dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=32,
                    projection_dim=1280, vocab_size=49408, hidden_act="gelu"),
        vae=dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
                 block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                 up_block_types=("UpDecoderBlock2D",) * 4, sample_size=1024, scaling_factor=0.13025),
        unet=dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                  block_out_channels=(320, 640, 1280),
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                  attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10),
                  use_linear_projection=True, cross_attention_dim=2048, addition_embed_type="text_time",
                  addition_time_embed_dim=256, projection_class_embeddings_input_dim=1280 + 6 * 256),
        scheduler=("euler", dict(_SD_SCHEDULE, timestep_spacing="leading", steps_offset=1))),
    "random-sd15": dict(
        version="random-sd15-v2", family="sd",
        text=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                  projection_dim=768, vocab_size=49408),
        vae=dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
                 block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                 up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512),
        unet=dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                  block_out_channels=(320, 640, 1280, 1280),
                  down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                  up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=768,
                  attention_head_dim=8),
        scheduler=("pndm", dict(_SD_SCHEDULE, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1))),
}


# Every key UNet2DConditionModel and AutoencoderKL take, at diffusers 0.39's defaults:
# save_pretrained writes them all
_UNET_DEFAULTS = dict(
    sample_size=None, in_channels=4, out_channels=4, center_input_sample=False, flip_sin_to_cos=True, freq_shift=0,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    mid_block_type="UNetMidBlock2DCrossAttn",
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    only_cross_attention=False, block_out_channels=[320, 640, 1280, 1280], layers_per_block=2, downsample_padding=1,
    mid_block_scale_factor=1, dropout=0.0, act_fn="silu", norm_num_groups=32, norm_eps=1e-05,
    cross_attention_dim=1280, transformer_layers_per_block=1, reverse_transformer_layers_per_block=None,
    encoder_hid_dim=None, encoder_hid_dim_type=None, attention_head_dim=8, num_attention_heads=None,
    dual_cross_attention=False, use_linear_projection=False, class_embed_type=None, addition_embed_type=None,
    addition_time_embed_dim=None, num_class_embeds=None, upcast_attention=False, resnet_time_scale_shift="default",
    resnet_skip_time_act=False, resnet_out_scale_factor=1.0, time_embedding_type="positional",
    time_embedding_dim=None, time_embedding_act_fn=None, timestep_post_act=None, time_cond_proj_dim=None,
    conv_in_kernel=3, conv_out_kernel=3, projection_class_embeddings_input_dim=None, attention_type="default",
    class_embeddings_concat=False, mid_block_only_cross_attention=None, cross_attention_norm=None,
    addition_embed_type_num_heads=64)
_VAE_DEFAULTS = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"],
                     up_block_types=["UpDecoderBlock2D"], block_out_channels=[64], layers_per_block=1, act_fn="silu",
                     latent_channels=4, norm_num_groups=32, sample_size=32, scaling_factor=0.18215, shift_factor=None,
                     latents_mean=None, latents_std=None, force_upcast=True, use_quant_conv=True,
                     use_post_quant_conv=True, mid_block_add_attention=True)
SCHEDULER_CLASSES = {"ddim": "DDIMScheduler", "pndm": "PNDMScheduler", "euler": "EulerDiscreteScheduler"}


def _listed(config: dict) -> dict:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in config.items()}


def unet_config(name: str) -> dict:
    """The preset's ``unet/config.json`` (without diffusers' metadata keys)."""
    return _listed(dict(_UNET_DEFAULTS, **PRESETS[name]["unet"]))


def vae_config(name: str) -> dict:
    """The preset's ``vae/config.json`` (without diffusers' metadata keys)."""
    return _listed(dict(_VAE_DEFAULTS, **PRESETS[name]["vae"]))


def text_config(name: str, key: str = "text") -> dict:
    """The preset's ``text_encoder/config.json`` (``key`` "text_2": ``text_encoder_2``'s) as
    transformers' ``CLIPTextConfig`` saves it, its special ids the built-in vocabulary's."""
    vocab = builtin.clip_vocabulary()
    config = dict(PRESETS[name][key])
    return dict(dict(vocab_size=len(vocab), hidden_act="quick_gelu", layer_norm_eps=1e-05, attention_dropout=0.0,
                     initializer_factor=1.0, initializer_range=0.02), **config, max_position_embeddings=MAX_LENGTH,
                bos_token_id=vocab[SPECIAL[0]], eos_token_id=vocab[SPECIAL[1]], pad_token_id=vocab[SPECIAL[1]],
                model_type="clip_text_model")


def model_index(name: str) -> dict:
    """The ``model_index.json`` of the preset's pipeline, as ``save_pretrained`` writes it."""
    preset = PRESETS[name]
    kind, scheduler = preset["scheduler"]
    index = {"_diffusers_version": builtin.DIFFUSERS_VERSION, "feature_extractor": [None, None],
             "image_encoder": [None, None], "scheduler": ["diffusers", SCHEDULER_CLASSES[kind]],
             "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}
    if preset["family"] == "sdxl":
        return {**index, "_class_name": "StableDiffusionXLPipeline", "force_zeros_for_empty_prompt": True,
                "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
                "tokenizer_2": ["transformers", "CLIPTokenizer"]}
    return {**index, "_class_name": "StableDiffusionPipeline", "requires_safety_checker": False,
            "safety_checker": [None, None]}


def build(directory: str, name: str = "tiny", shapes: bool = False) -> None:
    """Build the random model ``name`` from ``SEED`` and save it in diffusers format (see the
    module's docstring); with ``shapes``, and always for a ``shapes_only`` preset, as its
    configs and tokenizers alone (marked ``SHAPES_ONLY``)."""
    from pipeline.model.families.sd import unet as unet_net, unet_config as unet_cfg
    from pipeline.model.layers import vae as vae_net
    from pipeline.model.layers.text import clip
    from pipeline.model.loading import convert, tokenizer, weights

    preset = PRESETS[name]
    sdxl = preset["family"] == "sdxl"
    meta = {"_diffusers_version": builtin.DIFFUSERS_VERSION}
    builtin.write_json(os.path.join(directory, "model_index.json"), model_index(name))
    kind, scheduler = preset["scheduler"]
    builtin.write_json(os.path.join(directory, "scheduler", "scheduler_config.json"),  # every key of the class
                       {"_class_name": SCHEDULER_CLASSES[kind], **meta, **schedules.resolved_config(scheduler, kind)})
    builtin.write_json(os.path.join(directory, "unet", "config.json"),
                       {"_class_name": "UNet2DConditionModel", **meta, **unet_config(name)})
    builtin.write_json(os.path.join(directory, "vae", "config.json"),
                       {"_class_name": "AutoencoderKL", **meta, **vae_config(name)})
    vocab = builtin.clip_vocabulary()
    texts = [("text_encoder", "text", "CLIPTextModel", "tokenizer", SPECIAL[1])]
    if sdxl:  # SDXL's second tokenizer pads with "!" rather than the end token
        texts.append(("text_encoder_2", "text_2", "CLIPTextModelWithProjection", "tokenizer_2", "!"))
    for component, key, architecture, tokenizer_folder, pad in texts:
        tokenizer.write_clip(os.path.join(directory, tokenizer_folder), vocab, [], pad, MAX_LENGTH)
        builtin.write_json(os.path.join(directory, component, "config.json"),
                           {**text_config(name, key), "architectures": [architecture], "dtype": "float32",
                            "transformers_version": builtin.TRANSFORMERS_VERSION})
    if shapes or preset.get("shapes_only"):
        mark_shapes_only(directory, name)
        return
    states = {}
    for seed, (component, key, architecture, _, _) in enumerate(texts, start=SEED):
        config = clip.ClipTextConfig.from_dict(text_config(name, key))
        network = clip.network(layers=config.num_hidden_layers, final=True,
                               projection=architecture.endswith("WithProjection"))
        states[component] = builtin.random_weights(network, config, seed)
    states["unet"] = unet_net.to_torch(convert.unflatten(builtin.random_flat_params(
        unet_net.param_shapes(unet_cfg.UNetConfig.from_dict(unet_config(name))), SEED + 2)))
    vae_cfg = vae_net.VaeConfig.from_dict(vae_config(name), shifted=False)
    states["vae"] = {**builtin.random_weights(vae_net.NETWORK, vae_cfg, SEED + 3),
                     **builtin.random_torch_state(vae_net.encoder_shapes(vae_config(name)), SEED + 4)}
    for component, state in states.items():
        library = "transformers" if component.startswith("text_encoder") else "diffusers"
        weights.write_safetensors(os.path.join(directory, component, weights.SAFETENSORS_FILES[library]),
                                  dict(sorted(state.items())), align=False, metadata={"format": "pt"})


def ensure(name: str, shapes: bool = False) -> str:
    """The folder of the built-in model ``name``, built once per machine (``builtin.ensure_preset``;
    ``shapes``: its configs alone will do)."""
    def build_weights(folder: str, preset: str, weights: bool) -> None:
        build(folder, preset, shapes=not weights)

    return builtin.ensure_preset(PRESETS, name, build_weights, shapes)
