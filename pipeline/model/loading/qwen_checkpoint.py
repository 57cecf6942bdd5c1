"""The built-in random checkpoints of the Qwen-text families (FLUX.2 [klein], Z-Image), in
diffusers' layout: a family's presets give the configs, the classes and the seed; this
writes the folder. Imports no jax at import time (the torch-only fixture scripts build
PyTorch pipelines from the presets)."""
from __future__ import annotations

import os

from pipeline.model.loading import builtin, qwen_tokenizer
from pipeline.model.loading.qwen_tokenizer import IM_END, PAD


def qwen3_config(preset: dict) -> dict:
    """The preset's ``text_encoder/config.json`` keys (transformers' ``Qwen3Config``'s), its
    vocabulary and special ids the built-in Qwen tokenizer's (``qwen_tokenizer``)."""
    vocab = qwen_tokenizer.vocabulary()
    return dict({"vocab_size": len(vocab)}, **preset["qwen3"], pad_token_id=vocab[PAD], bos_token_id=vocab[PAD],
                eos_token_id=vocab[IM_END])


def write_configs(directory: str, name: str, preset: dict, index: dict, classes: dict) -> dict:
    """model_index.json (``index``), the model card's licence (when the preset has one), the
    scheduler's, transformer's and VAE's configs (``classes``: their ``_class_name``s and the
    text encoder's ``architecture``), the tokenizer and the text encoder's config, which is
    returned."""
    from pipeline.model.layers.text import qwen3

    builtin.write_json(os.path.join(directory, "model_index.json"), index)
    if preset.get("license"):  # the model card's front matter, as the hub keeps it
        with open(os.path.join(directory, "README.md"), "w", encoding="utf-8") as f:
            f.write(f"---\nlicense: {preset['license']}\n---\n\n{name}: random weights, {preset['version']}\n")
    meta = {"_diffusers_version": builtin.DIFFUSERS_VERSION}
    for component, file in (("scheduler", "scheduler_config.json"), ("transformer", "config.json"),
                            ("vae", "config.json")):
        builtin.write_json(os.path.join(directory, component, file),
                           {"_class_name": classes[component], **meta, **preset[component]})
    qwen_tokenizer.write(os.path.join(directory, "tokenizer"))
    hf_config = qwen3.hf_config(**qwen3_config(preset), architectures=[classes["text_encoder"]],
                                transformers_version=builtin.TRANSFORMERS_VERSION)
    hf_config["dtype"] = preset["weights_dtype"]
    builtin.write_json(os.path.join(directory, "text_encoder", "config.json"), hf_config)
    return hf_config


def write_random_weights(directory: str, preset: dict, hf_config: dict, net, transformer_config, *, vae_class: str,
                         seed: int, causal_lm: bool = False) -> None:
    """Random weights drawn from ``seed`` (the text encoder's, the transformer's (``net``, its
    module, from ``transformer_config``), the VAE's: seed, seed + 1, seed + 2), in PyTorch
    names, as safetensors; ``causal_lm``: the text encoder is a ``Qwen3ForCausalLM`` (its
    names under ``model.``, and an ``lm_head`` drawn from seed + 3)."""
    from pipeline.model.layers import vae
    from pipeline.model.layers.text import qwen3
    from pipeline.model.loading import convert, weights as weights_lib

    q_cfg = qwen3.Qwen3Config.from_dict(hf_config)
    t_cfg = transformer_config.from_dict(dict(preset["transformer"]))
    v_cfg = vae.VaeConfig.from_dict({"_class_name": vae_class, **preset["vae"]})
    text = qwen3.to_torch(convert.unflatten(builtin.random_flat_params(
        qwen3.param_shapes(q_cfg), seed, lambda p: convert.stack_of(p, qwen3.LAYOUT) is not None)), q_cfg)
    states = {
        "text_encoder": {"model." + k: v for k, v in text.items()} if causal_lm else text,
        "transformer": net.to_torch(convert.unflatten(builtin.random_flat_params(
            net.param_shapes(t_cfg), seed + 1, lambda p: convert.stack_of(p, net.LAYOUT) is not None)), t_cfg),
        "vae": vae.to_torch(convert.unflatten(builtin.random_flat_params(vae.param_shapes(v_cfg), seed + 2)), v_cfg),
    }
    if causal_lm:
        states["text_encoder"]["lm_head.weight"] = builtin.random_flat_params(
            {("lm_head", "kernel"): (q_cfg.vocab_size, q_cfg.hidden_size)}, seed + 3)[("lm_head", "kernel")]
    for component, state in states.items():
        library = "transformers" if component == "text_encoder" else "diffusers"
        path = os.path.join(directory, component, weights_lib.SAFETENSORS_FILES[library])
        weights_lib.write_safetensors(path, {k: v for k, v in sorted(state.items())}, align=False,
                                      metadata={"format": "pt"})
