"""The compiled programs the scheduler runs: decode steps over every slot, prefill of one
prompt, and the moves that place a prefilled prompt in a slot or slide the slots' cache.

The slots share one KV cache of ``B`` rows and ``T`` token slots with one clock: every decode
step writes all rows at the cache's ``length``. A row's prompt sits just before the clock
(``start[r] .. length - 1``) and its rotary positions count from its ``start``, so rows that
joined at different times decode side by side, each seeing only its own tokens. Free rows
keep their ``start`` at ``T``: they attend to nothing and their tokens are ignored.

Every program here is a plain function (the model's ones take its graph definition first):
the scheduler compiles each once per shape (`lowbit.api.compile_stored`, which keeps the
traced form for the next start), donating the cache it is given.

A prompt is prefilled as `lowbit.generate` prefills a batch of one (left-padded to a
bucketed width ``W``, in a cache of the widest one-pass width's slots, whose slots past ``W``
stay empty and unseen), alone or in a batch of prompts of the same width
(`lowbit.server._batch_prefill`), then copied into its row (`insert`, one program for every
``W``). So a slot computes what ``generate_tokens([prompt], key=seed)`` computes (bit for bit
when prefilled alone; a batch's shape may round its floats otherwise). A prompt too long
for one pass is prefilled in chunks (`prefill_chunk`) into a ``T``-slot cache, between decode
steps of the others (the same tokens up to float rounding: the chunks' products differ in
shape, and a quantized cache takes its key offset from the first chunk).

While fewer rows are busy than there are slots, `decode_rows` decodes only the busy ones
(padded to a bucketed ``b`` rows): the cache is handed to `decode` with those rows
(`KVCache.rows`), which its writes and its attention index in place, so no cache row is copied
and a step costs about ``b / B`` of the dense one at any cache length. Free rows need no step:
they see nothing, and a new prompt's `insert` writes every slot its row will read. `verify`
feeds some rows several tokens at once (speculative decoding's check,
`lowbit.server._speculate`), in place in the same way.

When the clock reaches ``T``, `shift` slides the whole cache left by the first row's start (one
program for any offset); positions are slot minus start, so nothing else changes.

Shapes: ``B`` slots, ``T`` cache slots, ``W`` a prefill width, ``V`` vocabulary, ``S`` the most
decode steps one call runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit.engine import interpret
from lowbit.models import KVCache, greedy_tokens, sample_rows, take_rows
from lowbit.server._logprobs import TokenLogprobs, token_logprobs
from lowbit.server._penalties import count_tokens, penalize, restart_counts
from lowbit.server._protocol import MAX_LOGPROBS

# Decode steps one call may run (outputs are [B, MAX_STEPS]).
MAX_STEPS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Each row's sampling settings and PRNG state.

    Attributes:
      keys: ``[B, 2]`` uint32, the raw data of each row's ``jax.random.key(seed)``.
      count: ``[B]`` int32, tokens the row has sampled so far (step ``i`` draws with
        ``fold_in(key, i)``, as `generate_tokens` does).
      temperature: ``[B]`` float32, 0 for greedy.
      top_k: ``[B]`` int32, 0 for all tokens.
      top_p: ``[B]`` float32.
      presence, frequency: ``[B]`` float32, the penalties (`lowbit.server._penalties`; 0:
        none). Only decode steps apply them: a first token follows no generated one.
      bias: ``[B, V]`` float32, a request's ``logit_bias``, added to the logits before
        sampling; zeros for a row without one, which then samples exactly what it would
        without.
      allowed: ``[B, ceil(V / 32)]`` uint32, the tokens each row may sample: bit ``t % 32``
        of word ``t // 32`` for token ``t`` (a grammar's mask, `lowbit.server._grammar`;
        every bit set for a row without one). Bits, not a ``[B, V]`` bias: a constrained
        row's mask changes every step, and 32 times fewer bytes go to the device.
    """

    keys: jax.Array
    count: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    presence: jax.Array
    frequency: jax.Array
    bias: jax.Array
    allowed: jax.Array


def allowed_bits(words: int, n: int) -> np.ndarray:
    """``[words]`` uint32 with the bits of ids ``0 .. n - 1`` set (`RowSampling.allowed`'s
    layout): every token of a row without a grammar, when `n` is the logits width."""
    ids = np.arange(words * 32)
    return np.packbits(ids < n, bitorder="little").view("<u4").astype(np.uint32)


