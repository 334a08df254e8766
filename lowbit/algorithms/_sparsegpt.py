"""SparseGPT (Frantar & Alistarh, 2023) for N:M patterns: prune with the inverse Hessian.

Magnitude pruning drops the smallest weights and leaves the rest as they were. SparseGPT walks
the input columns of ``W: [F, K]`` like GPTQ does (`lowbit.algorithms._gptq`): at the start of
every group of ``m`` columns it keeps, per output row, the ``n`` entries with the largest
``w² / U[j, j]²`` (the output error their removal costs, ``U`` the upper Cholesky factor of
``H⁻¹``), sets the others to zero, and pushes each column's change onto the columns not yet
visited, so the kept weights absorb what the pruned ones did on the calibration inputs.
With ``XᵀX = I`` nothing propagates and the masks are magnitude masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.algorithms._capture import capture
from lowbit.algorithms._gptq import (
    as_matrix,
    column_block,
    from_matrix,
    inverse_hessian_factor,
    pad_columns,
)
from lowbit.api import SparseRule, nm_masks
from lowbit.recipes import map_params, param_leaves


@functools.partial(jax.jit, static_argnames=("n", "m", "block"))
def _prune_columns(w, upper, *, n, m, block):
    """w: [F, K], upper: [K, K] (K a multiple of block, block of m) → (pruned w, keep) [F, K]."""
    f, k = w.shape
    cols = jnp.arange(k)

    def block_step(b, state):
        w, kept = state
        i1 = b * block
        (w1,) = column_block(i1, block, w)
        u1 = jax.lax.dynamic_slice(upper, (i1, i1), (block, block))
        d1 = jnp.diag(u1)

        def column(i, inner):
            w1, e1, k1, keep = inner

            def choose(_):
                group = jax.lax.dynamic_slice(w1, (0, i), (f, m))
                d = jax.lax.dynamic_slice(d1, (i,), (m,))
                cost = group**2 / d[None, :] ** 2
                rank = jnp.argsort(jnp.argsort(-cost, axis=1, stable=True), axis=1, stable=True)
                return rank < n

            keep = jax.lax.cond(i % m == 0, choose, lambda _: keep, None)
            col = w1[:, i]
            q = jnp.where(keep[:, i % m], col, 0.0)
            err = (col - q) / u1[i, i]
            # Row i of U touches columns >= i only; column i is set to q exactly (pruned
            # entries must be zero, not a rounding residue).
            w1 = (w1 - err[:, None] * u1[i][None, :]).at[:, i].set(q)
            return w1, e1.at[:, i].set(err), k1.at[:, i].set(keep[:, i % m]), keep

        zeros = jnp.zeros((f, block), w.dtype)
        init = (w1, zeros, zeros.astype(bool), jnp.ones((f, m), bool))
        w1, e1, k1, _ = jax.lax.fori_loop(0, block, column, init)
        rows = jax.lax.dynamic_slice(upper, (i1, 0), (block, k))
        later = jnp.where(cols[None, :] >= i1 + block, rows, 0.0)
        w = w - jnp.dot(e1, later, precision=jax.lax.Precision.HIGHEST)
        w = jax.lax.dynamic_update_slice(w, w1, (0, i1))
        return w, jax.lax.dynamic_update_slice(kept, k1, (0, i1))

    return jax.lax.fori_loop(0, k // block, block_step, (w, jnp.zeros((f, k), bool)))


def sparsegpt_matrix(
    w: jax.Array, gram: jax.Array, n: int, m: int, *, damp: float = 0.01, block: int = 128
) -> tuple[jax.Array, jax.Array] | None:
    """N:M-pruned ``w`` (zeros at pruned entries, kept entries updated) and its keep mask.

    Args:
      w: [F, K] float weight (rows = outputs, groups of `m` run along the K inputs).
      gram: [K, K] input Gram matrix XᵀX.
      n, m: keep `n` of every `m` consecutive inputs; `m` must divide K.
      damp: dampening, a fraction of the mean diagonal (raised when it does not factorize).
      block: columns per lazy update (rounded down to a multiple of `m`).
    Returns:
      ([F, K] float32 weight, [F, K] bool keep mask), or None when the Hessian stayed
      singular after dampening.
    """
    f, k = w.shape
    if k % m:
        raise ValueError(f"m={m} does not divide the {k} inputs; accepted: a divisor of {k}")
    upper, _ = inverse_hessian_factor(gram, damp)
    if upper is None:
        return None
    block = max(m, min(block, k) // m * m)
    pad = -k % block
    w = jnp.asarray(w, jnp.float32)
    if pad:
        w, upper = pad_columns(w, upper, pad)
    pruned, keep = _prune_columns(w, upper, n=n, m=m, block=block)
    return pruned[:, :k], keep[:, :k]


def sparsegpt_params(
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
    rule: SparseRule,
    *,
    damp: float = 0.01,
    passes: int = 1,
    row_mask: Callable[..., Any] | None = None,
) -> tuple[Any, dict[str, jax.Array], list[str]]:
    """`lowbit.algorithms.sparsegpt_params`: prune every weight `rule` selects with SparseGPT.

    Statistics come from captures of the model on `batches` (``fn(params, *batch)``). With
    ``passes > 1`` the weights are pruned in that many groups, in the order the model reads them,
    and each group is calibrated on the model with the earlier groups already pruned (the
    sequential mode of the paper: later layers learn to absorb the earlier layers' error).
    Compress the result with `nm_sparsify_params(pruned, rule, masks)`, or train on with the
    masks (`apply_masks`).

    Args:
      fn: the model, ``fn(params, *batch)``.
      params: float params.
      batches: calibration batches (one shape, so the capture compiles once).
      rule: the `SparseRule` (pattern and axis; `rule.values` applies at compression).
      damp: dampening of the Hessian, a fraction of its mean diagonal.
      passes: number of sequential groups (1: one capture of the float model).
      row_mask: ``row_mask(*batch)``, the positions that count (e.g. a padded encoder batch's
        attention mask), as for `lowbit.algorithms.capture`.
    Returns:
      (pruned float params, {path: bool keep mask}, notes: weights that fell back to magnitude
      pruning — no statistics, inputs not along the rule's axis, or a singular Hessian).
    Raises:
      ValueError: as `nm_masks` (the rule selects nothing, `m` does not divide an axis), or
        `passes` < 1.
    """
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"sparsegpt_params: passes={passes!r}; accepted: an int >= 1")
    masks = nm_masks(params, rule)
    batches = list(batches)
    statistics = capture(fn, params, batches, paths=list(masks), row_mask=row_mask)
    seen = statistics.read_order()
    order = [p for p in seen if p in masks] + [p for p in masks if p not in seen]
    size = -(-len(order) // passes)
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    current, notes = params, []
    for i, group in enumerate(groups):
        if i:
            statistics = capture(fn, current, batches, paths=group, row_mask=row_mask)
        leaves = dict(param_leaves(current))
        pruned = {}
        for path in group:
            w = jnp.asarray(leaves[path], jnp.float32)
            new = _prune_one(path, w, statistics.for_path(path), rule, damp, notes)
            if new is None:
                pruned[path] = jnp.where(masks[path], leaves[path], 0)
            else:
                pruned[path] = new[0].astype(leaves[path].dtype)
                masks[path] = new[1]
        current = map_params(lambda p, leaf, pruned=pruned: pruned.get(p, leaf), current)
    return current, masks, notes


def _prune_one(path, w, stats, rule, damp, notes) -> tuple[jax.Array, jax.Array] | None:
    axis = rule.axis % w.ndim
    if len(stats) != 1 or stats[0].fixed or stats[0].input_axes != (axis,):
        notes.append(f"{path}: no single use contracting axis {axis}; magnitude masks kept")
        return None
    wm, perm, moved = as_matrix(w, (axis,))
    result = sparsegpt_matrix(wm, stats[0].gram, rule.n, rule.m, damp=damp)
    if result is None:
        notes.append(f"{path}: Hessian singular after dampening; magnitude masks kept")
        return None
    return from_matrix(result[0], perm, moved), from_matrix(result[1], perm, moved)
