"""Perplexity of a causal language model over fixed-length windows of a token stream.

Window `w` feeds ``tokens[b : b + context]`` (``b = w * stride``) and is scored on the next
tokens ``tokens[b + 1 : b + context + 1]``. With ``stride == context`` (the default) windows do
not overlap and every position is scored, so each prediction sees between 0 and context - 1
earlier tokens. With a smaller stride, windows after the first score only their last `stride`
positions, so each token is scored once with at least ``context - stride`` tokens of context.

    nll = mean over scored tokens of -log softmax(logits)[target]     (nats)
    ppl = exp(nll)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

LogitsFn = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerplexityResult:
    """Attributes:
    nll: mean negative log-likelihood per scored token, in nats.
    tokens: number of scored tokens.
    windows: number of model calls.
    context: tokens per window.
    window_seconds: wall time of each window (model call and scoring, waited for), in order;
      the first includes compilation. A window is one batch-1 prefill of `context` tokens, so
      the later ones time prefill without extra runs.
    """

    nll: float
    tokens: int
    windows: int
    context: int
    window_seconds: tuple[float, ...] = ()

    @property
    def perplexity(self) -> float:
        """exp(nll)."""
        return math.exp(self.nll)


@jax.jit
def token_nll(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Summed weighted negative log-likelihood of `targets`.

    Args:
      logits: [batch, seq, vocab] float (any float dtype; computed in float32).
      targets: [batch, seq] int.
      weights: [batch, seq] float32, 1 where a position is scored and 0 where not.
    Returns:
      [] float32, sum of ``-log softmax(logits)[target] * weight``.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)
    return -jnp.sum(picked[..., 0] * weights)


def window_starts(n_tokens: int, *, context: int, stride: int, max_tokens: int) -> list[int]:
    """Start offsets of the windows `perplexity` evaluates.

    Returns:
      Starts ``0, stride, 2 * stride, ...``, as many as fit in `n_tokens` (each window needs
      ``context + 1`` tokens) until `max_tokens` tokens are scored.
    Raises:
      ValueError: for a non-positive size, ``stride > context``, or fewer than ``context + 1``
        tokens.
    """
    if context < 1 or stride < 1 or max_tokens < 1:
        raise ValueError(
            f"context={context}, stride={stride} and max_tokens={max_tokens} must be positive"
        )
    if stride > context:
        raise ValueError(
            f"stride={stride} is larger than context={context}; tokens would be skipped"
        )
    if n_tokens < context + 1:
        raise ValueError(
            f"the text has {n_tokens} tokens; perplexity with context={context} needs at least "
            f"{context + 1}. Use a longer text or a smaller context."
        )
    starts, scored, begin = [], 0, 0
    while begin + context + 1 <= n_tokens and scored < max_tokens:
        starts.append(begin)
        scored += context if begin == 0 else stride
        begin += stride
    return starts


def perplexity(
    logits_fn: LogitsFn,
    tokens: np.ndarray | list[int],
    *,
    context: int = 512,
    stride: int | None = None,
    max_tokens: int = 4096,
    on_window: Callable[[int, int], None] | None = None,
    on_logits: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], None] | None = None,
) -> PerplexityResult:
    """Perplexity of a causal LM on a token stream.

    Args:
      logits_fn: ``tokens [1, context] int32 -> logits [1, context, vocab]``; called once per
        window with the same shape, so a jitted function compiles once.
      tokens: [n] int token ids of the text.
      context: tokens per window.
      stride: distance between window starts; defaults to `context` (no overlap).
      max_tokens: stop after the window that reaches this many scored tokens.
      on_window: called as ``on_window(done, total)`` after each window (progress bars).
      on_logits: called as ``on_logits(window, targets, logits, weights)`` after each window
        (outside its timing), with its tokens and targets ([1, context] int32), its logits and
        the scored positions' weights ([1, context] float32, 1 where scored): to compute more
        from the same logits (`lowbit.eval.divergence`) without keeping them.
    Returns:
      A `PerplexityResult`.
    Raises:
      ValueError: see `window_starts`; or if `logits_fn` returns a wrong shape.
    """
    stride = context if stride is None else stride
    ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
    starts = window_starts(ids.size, context=context, stride=stride, max_tokens=max_tokens)
    full = np.ones((1, context), np.float32)
    tail = np.zeros((1, context), np.float32)
    tail[:, context - stride :] = 1.0
    total, count = jnp.zeros((), jnp.float32), 0
    seconds = []
    for i, begin in enumerate(starts):
        start = time.perf_counter()
        window = jnp.asarray(ids[begin : begin + context][None])
        targets = jnp.asarray(ids[begin + 1 : begin + context + 1][None])
        logits = logits_fn(window)
        if logits.ndim != 3 or logits.shape[:2] != (1, context):
            raise ValueError(
                f"logits_fn returned shape {tuple(logits.shape)}; expected (1, {context}, vocab)"
            )
        weights = jnp.asarray(full if begin == 0 else tail)
        total = jax.block_until_ready(total + token_nll(logits, targets, weights))
        seconds.append(time.perf_counter() - start)
        if on_logits is not None:
            on_logits(window, targets, logits, weights)
        count += context if begin == 0 else stride
        if on_window is not None:
            on_window(i + 1, len(starts))
    return PerplexityResult(
        nll=float(total) / count,
        tokens=count,
        windows=len(starts),
        context=context,
        window_seconds=tuple(seconds),
    )
