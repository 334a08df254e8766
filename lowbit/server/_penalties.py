"""OpenAI's presence and frequency penalties, applied inside the decode program.

Each row counts the tokens its answer has generated so far (the prompt does not count, as in
vLLM), and its logits become ``logit - frequency * count - presence * (count > 0)`` before
temperature, top-k and top-p. The counts live in the decode program's carry, so a call of
several steps penalizes the tokens it sampled itself.

Shapes: ``B`` rows, ``V`` vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def restart_counts(counts: jax.Array, fresh: jax.Array) -> jax.Array:
    """``counts [B, V]`` int32 with the rows where ``fresh [B]`` bool is set zeroed (a new
    answer in that row)."""
    return jnp.where(fresh[:, None], 0, counts)


def count_tokens(counts: jax.Array, token: jax.Array) -> jax.Array:
    """``counts [B, V]`` int32 with one more of each row's ``token [B]``."""
    return counts.at[jnp.arange(token.shape[0]), token].add(1)


def penalize(
    logits: jax.Array, counts: jax.Array, presence: jax.Array, frequency: jax.Array
) -> jax.Array:
    """``logits [B, V]`` -> float32 ``[B, V]``: ``logit - frequency * count - presence *
    (count > 0)`` per row (``presence``, ``frequency`` ``[B]`` float32).

    Rows without penalties keep their logits bit for bit, and the arithmetic runs only when
    some row has one."""
    logits = logits.astype(jnp.float32)
    penalized = (presence != 0.0) | (frequency != 0.0)

    def apply(logits):
        seen = counts > 0
        changed = (
            logits
            - frequency[:, None] * counts.astype(jnp.float32)
            - jnp.where(seen, presence[:, None], 0.0)
        )
        return jnp.where(penalized[:, None], changed, logits)

    return jax.lax.cond(jnp.any(penalized), apply, lambda logits: logits, logits)