def unpack_allowed(words: jax.Array, v: int) -> jax.Array:
    """``[B, ceil(v / 32)]`` uint32 bits (`RowSampling.allowed`) -> ``[B, v]`` bool."""
    ids = jnp.arange(v)
    return (words[:, ids >> 5] >> (ids & 31).astype(jnp.uint32)) & 1 == 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decoded:
    """What a decode call returns besides the cache.

    Attributes:
      tokens: ``[B, MAX_STEPS]`` int32, the sampled tokens (columns past the steps run: -1).
      counts: ``[B, V]`` int32, each row's generated tokens counted (the penalties' state;
        the next call takes it back).
      logprobs: ``[B, MAX_STEPS]`` `TokenLogprobs` of the sampled tokens (`decode_logprobs`
        only; None from `decode`).
    """

    tokens: jax.Array
    counts: jax.Array
    logprobs: TokenLogprobs | None


def _forward(
    graphdef: nnx.GraphDef,
    params: Any,
    tokens: jax.Array,
    cache: KVCache,
    last_only: bool = True,
    fresh: bool = False,
):
    return nnx.merge(graphdef, params)(tokens, cache=cache, last_only=last_only, fresh=fresh)


def _sample(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """``logits [b, V]`` -> ``[b]`` tokens, row r drawn with ``fold_in(key_r, count_r)``."""
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(rows.keys), rows.count)
    logits = logits.astype(jnp.float32) + rows.bias  # x + 0.0 is x: unbiased rows unchanged
    logits = jnp.where(unpack_allowed(rows.allowed, logits.shape[-1]), logits, -jnp.inf)
    return sample_rows(logits, keys, rows.temperature, rows.top_k, rows.top_p)


def decode(
    graphdef: nnx.GraphDef,
    params: Any,
    cache: KVCache,
    token: jax.Array,
    rows: RowSampling,
    counts: jax.Array,
    steps: jax.Array,
    *,
    logprobs: bool = False,
) -> tuple[Decoded, KVCache]:
    """`steps` (1 .. `MAX_STEPS`) decode steps of every row: feeds ``token [B]``, samples the
    next. ``counts [B, V]`` are the rows' generated tokens before this call (a row whose
    ``rows.count`` is 1, just placed, starts from none). `logprobs`: also each sampled
    token's `TokenLogprobs` (the `decode_logprobs` program)."""
    b = token.shape[0]

    def run(params, cache, token, count, counts):
        def body(i, carry):
            cache, token, count, counts, out, lp = carry
            logits, cache = _forward(graphdef, params, token[:, None], cache)
            logits = logits[:, -1]
            counts = count_tokens(counts, token)  # `token` is the row's latest generated one
            penalized = penalize(logits, counts, rows.presence, rows.frequency)
            token = _sample(penalized, dataclasses.replace(rows, count=count))
            out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))
            if logprobs:
                new = token_logprobs(logits, token)
                lp = jax.tree.map(
                    lambda all_, one: jax.lax.dynamic_update_index_in_dim(all_, one, i, 1),
                    lp,
                    new,
                )
            return cache, token, count + 1, counts, out, lp

        out = jnp.full((b, MAX_STEPS), -1, jnp.int32)
        lp = None
        if logprobs:
            k = min(MAX_LOGPROBS, counts.shape[-1])
            lp = TokenLogprobs(
                jnp.zeros((b, MAX_STEPS), jnp.float32),
                jnp.zeros((b, MAX_STEPS, k), jnp.float32),
                jnp.zeros((b, MAX_STEPS, k), jnp.int32),
            )
        counts = restart_counts(counts, count == 1)
        return jax.lax.fori_loop(0, steps, body, (cache, token, count, counts, out, lp))

    cache, _, _, counts, out, lp = interpret(run)(params, cache, token, rows.count, counts)
    return Decoded(out, counts, lp), cache


decode_logprobs = functools.partial(decode, logprobs=True)


def decode_rows(
    graphdef: nnx.GraphDef,
    params: Any,
    cache: KVCache,
    token: jax.Array,
    rows: RowSampling,
    counts: jax.Array,
    steps: jax.Array,
    index: jax.Array,
    *,
    logprobs: bool = False,
) -> tuple[Decoded, KVCache]:
    """`decode` of the rows ``index [b]`` only (distinct row numbers, ``b <= B``): the same
    tokens for them, at about ``b / B`` of the dense work, reading and writing their cache
    rows in place (`KVCache.rows`). The other rows are not run: their tokens come back -1,
    their log-probabilities 0, and their cache slots and counts unchanged. Arguments and
    results are `decode`'s, every one of ``B`` rows (`logprobs`: the
    `decode_rows_logprobs` program)."""
    pick = functools.partial(take_rows, rows=index)
    decoded, cache = decode(
        graphdef,
        params,
        dataclasses.replace(cache, rows=index),
        pick(token),
        jax.tree.map(pick, rows),
        pick(counts),
        steps,
        logprobs=logprobs,
    )
    every = lambda rows: _scatter(
        jnp.zeros((cache.batch, *rows.shape[1:]), rows.dtype), index, rows
    )
    tokens = _scatter(jnp.full((cache.batch, MAX_STEPS), -1, jnp.int32), index, decoded.tokens)
    counts = _scatter(counts, index, decoded.counts)
    lp = None if decoded.logprobs is None else jax.tree.map(every, decoded.logprobs)
    return Decoded(tokens, counts, lp), dataclasses.replace(cache, rows=None)


