"""The Qwen tokenizer of a checkpoint (``load``) and the built-in random models' (``write``): a
byte-level BPE vocabulary without merges plus Qwen's chat tokens, with a small Qwen3-style
chat template (``CHAT_TEMPLATE``) that branches on ``enable_thinking`` as Qwen3's does, so
that a family rendering it with the wrong value gets other tokens. Prompts are rendered in
a checkpoint's template by ``pipeline.model.layers.text.chat``.

Imports no jax (the torch-only fixture scripts build PyTorch pipelines with it).
"""
from __future__ import annotations

from pipeline.model.loading import tokenizer as tokenizer_lib

PAD, IM_START, IM_END, THINK, END_THINK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"
SPECIAL = (PAD, IM_START, IM_END, THINK, END_THINK)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                 "{% endif %}{% endif %}")
MODEL_MAX_LENGTH = 131072  # Qwen3's tokenizer config's


def vocabulary() -> dict[str, int]:
    """The built-in vocabulary: the 256 byte symbols, then ``SPECIAL``."""
    return {s: i for i, s in enumerate(tokenizer_lib.byte_symbols() + list(SPECIAL))}


def write(folder: str) -> None:
    """The built-in Qwen tokenizer's files (``tokenizer.json``, built with the ``tokenizers``
    library, and its config as ``Qwen2TokenizerFast.save_pretrained`` writes it): byte-level
    BPE without merges, ``SPECIAL`` added, no special tokens added around a text (as
    Qwen's), padding with ``<|endoftext|>`` on the right, ``CHAT_TEMPLATE``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = vocabulary()
    base = {s: i for s, i in vocab.items() if s not in SPECIAL}
    backend = Tokenizer(models.BPE(base, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer_lib.write_json(folder, backend, "Qwen2Tokenizer",
                             {"bos_token": None, "eos_token": IM_END, "pad_token": PAD, "unk_token": None},
                             MODEL_MAX_LENGTH, CHAT_TEMPLATE, padding_side="right")


def load(folder: str):
    """The checkpoint's Qwen tokenizer (``tokenizer.from_json``)."""
    return tokenizer_lib.from_json(folder, MODEL_MAX_LENGTH)

