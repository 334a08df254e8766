"""The calibration walk: one batch through the engine's probe, with the rows that count.

`lowbit.calibrate` (activation ranges) and `capture` (GPTQ / AWQ statistics) both run the
float model on calibration batches and read, at every op that reads a weight, the activation
meeting it. Both go through `walk_batch`, so both take the same ``row_mask``: the positions of
a batch that count (a padded encoder batch's attention mask), applied to every activation whose
non-contracted axes have the mask's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.engine import Use, probe
from lowbit.recipes import path_string

# visit(use, mask): `mask` is ``row_mask(*args)`` as an array, or None without a row mask.
Visitor = Callable[[Use, jax.Array | None], None]


def batch_args(batch: Any) -> tuple:
    """A calibration batch as ``fn``'s arguments after params: a tuple is unpacked, anything
    else is one argument."""
    return batch if isinstance(batch, tuple) else (batch,)


def walk_batch(
    fn: Callable[..., Any],
    params: Any,
    args: tuple,
    visit: Visitor,
    *,
    row_mask: Callable[..., Any] | None = None,
) -> None:
    """Runs ``fn(params, *args)`` concretely through the probe, calling ``visit(use, mask)``
    for every op reading a parameter (`lowbit.engine.Use`, paths named as in recipes).

    Args:
      fn: the float model, ``fn(params, *args)``.
      params: float params pytree.
      args: one batch's arguments (`batch_args`).
      visit: called per use with the batch's mask (None without `row_mask`).
      row_mask: ``row_mask(*args) -> [*row_shape]``, nonzero where a position counts.
    """
    mask = None if row_mask is None else jnp.asarray(row_mask(*args))
    probe(fn, params, args, {}, lambda use: visit(use, mask), name=path_string)


def activation_rows(use: Use) -> tuple[jax.Array, tuple[int, ...]]:
    """The activation of a `dot_general` use as [rows, K] float32 (its contracted axes last,
    flattened), and the shape its rows were flattened from (its non-contracted axes)."""
    (lc, rc), _ = use.params["dimension_numbers"]
    a_contract = lc if use.weight_operand == 1 else rc
    x = jnp.asarray(use.activation, jnp.float32)
    rest = [a for a in range(x.ndim) if a not in a_contract]
    k = int(np.prod([x.shape[a] for a in a_contract]))
    row_shape = tuple(x.shape[a] for a in rest)
    return jnp.transpose(x, [*rest, *a_contract]).reshape(-1, k), row_shape


def kept_rows(mask: jax.Array | None, row_shape: tuple[int, ...]) -> jax.Array | None:
    """[rows] bool: which rows of an activation count, or None where all do (no mask, or an
    activation whose rows do not have the mask's shape)."""
    if mask is None or tuple(mask.shape) != tuple(row_shape):
        return None
    return mask.reshape(-1) != 0
