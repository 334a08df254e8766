"""Tokenizers for the reference models: GGUF vocabularies (built in `_gguf_tokenizer`), SmolLM2's
ChatML prompt, and MiniLM's WordPiece file."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer

from ._gguf_tokenizer import tokenizer_from_gguf

__all__ = ["chat_prompt", "tokenizer_from_gguf", "wordpiece_tokenizer"]

# SmolLM2's chat template (ChatML) inserts this system turn when the first message is not one.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat_prompt(
    messages: str | Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    default_system: str | None = SMOLLM2_DEFAULT_SYSTEM,
) -> str:
    """Render messages in SmolLM2's ChatML chat template.

    Args:
      messages: a user message, or a list of ``{"role": ..., "content": ...}`` dicts.
      add_generation_prompt: end with ``<|im_start|>assistant\\n`` so the model answers.
      default_system: system text inserted when the first message is not a system message,
        as the template stored in the GGUF metadata does; None inserts nothing.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not messages:
        raise ValueError("messages is empty; give at least one message")
    parts = []
    if default_system is not None and messages[0].get("role") != "system":
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] is {m!r}; each needs 'role' and 'content'")
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def wordpiece_tokenizer(path: str | os.PathLike[str], max_length: int = 256) -> Tokenizer:
    """Load a BERT `tokenizer.json`, without fixed padding and truncating at `max_length`.

    The MiniLM file pads every input to 128 tokens; padding is done per batch instead, by
    `embed_sentences`. `max_length` defaults to sentence-transformers' ``max_seq_length`` for
    all-MiniLM-L6-v2 (256), which is what that library truncates to.
    """
    if max_length < 2:
        raise ValueError(f"max_length is {max_length}; it must leave room for [CLS] and [SEP]")
    tok = Tokenizer.from_file(os.fspath(path))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    return tok
