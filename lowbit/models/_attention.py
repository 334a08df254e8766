"""Attention over a decoder's KV cache: scores and softmax, the blocked causal attention of a
prompt, and one decoded token's attention over the filled blocks only (a CPU kernel where the
step is lowered for CPU, a loop of XLA ops elsewhere).

Shapes: queries ``[batch, seq, H, group, D]`` (H key/value heads, `group` query heads each),
keys and values ``[batch, H, T, D]`` for a cache of T slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit import kernels
from lowbit.models._batch_invariant import softmax
from lowbit.models._kv_cache import LayerKV, fp8_codes, int8_scores


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (Gemma 2's soft capping); `x` itself when `cap` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def attention_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q ``[b, s, H, g, D]``, k ``[b, H, T, D]`` -> ``[b, H, g, s, T]``.

    One query per row (decode) multiplies and sums in one fused loop that reads the cache in
    its stored layout: as a dot, XLA's CPU backend copies every layer's keys to another layout
    on every step, which at long contexts costs more than the weights.
    """
    if q.shape[1] == 1:
        return jnp.sum(q[:, 0, :, :, None, :] * k[:, :, None], axis=-1)[:, :, :, None]
    return jnp.einsum("bskgd,bktd->bkgst", q, k)


def weighted_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """probs ``[b, H, g, s, T]``, v ``[b, H, T, D]`` -> ``[b, s, H, g, D]`` (as
    `attention_scores`)."""
    if probs.shape[3] == 1:
        return jnp.sum(probs[:, :, :, 0, :, None] * v[:, :, None], axis=3)[:, None]
    return jnp.einsum("bkgst,bktd->bskgd", probs, v)


def softmax_values(
    scores: jax.Array, v: jax.Array, mask: jax.Array, scale: jax.Array, cap: float | None
) -> jax.Array:
    """Scaled, capped, masked softmax of ``scores [b, H, g, s, T]`` over ``v [b, H, T, D]``,
    in v's dtype -> ``[b, s, H, g, D]``; mask ``[b, s, T]`` (True where attending)."""
    scores = softcap(scores.astype(jnp.float32) * scale, cap)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    # A row's probabilities the same bits however many rows run (`_batch_invariant`).
    probs = softmax(scores).astype(v.dtype)
    return weighted_values(probs, v)


# Queries per block of a long input's attention (`causal_attention`).
PREFILL_QUERY_BLOCK = 64


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: jax.Array,
    cap: float | None,
) -> jax.Array:
    """`softmax_values` of ``q [b, s, H, g, D]`` against ``k, v [b, H, T, D]`` whose last `s`
    possible slots hold these queries' own tokens, in blocks of `PREFILL_QUERY_BLOCK` queries.

    The s new tokens sit at slots ``slot .. slot + s - 1`` with ``slot + s <= T``, and each
    attends only to slots up to its own (`mask` is causal), so queries ``[i, j)`` need only keys
    ``[0, T - s + j)``: a prompt filling most of the cache computes about half the scores,
    exponentials and products of attending to every slot, with the same result. (A prefill
    into a new cache passes only the prompt's own `s` slots: `Decoder.__call__`'s ``fresh``.)
    """
    s, t = q.shape[1], k.shape[2]
    v = v.astype(q.dtype)
    if s < 2 * PREFILL_QUERY_BLOCK:
        return softmax_values(attention_scores(q, k), v, mask, scale, cap)
    out = []
    for i in range(0, s, PREFILL_QUERY_BLOCK):
        j = min(s, i + PREFILL_QUERY_BLOCK)
        keys = min(t, t - s + j)
        scores = attention_scores(q[:, i:j], k[:, :, :keys])
        out.append(softmax_values(scores, v[:, :, :keys], mask[:, i:j, :keys], scale, cap))
    return jnp.concatenate(out, axis=1)


# Decode attention reads the cache in blocks of this many slots (or the largest power of two
# below it that divides the cache length), and only the blocks up to the current token.
DECODE_BLOCK = 128


def decode_block(max_len: int) -> int | None:
    """Slots per block for `decode_attention` on a cache of `max_len` slots, or None when no
    power of two from 32 to `DECODE_BLOCK` divides it (attention then reads every slot)."""
    block = DECODE_BLOCK
    while block >= 32:
        if max_len % block == 0 and max_len > block:
            return block
        block //= 2
    return None


