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

A prompt is prefilled alone, as `lowbit.generate` prefills a batch of one (left-padded to a
bucketed width ``W``, in a cache of the widest one-pass width's slots, whose slots past ``W``
stay empty and unseen), then copied into its row (`insert`, one program for every ``W``). So a slot
computes what ``generate_tokens([prompt], key=seed)`` computes, bit for bit. A prompt too long
for one pass is prefilled in chunks (`prefill_chunk`) into a ``T``-slot cache, between decode
steps of the others (the same tokens up to float rounding: the chunks' products differ in
shape, and a quantized cache takes its key offset from the first chunk).

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
from flax import nnx

from lowbit.engine import interpret
from lowbit.models import KVCache
from lowbit.models._generate import sample_rows

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
      bias: ``[B, V]`` float32, added to the logits before sampling: a request's
        ``logit_bias`` and its grammar's mask (0 for an allowed token, -inf for another);
        zeros for a row with neither, which then samples exactly what it would without.
    """

    keys: jax.Array
    count: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    bias: jax.Array


def _forward(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array, cache: KVCache):
    return nnx.merge(graphdef, params)(tokens, cache=cache, last_only=True)


def _sample(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """``logits [b, V]`` -> ``[b]`` tokens, row r drawn with ``fold_in(key_r, count_r)``."""
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(rows.keys), rows.count)
    logits = logits.astype(jnp.float32) + rows.bias  # x + 0.0 is x: unbiased rows unchanged
    return sample_rows(logits, keys, rows.temperature, rows.top_k, rows.top_p)


def decode(
    graphdef: nnx.GraphDef,
    params: Any,
    cache: KVCache,
    token: jax.Array,
    rows: RowSampling,
    steps: jax.Array,
) -> tuple[jax.Array, KVCache]:
    """`steps` (1 .. `MAX_STEPS`) decode steps of every row: feeds ``token [B]``, samples the
    next. Returns the sampled tokens ``[B, MAX_STEPS]`` (columns past `steps` are -1) and the
    cache."""
    b = token.shape[0]

    def run(params, cache, token, count):
        def body(i, carry):
            cache, token, count, out = carry
            logits, cache = _forward(graphdef, params, token[:, None], cache)
            token = _sample(logits[:, -1], dataclasses.replace(rows, count=count))
            out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))
            return cache, token, count + 1, out

        out = jnp.full((b, MAX_STEPS), -1, jnp.int32)
        return jax.lax.fori_loop(0, steps, body, (cache, token, count, out))

    cache, _, _, out = interpret(run)(params, cache, token, rows.count)
    return out, cache


def prefill(
    graphdef: nnx.GraphDef,
    params: Any,
    tokens: jax.Array,
    cache: KVCache,
    rows: RowSampling,
) -> tuple[jax.Array, KVCache]:
    """One left-padded prompt ``tokens [1, W]`` into an empty ``W``-slot `cache` (its ``start``
    set to the padding); returns the first sampled token ``[1]`` and the cache."""
    logits, cache = interpret(functools.partial(_forward, graphdef))(params, tokens, cache)
    return _sample(logits[:, -1], rows), cache


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


def insert(
    big: KVCache,
    small: KVCache,
    row: jax.Array,
    source: jax.Array,
    length: jax.Array,
    start: jax.Array,
) -> KVCache:
    """Copies `small`'s row 0 slots ``source .. source + length - 1`` into `big`'s row `row`,
    ending just before `big`'s clock; `start` ``[B]`` is the new rows' starts."""
    t = big.max_len
    end = big.length
    first = end - length
    slot = jnp.arange(t, dtype=jnp.int32)
    inside = (slot >= first) & (slot < end)

    def move(dst, src):
        src = src[0]
        if src.shape[1] < t:
            src = jnp.pad(src, ((0, 0), (0, t - src.shape[1]), (0, 0)))
        src = jnp.roll(src, first - source, axis=1)
        merged = jnp.where(inside[None, :, None], src, dst[row])
        return jax.lax.dynamic_update_index_in_dim(dst, merged, row, 0)

    arrays = jax.tree.map(move, _slot_arrays(big), _slot_arrays(small))
    offsets = tuple(
        jax.lax.dynamic_update_index_in_dim(dst, src[0], row, 0)
        for dst, src in zip(big.key_offsets, small.key_offsets, strict=True)
    )
    return _with_slot_arrays(big, arrays, key_offsets=offsets, start=start)


def shift(cache: KVCache, by: jax.Array, start: jax.Array) -> KVCache:
    """Slides every row's slots left by `by` (right for a negative one); `start` ``[B]`` is
    the new starts. What rolls in at the far end is unused."""
    arrays = jax.tree.map(lambda a: jnp.roll(a, -by, axis=2), _slot_arrays(cache))
    return _with_slot_arrays(cache, arrays, length=cache.length - by, start=start)
