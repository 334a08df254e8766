"""SparseGPT (Frantar & Alistarh, 2023) for N:M patterns: prune with the inverse Hessian.

Magnitude pruning drops the smallest weights and leaves the rest as they were. SparseGPT walks
the input columns of ``W: [F, K]`` like GPTQ does (`lowbit.algorithms._gptq`): at the start of
every group of ``m`` columns it keeps, per output row, the ``n`` entries with the largest
``w² / U[j, j]²`` (the output error their removal costs, ``U`` the upper Cholesky factor of
``H⁻¹``), sets the others to zero, and pushes each column's change onto the columns not yet
visited, so the kept weights absorb what the pruned ones did on the calibration inputs.
With ``XᵀX = I`` nothing propagates and the masks are magnitude masks.

Routed experts (``[E, in, out]`` with per-expert statistics from `capture`) are pruned one
expert at a time on that expert's own Gram matrix; an expert that received no calibration rows
keeps its magnitude mask (noted).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lowbit.algorithms._capture import expert_use
from lowbit.algorithms._gptq import (
    as_matrix,
    column_block,
    from_matrix,
    inverse_hessian_factor,
    pad_columns,
)


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


def prune_one(
    path, w, stats, rule, damp, notes, magnitude=None
) -> tuple[jax.Array, jax.Array] | None:
    """(pruned w, keep mask) of one weight `w` [*shape] float32 by `rule` (an N:M
    `SparseRule`: ``n``, ``m``, ``axis``) on its statistics; None (noted) where it has no
    single use contracting the rule's axis or its Hessian stays singular. Routed experts
    (`expert_use` statistics, the rule's axis their input axis 1) are pruned per expert;
    an expert without rows, or whose Hessian stays singular, takes its slice of `magnitude`
    (the magnitude keep mask like `w`; None: the whole weight falls back)."""
    axis = rule.axis % w.ndim
    if expert_use(stats) and axis == 1 and magnitude is not None:
        return _prune_experts(path, w, stats, rule, damp, notes, magnitude)
    if len(stats) != 1 or stats[0].fixed or stats[0].input_axes != (axis,):
        notes.append(f"{path}: no single use contracting axis {axis}; magnitude masks kept")
        return None
    wm, perm, moved = as_matrix(w, (axis,))
    result = sparsegpt_matrix(wm, stats[0].gram, rule.n, rule.m, damp=damp)
    if result is None:
        notes.append(f"{path}: Hessian singular after dampening; magnitude masks kept")
        return None
    return from_matrix(result[0], perm, moved), from_matrix(result[1], perm, moved)


def _prune_experts(path, w, stats, rule, damp, notes, magnitude) -> tuple[jax.Array, jax.Array]:
    """`prune_one` per expert of `w` [E, K, N] on each expert's Gram matrix."""
    pruned, keep = [], []
    for s in sorted(stats, key=lambda s: s.fixed):
        e = s.fixed[0][1]
        result = None
        if s.count:
            wm, perm, moved = as_matrix(w[e], (0,))
            result = sparsegpt_matrix(wm, s.gram, rule.n, rule.m, damp=damp)
        if result is None:
            why = "received no calibration rows" if not s.count else "Hessian singular"
            notes.append(f"{path}[expert {e}]: {why}; magnitude mask kept")
            pruned.append(jnp.where(magnitude[e], w[e], 0.0))
            keep.append(jnp.asarray(magnitude[e], bool))
        else:
            pruned.append(from_matrix(result[0], perm, moved))
            keep.append(from_matrix(result[1], perm, moved))
    return jnp.stack(pruned), jnp.stack(keep)
