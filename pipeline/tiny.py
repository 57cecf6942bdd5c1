"""``--model tiny``: a tiny random-weight Stable Diffusion, saved in diffusers format.

Same architecture as SD 1.x (CLIP tokenizer and text encoder, UNet2DCondition,
AutoencoderKL, DDIM scheduler), at a size that compiles in seconds on a CPU. It is
built from a fixed seed, saved once into the cache, and then loaded by
``pipeline.model.load`` exactly like a user's checkpoint. Its weights are random, so
its images are noise: it exists for tests and demos.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib

VERSION = "tiny-sd-v1"  # bump when the recipe below changes
SEED = 0
MAX_LENGTH = 77
SPECIAL = ("<|startoftext|>", "<|endoftext|>")


def _write_tokenizer_files(folder: str) -> tuple[str, str]:
    """A byte-level CLIP BPE vocabulary with no merges: 512 symbols plus 2 specials."""
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols] + list(SPECIAL))}
    vocab_file, merges_file = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merges_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    return vocab_file, merges_file


def _random_params(shapes, seed: int):
    """Weights for a tree of ShapeDtypeStructs, from numpy, leaf by leaf.

    Flax's own initialisers would run the whole model eagerly (tens of seconds on a
    CPU); the shapes come from ``jax.eval_shape`` instead and each leaf is drawn from
    a generator seeded by (seed, leaf path), so the result does not depend on order.
    """
    import jax
    import numpy as np

    def leaf(path, spec):
        name = jax.tree_util.keystr(path)
        if name.endswith("['scale']"):
            return np.ones(spec.shape, np.float32)
        if name.endswith("['bias']"):
            return np.zeros(spec.shape, np.float32)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        fan_in = int(np.prod(spec.shape[:-1])) or 1
        std = 0.02 if name.endswith("['embedding']") else fan_in ** -0.5
        return (rng.standard_normal(spec.shape) * std).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, shapes)


def build(directory: str) -> None:
    """Build the tiny model from ``SEED`` and save it in diffusers format to ``directory``."""
    import jax
    from diffusers import (FlaxAutoencoderKL, FlaxDDIMScheduler, FlaxStableDiffusionPipeline,
                           FlaxUNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTokenizer, FlaxCLIPTextModel

    from pipeline.model import quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = CLIPTokenizer(*_write_tokenizer_files(scratch), model_max_length=MAX_LENGTH)
    bos, eos = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL)
    text_config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                 num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=MAX_LENGTH,
                                 bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, projection_dim=32)
    text_encoder = FlaxCLIPTextModel(text_config, _do_init=False)
    unet = FlaxUNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8)
    vae = FlaxAutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, sample_size=32)
    scheduler = FlaxDDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False,
                                  steps_offset=1)
    shapes_key = jax.random.PRNGKey(SEED)  # only shapes are taken from the initialisers
    params = {"text_encoder": _random_params(text_encoder.params_shape_tree, SEED),
              "unet": _random_params(jax.eval_shape(unet.init_weights, shapes_key), SEED + 1),
              "vae": _random_params(jax.eval_shape(vae.init_weights, shapes_key), SEED + 2),
              "scheduler": scheduler.create_state()}
    pipe = FlaxStableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       dtype=jax.numpy.float32)
    pipe.save_pretrained(directory, params=params)


def ensure(models_dir: str) -> str:
    """The cached tiny model's directory, building it on first use.

    Several host processes may ask at once: each builds into its own scratch folder
    and renames it into place (a local, atomic rename); the first one wins.
    """
    target = os.path.join(models_dir, VERSION)
    if os.path.isfile(os.path.join(target, "model_index.json")):
        return target
    os.makedirs(models_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{VERSION}-", dir=models_dir)
    try:
        build(scratch)
        os.chmod(scratch, 0o755)  # mkdtemp made it private
        try:
            os.rename(scratch, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "model_index.json")):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