decode_rows_logprobs = functools.partial(decode_rows, logprobs=True)


def verify(
    graphdef: nnx.GraphDef,
    params: Any,
    cache: KVCache,
    tokens: jax.Array,
    index: jax.Array,
) -> tuple[jax.Array, KVCache]:
    """Feeds row ``index[i]`` the tokens ``tokens[i] [K + 1]`` (its latest token, then K
    guesses) at the cache's clock, in one forward pass; returns the greedy next token after
    each of them ``[b, K + 1]`` int32 (the first maximum, as `sample_rows` picks for a greedy
    row) and the cache, its clock ``K + 1`` later (the caller moves it back to what it
    accepts: the slots past it are unseen and written over later). ``b == B`` takes every row
    in order (``index`` is ``0 .. B - 1``) without a copy. The clock plus ``K + 1`` must fit
    the cache: a write past its end would be clipped onto earlier slots."""
    whole = index.shape[0] == cache.batch
    # Other rows' slots are not touched: the rows run in place (`KVCache.rows`), as in
    # `decode_rows`. (Gathered into a cache of b rows and back, a SmolLM2 check on one row of
    # 8 at 1,024 slots took 0.18 s, nearly all copies.) A scheduler's cache length is a
    # multiple of 32 slots, which in-place rows need.
    small = cache if whole else dataclasses.replace(cache, rows=index)
    forward = functools.partial(_forward, graphdef, last_only=False)
    logits, out = interpret(forward)(params, tokens, small)
    return greedy_tokens(logits.astype(jnp.float32)), dataclasses.replace(out, rows=None)


def prefill(
    graphdef: nnx.GraphDef,
    params: Any,
    tokens: jax.Array,
    cache: KVCache,
    rows: RowSampling,
) -> tuple[tuple[jax.Array, jax.Array], KVCache]:
    """Left-padded prompts ``tokens [b, W]`` (one, or a batch of one width:
    `lowbit.server._batch_prefill`) into an empty cache of ``b`` rows (its ``start`` set to
    the padding); returns each row's first sampled token ``[b]`` with the logits it was drawn
    from ``[b, V]`` (for its log-probabilities), and the cache."""
    forward = functools.partial(_forward, graphdef, fresh=True)
    logits, cache = interpret(forward)(params, tokens, cache)
    return (_sample(logits[:, -1], rows), logits[:, -1]), cache


def prefill_chunk(
    graphdef: nnx.GraphDef,
    params: Any,
    tokens: jax.Array,
    cache: KVCache,
) -> tuple[jax.Array, KVCache]:
    """Writes ``tokens [1, C]`` at the cache's ``length``; returns the last one's logits
    ``[1, V]`` and the cache."""
    logits, cache = interpret(functools.partial(_forward, graphdef))(params, tokens, cache)
    return logits[:, -1], cache


