"""Greedy decoding with the functional KV-cache path of `Llama`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from ._llama import KVCache, Llama

# Prompt lengths and cache sizes are rounded up to these so that the jitted prefill and decode
# step compile once per bucket rather than once per prompt.
_PROMPT_BUCKET = 32
_CACHE_BUCKET = 128

DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


@functools.partial(jax.jit, static_argnums=0)
def _prefill(
    graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, n_real: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """Run the padded prompt; return the last real token's logits and a cache of length n_real.

    Padding after the prompt is harmless: causal attention keeps it out of the real positions,
    and its cache slots are overwritten by the decode steps that follow.
    """
    model = nnx.merge(graphdef, state)
    logits, cache = model(tokens, cache=cache)
    last = jax.lax.dynamic_index_in_dim(logits, n_real - 1, axis=1, keepdims=False)
    return last, dataclasses.replace(cache, length=n_real)


@functools.partial(jax.jit, static_argnums=0)
def _decode(
    graphdef: nnx.GraphDef, state: nnx.State, token: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """One step: token ``[batch, 1]`` -> (logits ``[batch, vocab]``, new cache)."""
    model = nnx.merge(graphdef, state)
    logits, cache = model.decode_step(token, cache)
    return logits[:, -1], cache


def _greedy(logits: jax.Array) -> jax.Array:
    """logits ``[batch, vocab]`` -> next tokens ``[batch, 1]`` int32."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def generate_greedy(
    model: Llama,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    stop_tokens: Sequence[str] = DEFAULT_STOP_TOKENS,
) -> str:
    """Greedy continuation of `prompt` (already formatted, e.g. by `chat_prompt`).

    Generation stops after `max_new_tokens` tokens or at the first of `stop_tokens` (which is
    not included). Returns the decoded new text, special tokens dropped.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("prompt encodes to no tokens")
    stop_ids = {tokenizer.token_to_id(t) for t in stop_tokens} - {None}
    n = len(ids)
    padded = np.zeros((1, _round_up(n, _PROMPT_BUCKET)), np.int32)
    padded[0, :n] = ids
    cache = model.init_cache(1, _round_up(padded.shape[1] + max_new_tokens, _CACHE_BUCKET))
    graphdef, state = nnx.split(model)
    logits, cache = _prefill(graphdef, state, jnp.asarray(padded), jnp.int32(n), cache)
    token = _greedy(logits)
    out: list[int] = []
    for step in range(max_new_tokens):
        tid = int(token[0, 0])
        if tid in stop_ids:
            break
        out.append(tid)
        if step + 1 < max_new_tokens:
            logits, cache = _decode(graphdef, state, token, cache)
            token = _greedy(logits)
    return tokenizer.decode(out, skip_special_tokens=True)
