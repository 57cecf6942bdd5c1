"""Qwen chat prompts: ``format_prompt``, ``tokenize`` and ``truncated`` render each prompt in
a checkpoint's own chat template (its tokenizer's ``apply_chat_template``, never a copy of
it here), FLUX.2 [klein] thinking off and Z-Image thinking on; and the built-in random
models' Qwen tokenizer (``tokenizer``): a ``Qwen2TokenizerFast`` over a byte-level BPE
vocabulary without merges plus Qwen's chat tokens, with a small Qwen3-style chat template
(``CHAT_TEMPLATE``) that branches on ``enable_thinking`` as Qwen3's does, so that a family
rendering it with the wrong value gets other tokens.

Imports no jax (the torch-only fixture scripts build PyTorch pipelines with it).
"""
from __future__ import annotations

PAD, IM_START, IM_END, THINK, END_THINK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"
SPECIAL = (PAD, IM_START, IM_END, THINK, END_THINK)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                 "{% endif %}{% endif %}")


def tokenizer():
    """A ``Qwen2TokenizerFast`` over a byte-level BPE vocabulary without merges (256 byte
    symbols, then ``SPECIAL``), built with the ``tokenizers`` library, deterministic;
    right padding with ``<|endoftext|>``, no special tokens added around a text (as Qwen's),
    ``CHAT_TEMPLATE`` its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    fast = Qwen2TokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=IM_END, unk_token=None,
                              bos_token=None, model_max_length=131072, padding_side="right")
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---- prompts in a checkpoint's own chat template (FLUX.2 [klein]: thinking off; Z-Image: on)

def format_prompt(tokenizer, text: str, *, thinking: bool, family: str) -> str:
    """``text`` in the checkpoint's own chat template (its tokenizer's ``chat_template``, rendered
    by ``apply_chat_template``): one user message, the generation prompt, ``enable_thinking``
    as the family's pipeline passes it. A tokenizer without a chat template is an error naming
    what is missing and the ``family`` that needs it."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the checkpoint's tokenizer has no chat_template (tokenizer_config.json or "
                         f"chat_template.jinja): {family} formats every prompt with it")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=thinking)


def tokenize(tokenizer, prompts, max_sequence_length: int, *, thinking: bool, family: str, most: int = 512):
    """(input_ids int32 [B, L], attention_mask int32 [B, L]) of ``prompts``, chat-formatted
    (``format_prompt``), padded on the right to ``max_sequence_length`` and cut at it.
    ValueError for a length below 1 or above ``most``. The families read a caption's
    tokens from the start of its row, so the padding goes on the right whatever side a
    checkpoint's tokenizer config names (Qwen's own pad on the right)."""
    import numpy as np

    if not (isinstance(max_sequence_length, int) and 1 <= max_sequence_length <= most):
        raise ValueError(f"max_sequence_length must be an integer from 1 to {most}, got {max_sequence_length!r}")
    texts = [format_prompt(tokenizer, p, thinking=thinking, family=family) for p in prompts]
    tokenizer.padding_side = tokenizer.truncation_side = "right"
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=max_sequence_length,
                        return_tensors="np")
    return encoded.input_ids.astype(np.int32), encoded.attention_mask.astype(np.int32)


def truncated(tokenizer, prompts, max_length: int, *, thinking: bool, family: str) -> list[bool]:
    """Whether each chat-formatted prompt has more tokens than ``max_length`` (``tokenize`` cuts it)."""
    texts = [format_prompt(tokenizer, p, thinking=thinking, family=family) for p in prompts]
    return [len(row) > max_length for row in tokenizer(texts, truncation=False, verbose=False).input_ids]