def uses_fused_decode(q: jax.Array, kv: LayerKV) -> bool:
    """Whether a decode step runs as one CPU kernel call (`lowbit.kernels.decode_attention`):
    a float32, float16 or bfloat16 cache (a bfloat16 model's), or an int8 / int4 / fp8 one
    (read by dequantizing, or for `integer_qk` by int8 products), with the kernels built,
    where the step is lowered for CPU. On XLA:CPU the block loop below costs mostly per-op
    dispatch (about 150 us a layer for SmolLM2 at 576 filled slots, against 30 us for the
    kernel)."""
    floats = {jnp.dtype(t) for t in (jnp.float32, jnp.float16, jnp.bfloat16)}
    cache_ok = kv.config is not None or (
        jnp.dtype(kv.keys.dtype) in floats and kv.values.dtype == kv.keys.dtype
    )
    return cache_ok and jnp.dtype(q.dtype) in floats and kernels.available()


def decode_attention(
    q: jax.Array,
    kv: LayerKV,
    slot: jax.Array,
    block: int,
    first: jax.Array,
    cap: float | None = None,
) -> jax.Array:
    """One query per row attending to cache slots ``first .. slot`` only.

    The cost follows the filled length, not the cache's size: a loop over blocks of `block`
    slots up to the one holding `slot`, with a running (online) softmax, so a long cache
    barely filled costs one block; only those blocks of a quantized cache are dequantized.

    Args:
      q: ``[batch, 1, H, group, D]`` queries, already scaled by ``1 / sqrt(D)`` and rotated
        like the cache.
      kv: the layer cache after this token was written at `slot`.
      slot: ``int32 []``, the query's slot.
      block: slots per block, dividing the cache length.
      first: ``int32 [batch]``, each row's first visible slot: its ``kv.start``, or later
        under a sliding window.
      cap: soft cap on the scores (`softcap`), or None.
    Returns:
      ``[batch, 1, H, group, D]`` float32.
    """
    if not uses_fused_decode(q, kv):
        return block_loop(q, kv, slot, block, first, cap)

    def fused(q, kv, slot):
        fp8 = kv.config is not None and kv.config.format == "fp8"
        # The kernel takes float32 queries (a bfloat16 model's are widened: its scores are
        # then float32 products, as the block loop's are not).
        out = kernels.decode_attention(
            q[:, 0].astype(jnp.float32),
            fp8_codes(kv.keys) if fp8 else kv.keys,
            fp8_codes(kv.values) if fp8 else kv.values,
            first,
            slot,
            kv.key_scales,
            kv.value_scales,
            integer_qk=kv.config is not None and kv.config.integer_qk,
            softcap=cap,
            rows=kv.rows,
        )
        return out[:, None]

    # The kernel where the step is lowered for CPU; the block loop on GPU / TPU. (The cache
    # is closed over, its arrays hoisted into operands: a LayerKV is not a pytree.)
    return kernels.by_platform(
        (q, slot),
        {"cpu": lambda q, slot: fused(q, kv, slot)},
        lambda q, slot: block_loop(q, kv, slot, block, first, cap),
    )


def block_loop(
    q: jax.Array,
    kv: LayerKV,
    slot: jax.Array,
    block: int,
    first_slot: jax.Array,
    cap: float | None,
) -> jax.Array:
    """`decode_attention` as a loop of XLA ops over the visible blocks (any platform)."""
    b, _, h, g, d = q.shape
    integer = kv.config is not None and kv.config.integer_qk

    def step(i, state):
        m, total, acc = state  # [b, H, g, 1], [b, H, g, 1], [b, H, g, D]
        first = i * block
        part = kv.slots(first, block)
        if integer:
            scores = int8_scores(q, part)
        else:
            scores = attention_scores(q, part.read_keys(q.dtype))
        scores = softcap(scores[:, :, :, 0].astype(jnp.float32), cap)  # [b, H, g, block]
        t = first + jnp.arange(block, dtype=jnp.int32)
        valid = (t[None, :] >= first_slot[:, None]) & (t[None, :] <= slot)  # [b, block]
        valid = valid[:, None, None, :]
        scores = jnp.where(valid, scores, jnp.finfo(jnp.float32).min)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
        p = jnp.where(valid, jnp.exp(scores - m_new), 0.0)
        carry = jnp.exp(m - m_new)
        values = part.read_values(jnp.float32)  # [b, H, block, D]
        pv = jnp.sum(p[..., None] * values[:, :, None], axis=3)  # [b, H, g, D]
        return m_new, total * carry + jnp.sum(p, axis=-1, keepdims=True), acc * carry + pv

    init = (
        jnp.full((b, h, g, 1), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((b, h, g, 1), jnp.float32),
        jnp.zeros((b, h, g, d), jnp.float32),
    )
    lo = jnp.min(first_slot) // block
    _, total, acc = jax.lax.fori_loop(lo, slot // block + 1, step, init)
    return (acc / total)[:, None]
