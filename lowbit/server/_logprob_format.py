"""Sampled tokens' log-probabilities (`TokenLogprob`) in OpenAI's answer shapes.

Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}``;
chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}``. A token's text is what the tokenizer decodes it to alone; its bytes are the raw
bytes it stands for (a byte-fallback ``<0xNN>`` token's byte, a byte-level token's bytes). A
token holding part of a character has no text of its own: it is written as OpenAI writes it,
``bytes:`` and its bytes escaped (``bytes:\\xe2\\x80``), so tokens stay apart in the
completions' ``{text: logprob}`` maps. ``text_offset`` counts the characters of the tokens
before, each decoded alone (as vLLM does), which can differ from the answer's text where a
character spans tokens.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from lowbit.server._logprobs import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Each token id's text, bytes and width (characters it decodes to alone), decoded once
    per answer.

    Args:
      tokenizer: a `tokenizers.Tokenizer`.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int], int]] = {}

    def __call__(self, token: int) -> tuple[str, list[int], int]:
        """``(text, bytes, width)`` of `token`."""
        if token not in self._seen:
            self._seen[token] = self._decode(token)
        return self._seen[token]

    def _decode(self, token: int) -> tuple[str, list[int], int]:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8")), len(text)
        piece = self.tokenizer.id_to_token(token) or ""
        alphabet = _byte_level_bytes()
        if match := _BYTE_TOKEN.fullmatch(piece):
            raw = [int(match.group(1), 16)]
        elif piece and all(c in alphabet for c in piece):
            raw = [alphabet[c] for c in piece]
        else:  # a replacement character of its own
            return text, list(text.encode("utf-8")), len(text)
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw, len(text)


def completion_logprobs(
    tokens: Sequence[int], entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int
) -> tuple[dict[str, Any], int]:
    """``/v1/completions``' ``logprobs`` for `tokens` with their `entries`, the first token at
    character `offset`; returns it and the offset after the last token."""
    names = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    out: dict[str, list] = {name: [] for name in names}
    for token, entry in zip(tokens, entries, strict=True):
        text, _, width = texts(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append({texts(t)[0]: lp for t, lp in entry.top})
        out["text_offset"].append(offset)
        offset += width
    return out, offset


def chat_logprobs(
    tokens: Sequence[int], entries: Sequence[TokenLogprob], texts: TokenTexts
) -> dict[str, Any]:
    """``/v1/chat/completions``' ``logprobs`` for `tokens` with their `entries`."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        text, raw, _ = texts(token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [
        {**item(token, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in entry.top]}
        for token, entry in zip(tokens, entries, strict=True)
    ]
    return {"content": content}
