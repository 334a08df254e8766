"""Speculative decoding: guess a row's next tokens, by prompt lookup or with a small draft
model, and let one forward pass of the served model check them all.

A row's draft is what followed the latest earlier occurrence of its last ``n`` tokens (prompt
and answer so far), for the longest ``n`` from `NGRAM_MAX` down to `NGRAM_MIN` that occurs
earlier: the prompt-lookup decoding of vLLM's ``ngram`` method and of llama.cpp's lookup
examples. Answers that copy much of their prompt (code edits, quotes, extraction) draft long
runs that the model then confirms.

A draft model (`DraftModel`: a smaller model of the same tokenizer) guesses instead: it keeps
its own KV cache of the same slots on the same clock (`Scheduler`), fed lazily. Each turn it
is brought up to the row's latest token (`windows`: only the tokens it has not seen, never a
slot before the row's start), then decodes ``K - 1`` more greedy tokens in one call.

`lowbit.server._programs.verify` feeds each row its latest token and its draft ``d1 .. dK``
at once and returns the greedy token after each; the row's guesses hold up to the first one
the model disagrees with (`accepted`). The scheduler's clock is shared, so every row keeps the
fewest any of them accepted, plus the model's own next token: all of them the tokens greedy
decoding gives, one step of the model at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flax import nnx

# The n-gram lengths looked up, longest first.
NGRAM_MAX = 3
NGRAM_MIN = 1


def draft(context: np.ndarray, k: int) -> np.ndarray:
    """Up to `k` guessed next tokens for a row whose text so far is ``context [L]`` int:
    the tokens after the latest earlier occurrence of its last ``n`` tokens (``n`` from
    `NGRAM_MAX` down to `NGRAM_MIN`, the longest that occurs); empty when none does.

    >>> draft(np.array([5, 6, 7, 8, 9, 5, 6]), 2).tolist()
    [7, 8]
    """
    length = len(context)
    for n in range(min(NGRAM_MAX, length - 1), NGRAM_MIN - 1, -1):
        # Windows starting at 0 .. L - n - 1: every occurrence but the tail itself.
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if hits.size:
            after = int(hits[-1]) + n
            return context[after : after + k]
    return context[:0]


# Widths of the calls that feed a draft model tokens it has not seen (`windows`).
FEED_WIDTHS = (64, 32, 16, 8, 4, 2, 1)
# A row this many tokens behind (its latest one included) is fed with the other rows in
# one call; one further behind (a new prompt, turns that did not speculate) alone.
STEADY = 2


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A small model that guesses for the served one (``lowbit serve --speculate MODEL``).

    Attributes:
      model: a `lowbit.models.Decoder` of the served model's tokenizer (its float module).
      params: the parameters to run (quantized or not); None: the module's own.
    """

    model: nnx.Module
    params: Any = None


def windows(need: int) -> list[int]:
    """The widths of the calls that feed a row its `need` unseen tokens (the last one its
    latest), widest first: a sum of `FEED_WIDTHS`, so that no call reaches back past what the
    row has seen (nor before its start).

    >>> windows(13)
    [8, 4, 1]
    >>> windows(130)
    [64, 64, 2]
    """
    out = []
    for w in FEED_WIDTHS:
        while need >= w:
            out.append(w)
            need -= w
    return out


def accepted(guess: np.ndarray, greedy: np.ndarray) -> int:
    """How many leading tokens of ``guess [k]`` the model agrees with, where ``greedy [>= k]``
    is its greedy token after the row's latest token followed by ``guess[:j]``, at ``j``.

    >>> accepted(np.array([4, 5, 6]), np.array([4, 5, 9, 2]))
    2
    """
    same = guess == greedy[: len(guess)]
    return len(guess) if same.all() else int(np.argmin(same))


@dataclasses.dataclass
class Stats:
    """Counts since start (the scheduler thread keeps them; `/metrics` reads them).

    Attributes:
      drafted_tokens: tokens guessed and checked.
      accepted_tokens: guessed tokens handed out (each saved one decode step of its row).
    """

    drafted_tokens: int = 0
    accepted_tokens: int = 0