def sample(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """`_sample` as its own program (the first token of a chunked prefill)."""
    return _sample(logits, rows)


def logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """`token_logprobs` as its own program (a first token's, for a request that asks)."""
    return token_logprobs(logits, tokens)


def _slot_arrays(cache: KVCache) -> tuple[tuple[jax.Array, ...], ...]:
    return cache.keys, cache.values, cache.key_scales, cache.value_scales


def _with_slot_arrays(cache: KVCache, arrays: Any, **changes: Any) -> KVCache:
    keys, values, key_scales, value_scales = arrays
    return dataclasses.replace(
        cache,
        keys=keys,
        values=values,
        key_scales=key_scales,
        value_scales=value_scales,
        **changes,
    )


def _scatter(a: jax.Array, index: jax.Array, rows: jax.Array) -> jax.Array:
    """`a` with ``rows[i]`` written at row ``index[i]`` (distinct); a row at a time, as
    `lowbit.models.take_rows`."""
    for i in range(index.shape[0]):
        corner = (index[i], *(0 for _ in range(1, a.ndim)))
        a = jax.lax.dynamic_update_slice(a, rows[i : i + 1], corner)
    return a


def insert(
    big: KVCache,
    small: KVCache,
    row: jax.Array,
    source_row: jax.Array,
    source: jax.Array,
    length: jax.Array,
    start: jax.Array,
) -> KVCache:
    """Copies `small`'s row `source_row` slots ``source .. source + length - 1`` into `big`'s
    row `row`, ending just before `big`'s clock; `start` ``[B]`` is the new rows' starts.
    (`small` is a prefill's cache: one prompt's, or a batch's, `lowbit.server._batch_prefill`.)"""
    t = big.max_len
    end = big.length
    first = end - length
    slot = jnp.arange(t, dtype=jnp.int32)
    inside = (slot >= first) & (slot < end)

    def move(dst, src):
        src = jax.lax.dynamic_index_in_dim(src, source_row, 0, keepdims=False)
        if src.shape[1] < t:
            src = jnp.pad(src, ((0, 0), (0, t - src.shape[1]), (0, 0)))
        src = jnp.roll(src, first - source, axis=1)
        merged = jnp.where(inside[None, :, None], src, dst[row])
        return jax.lax.dynamic_update_index_in_dim(dst, merged, row, 0)

    arrays = jax.tree.map(move, _slot_arrays(big), _slot_arrays(small))
    offsets = tuple(
        jax.lax.dynamic_update_index_in_dim(
            dst, jax.lax.dynamic_index_in_dim(src, source_row, 0, keepdims=False), row, 0
        )
        for dst, src in zip(big.key_offsets, small.key_offsets, strict=True)
    )
    return _with_slot_arrays(big, arrays, key_offsets=offsets, start=start)


def shift(cache: KVCache, by: jax.Array, start: jax.Array) -> KVCache:
    """Slides every row's slots left by `by` (right for a negative one); `start` ``[B]`` is
    the new starts. What rolls in at the far end is unused."""
    arrays = jax.tree.map(lambda a: jnp.roll(a, -by, axis=2), _slot_arrays(cache))
    return _with_slot_arrays(cache, arrays, length=cache.length - by, start=start)


def save(
    pool: KVCache, cache: KVCache, slot: jax.Array, block: jax.Array, row: jax.Array
) -> KVCache:
    """Copies `cache`'s row `row` slots ``slot .. slot + P - 1`` (and its key offsets) into
    pool block `block`; the pool is a cache of one row of ``P`` slots per block."""
    p = pool.max_len
    pick = lambda a: jax.lax.dynamic_index_in_dim(a, row, 0, keepdims=False)  # noqa: E731

    def put(dst, src):
        src = jax.lax.dynamic_slice_in_dim(src, slot, p, axis=2)
        return jax.lax.dynamic_update_index_in_dim(dst, pick(src), block, 0)

    arrays = jax.tree.map(put, _slot_arrays(pool), _slot_arrays(cache))
    offsets = tuple(
        jax.lax.dynamic_update_index_in_dim(dst, pick(src), block, 0)
        for dst, src in zip(pool.key_offsets, cache.key_offsets, strict=True)
    )
    return _with_slot_arrays(pool, arrays, key_offsets=offsets)


def load(cache: KVCache, pool: KVCache, block: jax.Array, slot: jax.Array) -> KVCache:
    """Copies pool block `block` into `cache`'s row 0 at slots ``slot .. slot + P - 1``, and
    its key offsets (every block of one chain holds the same) into row 0's."""

    def put(dst, src):
        src = jax.lax.dynamic_index_in_dim(src, block, 0)  # [1, H, P, D]
        return jax.lax.dynamic_update_slice_in_dim(dst, src, slot, axis=2)

    arrays = jax.tree.map(put, _slot_arrays(cache), _slot_arrays(pool))
    offsets = tuple(
        jax.lax.dynamic_update_index_in_dim(dst, src[block], 0, 0)
        for dst, src in zip(cache.key_offsets, pool.key_offsets, strict=True)
    )
    return _with_slot_arrays(cache, arrays, key_offsets=offsets)


def row_buckets(slots: int) -> list[int]:
    """The row counts below `slots` that `decode_rows` runs: 1, 2, 4, ..."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out


def row_index(busy: list[int], slots: int) -> np.ndarray:
    """``[b]`` int32: the `busy` rows, then free ones up to the smallest bucket of
    `row_buckets` holding them all (distinct rows: no two write back the same slots), or
    every row ``0 .. slots - 1`` when none does."""
    b = next((b for b in row_buckets(slots) if b >= len(busy)), slots)
    if b == slots:
        return np.arange(slots, dtype=np.int32)
    free = [r for r in range(slots) if r not in busy]
    return np.asarray(sorted(busy) + free[: b - len(busy)], np.int32)
