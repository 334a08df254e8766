"""Sampling the next token from logits: greedy, temperature, top-k and top-p, one setting for a
batch (`Sampling`, `sample_logits`) or one per row (`sample_rows`, the server's)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits.

    Attributes:
      temperature: 0 for greedy (argmax); otherwise logits are divided by it and sampled.
      top_k: sample only among the k most likely tokens (None: all).
      top_p: nucleus sampling: the smallest set of most likely tokens whose probability
        reaches top_p (1.0: all). In (0, 1].
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r} must be a positive int or None")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as int32 ``[batch]``: the first maximum, or the first
    NaN where a row has one.

    Two plain reductions (the maximum, then the first index holding it) instead of argmax's
    paired value-and-index reduction, which XLA:CPU runs element by element: over a 49152-token
    vocabulary 26 against 218 us a row, about 3% of a SmolLM2-sized decode step.
    """
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN if the row has one
    hit = (logits == top) | jnp.isnan(logits)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1).astype(jnp.int32)


def sample_logits(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits ``[batch, vocab]`` -> token ids ``[batch]`` int32 (see `Sampling`).

    A batch of one draws exactly what `sample_rows` draws for that row with the same key and
    settings (so a server slot and `generate_tokens` give the same tokens).
    """
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return greedy_tokens(logits)
    logits = logits / sampling.temperature
    vocab = logits.shape[-1]
    k = vocab if sampling.top_k is None else min(sampling.top_k, vocab)
    if k == vocab and sampling.top_p >= 1.0:
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
    values, ids = jax.lax.top_k(logits, k)  # sorted, most likely first
    # Padded to the whole vocabulary with -inf: the same arrays `sample_rows` masks, so that
    # both draw the same noise (random bits depend on the element's index, not the shape).
    pad = ((0, 0), (0, vocab - k))
    values = jnp.pad(values, pad, constant_values=-jnp.inf)
    ids = jnp.pad(ids, pad)
    if sampling.top_p < 1.0:
        values = _nucleus(values, jnp.full(values.shape[:1], sampling.top_p, jnp.float32))
    choice = jax.random.categorical(key, values, axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _nucleus(values: jax.Array, top_p: jax.Array) -> jax.Array:
    """Sorted ``values [batch, vocab]`` with the tokens outside each row's nucleus set to -inf
    (rows with ``top_p [batch] >= 1`` unchanged)."""
    probs = jax.nn.softmax(values, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    # Keep a token while the mass before it is below top_p (the first is always kept).
    drop = (top_p[:, None] < 1.0) & ~(before < top_p[:, None])
    return jnp.where(drop, -jnp.inf, values)


def sample_rows(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """`sample_logits` with settings and a key per row, all traced (one compiled program for
    any mix of greedy and sampled rows).

    Args:
      logits: ``[batch, vocab]``.
      keys: ``[batch]`` PRNG keys; row r draws what ``sample_logits(logits[r:r+1], keys[r],
        Sampling(temperature[r], top_k[r] or None, top_p[r]))`` draws.
      temperature: ``[batch]`` float32, 0 for greedy.
      top_k: ``[batch]`` int32, 0 for all tokens.
      top_p: ``[batch]`` float32 in (0, 1].
    Returns:
      ``[batch]`` int32 token ids.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = greedy_tokens(logits)
    sampled = temperature > 0.0
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    ranked = sampled & ((k < vocab) | (top_p < 1.0))

    def draw(key, row):
        return jax.random.categorical(key, row[None], axis=-1)[0]

    plain = jax.vmap(draw)(keys, scaled).astype(jnp.int32)

    def restricted(_):
        values, ids = jax.lax.top_k(scaled, vocab)  # a full sort: only when a row needs one
        values = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], values, -jnp.inf)
        values = _nucleus(values, jnp.where(ranked, top_p, 1.0))
        choice = jax.vmap(draw)(keys, values)
        return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(ranked), restricted, lambda _: plain, None)
    return jnp.where(sampled, jnp.where(ranked, drawn, plain), greedy)
