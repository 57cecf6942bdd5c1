"""The built-in random checkpoints of the Qwen-text families (FLUX.2 [klein], Z-Image), in
diffusers' layout: a family's presets give the configs, the classes (``Checkpoint``) and
the seed; ``write`` writes the folder. Imports no jax at import time (the torch-only
fixture scripts build PyTorch pipelines from the presets)."""
from __future__ import annotations

import dataclasses
import os

from pipeline.model.loading import builtin, qwen_tokenizer
from pipeline.model.loading.qwen_tokenizer import IM_END, PAD

SCHEDULER_CLASS, TOKENIZER_CLASS = "FlowMatchEulerDiscreteScheduler", "Qwen2TokenizerFast"
# the tiny models' Qwen3 (a family sets how many layers it has): compiles in seconds on a CPU
TINY_QWEN3 = dict(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  hidden_act="silu", max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  attention_bias=False, use_sliding_window=False, tie_word_embeddings=False)
# Qwen/Qwen3-4B's published config (hidden 2560, 36 layers, 32 heads, 8 KV heads, head_dim
# 128, intermediate 9728, tied embeddings, vocabulary 151,936): FLUX.2 [klein] 4B's and
# Z-Image's text encoder, at its real size
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False, use_sliding_window=False,
                tie_word_embeddings=True, vocab_size=151936)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The classes a family's pipeline saves its checkpoint with (``save_pretrained``): the
    pipeline's, its text encoder's (``Qwen3ForCausalLM`` or ``Qwen3Model``), its
    transformer's and its VAE's."""
    pipeline: str
    text_encoder: str
    transformer: str
    vae: str

    @property
    def causal_lm(self) -> bool:
        """Whether the text encoder is saved with its language-model head (names under ``model.``)."""
        return self.text_encoder == "Qwen3ForCausalLM"

    def model_index(self, **extra) -> dict:
        """The checkpoint's ``model_index.json``, as ``save_pretrained`` writes it; ``extra``:
        the pipeline's own keys (klein's ``is_distilled``)."""
        return {"_class_name": self.pipeline, "_diffusers_version": builtin.DIFFUSERS_VERSION, **extra,
                "scheduler": ["diffusers", SCHEDULER_CLASS], "text_encoder": ["transformers", self.text_encoder],
                "tokenizer": ["transformers", TOKENIZER_CLASS], "transformer": ["diffusers", self.transformer],
                "vae": ["diffusers", self.vae]}


def qwen3_config(preset: dict) -> dict:
    """The preset's ``text_encoder/config.json`` keys (transformers' ``Qwen3Config``'s), its
    vocabulary and special ids the built-in Qwen tokenizer's (``qwen_tokenizer``)."""
    vocab = qwen_tokenizer.vocabulary()
    return dict({"vocab_size": len(vocab)}, **preset["qwen3"], pad_token_id=vocab[PAD], bos_token_id=vocab[PAD],
                eos_token_id=vocab[IM_END])


def write(directory: str, name: str, preset: dict, index: dict, *, checkpoint: Checkpoint, transformer: tuple,
          seed: int, weights: bool = True) -> None:
    """Write the built-in model ``name`` (``preset``) into ``directory``: ``index`` as its
    model_index.json, the configs (``write_configs``), the tokenizer and, with ``weights``,
    random weights drawn from ``seed`` (``write_random_weights``; ``transformer``: the
    family's transformer as (its ``convert.Network``, its config class)); without, it is
    marked shapes-only (``builtin.mark_shapes_only``)."""
    hf_config = write_configs(directory, name, preset, index, checkpoint)
    if not weights:
        builtin.mark_shapes_only(directory, name)
        return
    write_random_weights(directory, preset, hf_config, transformer, checkpoint=checkpoint, seed=seed)


def write_configs(directory: str, name: str, preset: dict, index: dict, checkpoint: Checkpoint) -> dict:
    """model_index.json (``index``), the model card's licence (when the preset has one), the
    scheduler's, transformer's and VAE's configs, the tokenizer and the text encoder's
    config, which is returned."""
    from pipeline.model.layers.text import qwen3

    builtin.write_json(os.path.join(directory, "model_index.json"), index)
    if preset.get("license"):  # the model card's front matter, as the hub keeps it
        with open(os.path.join(directory, "README.md"), "w", encoding="utf-8") as f:
            f.write(f"---\nlicense: {preset['license']}\n---\n\n{name}: random weights, {preset['version']}\n")
    meta = {"_diffusers_version": builtin.DIFFUSERS_VERSION}
    for component, file, class_name in (("scheduler", "scheduler_config.json", SCHEDULER_CLASS),
                                        ("transformer", "config.json", checkpoint.transformer),
                                        ("vae", "config.json", checkpoint.vae)):
        builtin.write_json(os.path.join(directory, component, file),
                           {"_class_name": class_name, **meta, **preset[component]})
    qwen_tokenizer.write(os.path.join(directory, "tokenizer"))
    hf_config = qwen3.hf_config(**qwen3_config(preset), architectures=[checkpoint.text_encoder],
                                transformers_version=builtin.TRANSFORMERS_VERSION)
    hf_config["dtype"] = preset["weights_dtype"]
    builtin.write_json(os.path.join(directory, "text_encoder", "config.json"), hf_config)
    return hf_config


def write_random_weights(directory: str, preset: dict, hf_config: dict, transformer: tuple, *,
                         checkpoint: Checkpoint, seed: int) -> None:
    """Random weights drawn from ``seed`` (the text encoder's, the transformer's (``transformer``:
    (its ``convert.Network``, its config class)), the VAE's: seed, seed + 1, seed + 2), in
    PyTorch names, as safetensors; a ``Qwen3ForCausalLM`` text encoder has its names under
    ``model.`` and an ``lm_head`` drawn from seed + 3."""
    from pipeline.model.layers import vae
    from pipeline.model.layers.text import qwen3
    from pipeline.model.loading import weights as weights_lib

    q_cfg = qwen3.Qwen3Config.from_dict(hf_config)
    text = builtin.random_weights(qwen3.network(layers=q_cfg.num_hidden_layers), q_cfg, seed)
    network, config = transformer
    v_cfg = vae.VaeConfig.from_dict({"_class_name": checkpoint.vae, **preset["vae"]})
    states = {
        "text_encoder": {"model." + k: v for k, v in text.items()} if checkpoint.causal_lm else text,
        "transformer": builtin.random_weights(network, config.from_dict(dict(preset["transformer"])), seed + 1),
        "vae": builtin.random_weights(vae.NETWORK, v_cfg, seed + 2),
    }
    if checkpoint.causal_lm:
        states["text_encoder"]["lm_head.weight"] = builtin.random_flat_params(
            {("lm_head", "kernel"): (q_cfg.vocab_size, q_cfg.hidden_size)}, seed + 3)[("lm_head", "kernel")]
    for component, state in states.items():
        library = "transformers" if component == "text_encoder" else "diffusers"
        path = os.path.join(directory, component, weights_lib.SAFETENSORS_FILES[library])
        weights_lib.write_safetensors(path, {k: v for k, v in sorted(state.items())}, align=False,
                                      metadata={"format": "pt"})
