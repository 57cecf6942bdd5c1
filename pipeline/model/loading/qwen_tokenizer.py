"""Qwen chat prompts: ``format_prompt``, ``tokenize`` and ``truncated`` render each prompt in
a checkpoint's own chat template (``tokenizer.Tokenizer.render_chat``, never a copy of it
here), FLUX.2 [klein] thinking off and Z-Image thinking on; and the built-in random
models' Qwen tokenizer (``write``): a byte-level BPE vocabulary without merges plus Qwen's
chat tokens, with a small Qwen3-style chat template (``CHAT_TEMPLATE``) that branches on
``enable_thinking`` as Qwen3's does, so that a family rendering it with the wrong value gets
other tokens.

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


# ---- prompts in a checkpoint's own chat template (FLUX.2 [klein]: thinking off; Z-Image: on)

def format_prompt(tokenizer, text: str, *, thinking: bool, family: str) -> str:
    """``text`` in the checkpoint's own chat template (its tokenizer's ``chat_template``): one
    user message, the generation prompt, ``enable_thinking`` as the family's pipeline passes
    it. A tokenizer without a chat template is an error naming what is missing and the
    ``family`` that needs it."""
    if not tokenizer.chat_template:
        raise ValueError(f"the checkpoint's tokenizer has no chat_template (tokenizer_config.json or "
                         f"chat_template.jinja): {family} formats every prompt with it")
    return tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True,
                                 enable_thinking=thinking)


def tokenize(tokenizer, prompts, max_sequence_length: int, *, thinking: bool, family: str, most: int = 512):
    """(input_ids int32 [B, L], attention_mask int32 [B, L]) of ``prompts``, chat-formatted
    (``format_prompt``), padded on the right to ``max_sequence_length`` and cut at it. ValueError for a
    length below 1 or above ``most``. The families read a caption's tokens from the start of
    its row, so the padding goes on the right whatever side a checkpoint's tokenizer config
    names (Qwen's own pad on the right)."""
    if not (isinstance(max_sequence_length, int) and 1 <= max_sequence_length <= most):
        raise ValueError(f"max_sequence_length must be an integer from 1 to {most}, got {max_sequence_length!r}")
    texts = [format_prompt(tokenizer, p, thinking=thinking, family=family) for p in prompts]
    return tokenizer.encode(texts, max_sequence_length)


def truncated(tokenizer, prompts, max_length: int, *, thinking: bool, family: str) -> list[bool]:
    """Whether each chat-formatted prompt has more tokens than ``max_length`` (``tokenize`` cuts it)."""
    texts = [format_prompt(tokenizer, p, thinking=thinking, family=family) for p in prompts]
    return [count > max_length for count in tokenizer.counts(texts)]
