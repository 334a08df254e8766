"""Tokenizers for the reference models: GGUF byte-level BPE, and MiniLM's WordPiece file."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# ggml token types (`tokenizer.ggml.token_type`): these must never be split by BPE.
_CONTROL = 3
_USER_DEFINED = 4

# The `tokenizer.ggml.pre` names whose pre-tokenization is "each digit alone, then the GPT-2
# regex": SmolLM's family. Plain GPT-2 omits the digit split.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell"})
_GPT2_PRE = frozenset({"gpt2", "default", "mpt", "olmo", "jais"})

# SmolLM2's chat template (ChatML) inserts this system turn when the first message is not one.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> Tokenizer:
    """Build a byte-level BPE `tokenizers.Tokenizer` from GGUF `tokenizer.ggml.*` metadata.

    Control tokens (``<|im_start|>``, ``<|im_end|>``, ...) are registered as special tokens,
    so they are matched whole in input text and dropped by ``decode(..., skip_special_tokens=
    True)``. No BOS is prepended (SmolLM2 sets ``add_bos_token`` false; the chat template
    starts with ``<|im_start|>`` instead).
    """
    model_kind = metadata.get("tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model is {model_kind!r}; only byte-level BPE ('gpt2') is supported"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _DIGIT_SPLIT_PRE | _GPT2_PRE:
        raise ValueError(f"tokenizer.ggml.pre is {pre!r}, which has no known pre-tokenizer")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type", [])
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_special_tokens(special)
    return tok


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
