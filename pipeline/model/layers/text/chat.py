"""Prompts in a checkpoint's own chat template, as the Qwen3 text encoder's pipelines feed
it (FLUX.2 [klein]: thinking off; Z-Image: on): each prompt one user message with the
generation prompt, rendered by the checkpoint's tokenizer (``Tokenizer.render_chat``, never
a copy of its template here), then tokenised, padded on the right and cut.

Imports no jax (the torch-only fixture scripts build PyTorch pipelines beside it)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChatPrompts:
    """A family's chat prompts: ``family`` (for messages), ``thinking`` (its pipeline's
    ``enable_thinking``) and the most text tokens it takes (``most``)."""
    family: str
    thinking: bool
    most: int

    def format_prompt(self, tokenizer, text: str) -> str:
        """``text`` in the checkpoint's own chat template (its tokenizer's ``chat_template``):
        one user message, the generation prompt, ``enable_thinking`` as the family's
        pipeline passes it. A tokenizer without a chat template is an error naming what is
        missing and the family that needs it."""
        if not tokenizer.chat_template:
            raise ValueError(f"the checkpoint's tokenizer has no chat_template (tokenizer_config.json or "
                             f"chat_template.jinja): {self.family} formats every prompt with it")
        return tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True,
                                     enable_thinking=self.thinking)

    def tokenize(self, tokenizer, prompts, max_sequence_length: int):
        """(input_ids int32 [B, L], attention_mask int32 [B, L]) of ``prompts``, chat-formatted
        (``format_prompt``), padded on the right to ``max_sequence_length`` and cut at it.
        ValueError for a length below 1 or above ``most``. The families read a caption's
        tokens from the start of its row, so the padding goes on the right whatever side a
        checkpoint's tokenizer config names (Qwen's own pad on the right)."""
        if not (isinstance(max_sequence_length, int) and 1 <= max_sequence_length <= self.most):
            raise ValueError(f"max_sequence_length must be an integer from 1 to {self.most}, "
                             f"got {max_sequence_length!r}")
        return tokenizer.encode([self.format_prompt(tokenizer, p) for p in prompts], max_sequence_length)

    def truncated(self, tokenizer, prompts, max_length: int) -> list[bool]:
        """Whether each chat-formatted prompt has more tokens than ``max_length`` (``tokenize``
        cuts it)."""
        counts = tokenizer.counts([self.format_prompt(tokenizer, p) for p in prompts])
        return [count > max_length for count in counts]
