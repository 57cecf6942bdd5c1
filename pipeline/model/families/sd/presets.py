"""Built-in random-weight models, saved in diffusers format: ``--model tiny`` and friends.

``tiny`` has SD 1.x's architecture (CLIP tokenizer and text encoder, UNet2DCondition,
AutoencoderKL, DDIM scheduler) and ``tiny-sdxl`` SDXL's (two text encoders, pooled
embeddings, time ids), at sizes that compile in seconds on a CPU; ``random-sd15`` has
SD 1.5's real sizes, for benchmarks. Each is built from a fixed seed, saved once into
the cache, and then loaded by ``pipeline.model.load.load`` exactly like a user's
checkpoint. Their weights are random, so their images are noise: they exist for tests,
demos and benchmarks.
"""
from __future__ import annotations

import os
import tempfile

from pipeline.model.loading import builtin
from pipeline.model.loading.builtin import CLIP_MAX_LENGTH as MAX_LENGTH, CLIP_SPECIAL as SPECIAL
from pipeline.model.loading.builtin import mark_shapes_only, random_params, write_clip_tokenizer_files
from pipeline.model.loading.libraries import quiet_libraries

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
        version="tiny-sd-v1", family="sd", text=_TINY_TEXT, vae=_TINY_VAE,
        unet=dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8),
        scheduler=("FlaxDDIMScheduler", dict(_SD_SCHEDULE, clip_sample=False, set_alpha_to_one=False,
                                             steps_offset=1))),
    "tiny-sdxl": dict(
        version="tiny-sdxl-v1", family="sdxl", text=_TINY_TEXT, text_2=dict(_TINY_TEXT, hidden_act="gelu"),
        vae=dict(_TINY_VAE, scaling_factor=0.13025),
        unet=dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
                  transformer_layers_per_block=(1, 2), use_linear_projection=True, cross_attention_dim=64,
                  addition_embed_type="text_time", addition_time_embed_dim=8,
                  projection_class_embeddings_input_dim=32 + 6 * 8),  # pooled text + 6 time ids
        scheduler=("FlaxEulerDiscreteScheduler", dict(_SD_SCHEDULE, timestep_spacing="leading"))),
    # SD 1.5's architecture and sizes with random weights: for benchmarks, not tests.
    # SDXL base 1.0's architecture and sizes, shapes only: its weights (7 GB in bf16) are never
    # written. For the TPU check, FLOP counts and memory benchmarks, which need its shapes alone.
    "random-sdxl": dict(
        version="random-sdxl-v1", family="sdxl", shapes_only=True,
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
        scheduler=("FlaxEulerDiscreteScheduler", dict(_SD_SCHEDULE, timestep_spacing="leading"))),
    "random-sd15": dict(
        version="random-sd15-v1", family="sd",
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
        scheduler=("FlaxPNDMScheduler", dict(_SD_SCHEDULE, skip_prk_steps=True, set_alpha_to_one=False,
                                             steps_offset=1))),
}


def build(directory: str, name: str = "tiny", shapes: bool = False) -> None:
    """Build the random model ``name`` from ``SEED`` and save it in diffusers format; with
    ``shapes``, and always for a ``shapes_only`` preset, as its configs and tokenizers
    alone (marked ``SHAPES_ONLY``)."""
    import diffusers
    import jax
    from transformers import CLIPTextConfig, CLIPTokenizer, FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

    quiet_libraries()
    preset = PRESETS[name]
    with tempfile.TemporaryDirectory() as scratch:
        files = write_clip_tokenizer_files(scratch)
        tokenizer = CLIPTokenizer(*files, model_max_length=MAX_LENGTH)
        # SDXL's second tokenizer pads with "!" rather than the end token
        tokenizer_2 = CLIPTokenizer(*files, model_max_length=MAX_LENGTH, pad_token="!")
    bos, eos = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL)

    def text_model(cls, config: dict):
        config = dict(config)
        vocab_size = config.pop("vocab_size", len(tokenizer))
        return cls(CLIPTextConfig(vocab_size=vocab_size, max_position_embeddings=MAX_LENGTH, bos_token_id=bos,
                                  eos_token_id=eos, pad_token_id=eos, **config), _do_init=False)

    text_encoder = text_model(FlaxCLIPTextModel, preset["text"])
    unet = diffusers.FlaxUNet2DConditionModel(**preset["unet"])
    vae = diffusers.FlaxAutoencoderKL(**preset["vae"])
    scheduler_class, scheduler_config = preset["scheduler"]
    scheduler = getattr(diffusers, scheduler_class)(**scheduler_config)
    components = dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler)
    if preset["family"] == "sdxl":
        text_encoder_2 = text_model(FlaxCLIPTextModelWithProjection, preset["text_2"])
        pipe = diffusers.FlaxStableDiffusionXLPipeline(text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                                       dtype=jax.numpy.float32, **components)
    else:
        pipe = diffusers.FlaxStableDiffusionPipeline(safety_checker=None, feature_extractor=None,
                                                     dtype=jax.numpy.float32, **components)
    if shapes or preset.get("shapes_only"):
        _save_shapes(directory, name, pipe)
        return
    shapes_key = jax.random.PRNGKey(SEED)  # only shapes are taken from the initialisers
    params = {"text_encoder": random_params(text_encoder.params_shape_tree, SEED),
              "unet": random_params(jax.eval_shape(unet.init_weights, shapes_key), SEED + 1),
              "vae": random_params(jax.eval_shape(vae.init_weights, shapes_key), SEED + 2),
              "scheduler": scheduler.create_state()}
    if preset["family"] == "sdxl":
        params["text_encoder_2"] = random_params(text_encoder_2.params_shape_tree, SEED + 3)
    pipe.save_pretrained(directory, params=params)


def ensure(name: str, shapes: bool = False) -> str:
    """The folder of the built-in model ``name``, built once per machine (``builtin.ensure``;
    ``shapes``: its configs alone will do)."""
    preset = PRESETS[name]
    return builtin.ensure(preset["version"], lambda folder, weights: build(folder, name, shapes=not weights),
                          shapes=shapes, shapes_only_preset=bool(preset.get("shapes_only")))


def _save_shapes(directory: str, name: str, pipe) -> None:
    """Model_index.json, every component's config and the tokenizers, laid out as the
    pipeline's ``save_pretrained`` lays them out, and no weights (``SHAPES_ONLY``)."""
    pipe.save_config(directory)  # model_index.json
    for part, component in pipe.components.items():
        if component is None:
            continue
        target = os.path.join(directory, part)
        if part.startswith("tokenizer"):
            component.save_pretrained(target)
        elif part.startswith("text_encoder"):
            component.config.save_pretrained(target)
        else:
            component.save_config(target)
    mark_shapes_only(directory, name)
