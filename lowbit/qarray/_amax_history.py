"""Delayed scaling: a rolling history of per-block amax values (fp8 training recipes).

The scale used at step t comes from the max over the last `length` steps' amax values, so it
is known before the step's tensor is seen. Pure functions on an explicit state, optax-style.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowbit.qarray._granularity import Granularity, PerTensor
from lowbit.qarray._quantize import blocks_view


class AmaxHistory(NamedTuple):
    """history: [length, *scale_shape] float32, newest first."""

    history: jax.Array


def amax_history_init(length: int, scale_shape: tuple[int, ...] = ()) -> AmaxHistory:
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"amax history length must be a positive int, got {length!r}")
    return AmaxHistory(jnp.zeros((length, *scale_shape), jnp.float32))


def amax_history_update(
    state: AmaxHistory, x: jax.Array, granularity: Granularity | None = None
) -> AmaxHistory:
    """Pushes the amax of `x` (per block of `granularity`, non-finite values ignored)."""
    x = jnp.asarray(x, jnp.float32)
    granularity = PerTensor() if granularity is None else granularity
    tile = granularity.tile(x.shape)
    blocks = blocks_view(x, tile)
    amax = jnp.max(jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), 0.0), axis=-1)
    amax = amax.reshape(state.history.shape[1:]) if state.history.ndim > 1 else jnp.max(amax)
    return AmaxHistory(jnp.concatenate([amax[None], state.history[:-1]], axis=0))


def amax_history_bounds(state: AmaxHistory) -> tuple[jax.Array, jax.Array]:
    """(lo, hi) to pass as `quantize(..., bounds=...)`: ± the max over the history."""
    amax = jnp.max(state.history, axis=0)
    return -amax, amax
