"""Text of a growing token list, released as it becomes final: a character split across
tokens is held back, and so is a tail that may be the start of a stop string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    """Decodes `tokens` as they come and finds stop strings.

    Args:
      tokenizer: a `tokenizers.Tokenizer`.
      stop: strings that end the answer (not included in it).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.sent = 0  # characters released so far
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def add(self, tokens: Sequence[int]) -> str:
        """Adds `tokens`; returns the newly final text (empty while held back). After a stop
        string, `stopped` is True and the text ends before it."""
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self._text()
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                self.stopped = True
                return self._release(text[:at])
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens
            return ""
        hold = max((_overlap(text, s) for s in self.stop), default=0)
        return self._release(text[: len(text) - hold])

    def finish(self) -> str:
        """The rest of the text at the end of the answer."""
        if self.stopped:
            return ""
        return self._release(self._text())

    def _release(self, text: str) -> str:
        new = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return new


def _overlap(text: str, stop: str) -> int:
    """Length of the longest tail of `text` that is a head of `stop` (shorter than it)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
