"""Wall-clock throughput: prefill and KV-cache decode tokens per second.

Every measurement warms up first (compilation and first-call costs stay out of the numbers),
then takes the median of a few timed runs, waiting for the results each time. Numbers depend on
whatever else runs on the machine: report them, never assert them.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeedResult:
    """Attributes:
    prefill_tokens_per_s: prompt tokens processed per second (one forward pass).
    decode_tokens_per_s: tokens generated per second, batch 1, one jitted step each.
    prefill_tokens: prompt length timed.
    decode_steps: decode steps per timed run.
    """

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prefill_tokens: int
    decode_steps: int


def time_call(fn: Callable[..., Any], *args: Any, warmup: int = 1, iters: int = 3) -> float:
    """Median seconds of ``fn(*args)`` over `iters` runs after `warmup` untimed runs.

    Raises:
      ValueError: if `iters` < 1 or `warmup` < 0.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters} must be >= 1 and warmup={warmup} >= 0")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill_tokens_per_s(
    forward: Callable[[jax.Array], Any], tokens: jax.Array, *, warmup: int = 1, iters: int = 3
) -> float:
    """Prompt throughput of ``forward(tokens)``.

    Args:
      forward: ``tokens [batch, seq] int32 -> logits`` (typically jitted).
      tokens: [batch, seq] int32.
    Returns:
      ``batch * seq / median seconds``.
    """
    seconds = time_call(forward, tokens, warmup=warmup, iters=iters)
    return tokens.size / seconds


@jax.jit
def _greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)


def decode_tokens_per_s(
    step: Callable[[jax.Array, Any], tuple[jax.Array, Any]],
    cache: Any,
    first_token: jax.Array,
    *,
    steps: int = 16,
    warmup: int = 2,
    iters: int = 2,
) -> float:
    """Greedy decode throughput of a KV-cache step.

    Args:
      step: ``(token [batch, 1] int32, cache) -> (logits [batch, 1, vocab], new_cache)``.
      cache: the cache after the prompt; it needs room for ``warmup + iters * steps`` tokens.
      first_token: [batch, 1] int32, the token to feed first.
      steps: tokens generated per timed run.
      warmup: untimed steps first (compilation).
      iters: timed runs; the median is used.
    Returns:
      ``batch * steps / median seconds of a run``.
    Raises:
      ValueError: if `steps` or `iters` < 1.
    """
    if steps < 1 or iters < 1:
        raise ValueError(f"steps={steps} and iters={iters} must be >= 1")
    token = first_token
    for _ in range(warmup):
        logits, cache = step(token, cache)
        token = _greedy(logits)
    jax.block_until_ready(token)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(steps):
            logits, cache = step(token, cache)
            token = _greedy(logits)
        jax.block_until_ready(token)
        times.append(time.perf_counter() - start)
    return first_token.shape[0] * steps / statistics.median(times)
