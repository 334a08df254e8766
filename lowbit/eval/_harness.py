"""Compiled runners for the reference models, shared by every recipe of one model.

A runner holds a model's graph definition and jitted functions that take the parameters as an
argument: ``forward(params, tokens)``. The float parameters and each recipe's quantized ones
(QArrays in place of arrays) go through the same jitted function, which the quantization engine
interprets; jit compiles once per parameter layout (one per recipe) and reuses it for every
window, batch and timing run of that recipe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit.engine import interpret
from lowbit.eval._perplexity import PerplexityResult, perplexity
from lowbit.eval._speed import SpeedResult, decode_tokens_per_s, prefill_tokens_per_s


@dataclasses.dataclass(frozen=True, eq=False)
class LMRunner:
    """Jitted entry points of a causal LM with KV cache (`lowbit.models.Decoder`).

    Attributes:
      graphdef: the module structure (`nnx.split(model)[0]`).
      forward: ``(params, tokens [batch, seq] int32) -> logits [batch, seq, vocab]``.
      step: ``(params, tokens [batch, 1] int32, cache) -> (logits [batch, 1, vocab], cache)``.
      init_cache: ``(batch, max_len) -> cache``.
    """

    graphdef: Any
    forward: Callable[..., jax.Array]
    step: Callable[..., tuple[jax.Array, Any]]
    init_cache: Callable[[int, int], Any]


def lm_runner(model: nnx.Module, kv_cache: Any = None) -> tuple[LMRunner, nnx.State]:
    """Splits an NNX causal LM into a runner and its float parameters.

    Args:
      model: a module called as ``model(tokens)`` -> logits and ``model(tokens, cache=cache)``
        -> ``(logits, cache)``, with ``init_cache(batch, max_len, kv_cache)``.
      kv_cache: a quantized KV cache format (``"int8"``, a `KVCacheConfig`, ...) or None. With
        one, `forward` writes the tokens into an empty cache of that format and attends to
        what the cache gives back, so perplexity sees the cache's rounding.
    Returns:
      ``(runner, params)``.
    """
    graphdef, params = nnx.split(model)

    def forward(state, tokens):
        module = nnx.merge(graphdef, state)
        if kv_cache is None:
            return module(tokens)
        cache = module.init_cache(tokens.shape[0], tokens.shape[1], kv_cache)
        return module(tokens, cache=cache)[0]

    def step(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache=cache)

    runner = LMRunner(
        graphdef=graphdef,
        forward=jax.jit(interpret(forward)),
        step=jax.jit(interpret(step)),
        init_cache=lambda batch, max_len: model.init_cache(batch, max_len, kv_cache),
    )
    return runner, params


def lm_perplexity(
    runner: LMRunner, params: Any, tokens: np.ndarray, **options: Any
) -> PerplexityResult:
    """`perplexity` of ``runner.forward(params, .)`` on `tokens`; `options` are `perplexity`'s
    (``context``, ``stride``, ``max_tokens``, ``on_window``) with its defaults."""
    return perplexity(lambda window: runner.forward(params, window), tokens, **options)


def lm_speed(
    runner: LMRunner,
    params: Any,
    prompt: np.ndarray,
    *,
    decode_steps: int = 16,
    iters: int = 2,
    prefill_seconds: float | None = None,
) -> SpeedResult:
    """Prefill throughput on `prompt` and greedy decode throughput from an empty cache.

    Args:
      prompt: [seq] int token ids, the prefill batch (batch 1); with seq = the perplexity
        context the prefill reuses that compiled function.
      decode_steps: tokens per timed decode run.
      iters: timed runs per measurement.
      prefill_seconds: a prefill time of this prompt's shape already measured (e.g. the median
        perplexity window); the prefill is then not run again.
    Returns:
      A `SpeedResult`.
    """
    tokens = jnp.asarray(np.asarray(prompt, np.int32).reshape(1, -1))
    if prefill_seconds is not None:
        prefill = tokens.size / prefill_seconds
    else:
        prefill = prefill_tokens_per_s(
            lambda t: runner.forward(params, t), tokens, warmup=1, iters=iters
        )
    warmup = 2
    # Room for every step, rounded up so the cache length is a stable compile shape.
    max_len = -(-(warmup + iters * decode_steps) // 64) * 64
    decode = decode_tokens_per_s(
        lambda t, c: runner.step(params, t, c),
        runner.init_cache(1, max_len),
        tokens[:, :1],
        steps=decode_steps,
        warmup=warmup,
        iters=iters,
    )
    return SpeedResult(
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        prefill_tokens=int(tokens.size),
        decode_steps=decode_steps,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class EncoderRunner:
    """A sentence encoder: ``embed(params, sentences) -> [n, d]`` float32 numpy embeddings.

    Attributes:
      graphdef: the module structure.
      embed: tokenizes and pads the sentences as one batch (width rounded up to a multiple of
        `LENGTH_BUCKET` so that similar lists share a compilation), then runs the jitted
        ``mean_pool(model(tokens, mask), mask)``.
    """

    graphdef: Any
    embed: Callable[[Any, Sequence[str]], np.ndarray]


LENGTH_BUCKET = 16


def pad_batch(tokenizer: Any, sentences: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, each ``[n, width]`` int32, zero-padded on the right.

    Raises:
      ValueError: if `sentences` is empty.
    """
    if not sentences:
        raise ValueError("sentences is empty; give at least one sentence")
    encodings = tokenizer.encode_batch(list(sentences))
    width = -(-max(len(e.ids) for e in encodings) // LENGTH_BUCKET) * LENGTH_BUCKET
    tokens = np.zeros((len(encodings), width), np.int32)
    mask = np.zeros((len(encodings), width), np.int32)
    for row, encoding in enumerate(encodings):
        tokens[row, : len(encoding.ids)] = encoding.ids
        mask[row, : len(encoding.ids)] = 1
    return tokens, mask


def encoder_runner(
    model: nnx.Module, tokenizer: Any, pool: Callable[[jax.Array, jax.Array], jax.Array]
) -> tuple[EncoderRunner, nnx.State]:
    """Splits an NNX sentence encoder into a runner and its float parameters.

    Args:
      model: called as ``model(tokens [n, s] int32, mask [n, s] int32) -> [n, s, d]``.
      tokenizer: its `tokenizers.Tokenizer` (no fixed padding).
      pool: ``(hidden [n, s, d], mask [n, s]) -> [n, d]`` (e.g. `lowbit.models.mean_pool`).
    Returns:
      ``(runner, params)``.
    """
    graphdef, params = nnx.split(model)

    def apply(state, tokens, mask):
        return pool(nnx.merge(graphdef, state)(tokens, mask), mask)

    compiled = jax.jit(interpret(apply))

    def embed(state, sentences):
        tokens, mask = pad_batch(tokenizer, sentences)
        return np.asarray(compiled(state, jnp.asarray(tokens), jnp.asarray(mask)), np.float32)

    return EncoderRunner(graphdef=graphdef, embed=embed), params
