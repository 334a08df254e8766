"""GPTQ (Frantar et al., 2022): round columns one at a time, pushing each rounding error onto the
columns not yet rounded through the inverse Hessian of the layer's squared output error.

For a weight ``W: [F, K]`` (F outputs, K inputs) and inputs ``X: [n, K]``, the output error
``‖X Wᵀ - X Qᵀ‖²`` has Hessian ``H = 2 XᵀX`` per row. With ``U`` the upper Cholesky factor of
``H⁻¹``, column ``j`` is rounded to ``q_j`` and the rest updated by
``W[:, j+1:] -= (w_j - q_j) / U[j, j] · U[j, j+1:]``; updates are applied lazily per block of
columns (two matrix products per block). Scales are the RTN scales of the recipe's config
(static groups), so the stored layout is the RTN one and any format with a grid works: intN /
uintN with zero points, codebooks (NF4, FP4), MX and NVFP4 blocks. With ``XᵀX = I`` nothing
propagates and the result is RTN's codes exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.algorithms import _grid
from lowbit.formats import get_format
from lowbit.qarray import QArray
from lowbit.recipes import GPTQ


@dataclasses.dataclass(frozen=True)
class GPTQResult:
    """Codes [F, K] chosen by GPTQ, and the dampening that made H positive definite."""

    codes: jax.Array
    damp: float | None  # None: the Hessian stayed singular (RTN codes returned)


def _live(gram: jax.Array) -> np.ndarray:
    """``gram`` in float64 with 1 on the diagonal of dead inputs (never nonzero)."""
    h = np.array(gram, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    return h


def _damped(h: np.ndarray, frac: float) -> np.ndarray:
    """``h + frac · mean(diag h) · I``: the Hessian GPTQ factorizes and refines against."""
    return h + frac * float(np.mean(np.diag(h))) * np.eye(len(h))


def pad_columns(w: jax.Array, upper: jax.Array, pad: int) -> tuple[jax.Array, jax.Array]:
    """w [F, K] and U [K, K] padded by `pad` inputs that nothing reads (U gets 1 there)."""
    k = upper.shape[0]
    w = jnp.pad(w, ((0, 0), (0, pad)))
    ones = jnp.concatenate([jnp.zeros(k), jnp.ones(pad)])
    return w, jnp.pad(upper, ((0, pad), (0, pad))) + jnp.diag(ones)


def inverse_hessian_factor(gram: jax.Array, damp: float) -> tuple[jax.Array | None, float]:
    """Upper Cholesky factor of ``(H + λI)⁻¹`` for ``H = gram`` (dead inputs get 1 on the
    diagonal), with ``λ = damp · mean diag`` raised x10 up to 3 times until it factorizes.

    Returns:
      (U [K, K] or None when it never factorized, the fraction used).
    """
    h = _live(gram)
    mean = float(np.mean(np.diag(h))) if np.all(np.isfinite(h)) else np.nan
    if not np.isfinite(mean) or mean <= 0:
        return None, damp
    for attempt in range(4):
        frac = damp * 10**attempt
        try:
            lower = np.linalg.cholesky(_damped(h, frac))
            inv = np.linalg.inv(lower)
            hinv = inv.T @ inv
            upper = np.linalg.cholesky(hinv).T
        except np.linalg.LinAlgError:
            continue
        if np.all(np.isfinite(upper)):
            return jnp.asarray(upper, jnp.float32), frac
    return None, damp


SHARED_FACTORS = 4


def _shared_factor(gram: np.ndarray, damp: float, factors: dict | None):
    """`inverse_hessian_factor`, looked up in `factors` by the Gram matrix's bytes first."""
    if factors is None:
        return inverse_hessian_factor(gram, damp)
    gram = np.ascontiguousarray(gram)
    key = (gram.shape, gram.dtype.str, damp, hashlib.blake2b(gram.tobytes()).digest())
    if key not in factors:
        # A few recent ones: the weights reading one input are rounded close together (a
        # layer's q/k/v around o), and each factor is K x K float32.
        while len(factors) >= SHARED_FACTORS:
            factors.pop(next(iter(factors)))
        factors[key] = inverse_hessian_factor(gram, damp)
    return factors[key]


def column_block(i1, block: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Columns ``i1 .. i1 + block`` of each [F, K] array (a lazy-update block)."""
    return tuple(jax.lax.dynamic_slice(a, (0, i1), (a.shape[0], block)) for a in arrays)


@functools.partial(jax.jit, static_argnames=("fmt_name", "symmetric", "full_range", "block"))
def _gptq_columns(w, upper, scale, zero_point, *, fmt_name, symmetric, full_range, block):
    """w, scale, zero_point: [F, K] (K a multiple of block); upper: [K, K] → codes [F, K]."""
    fmt = get_format(fmt_name)
    f, k = w.shape
    zp = jnp.zeros_like(w) if zero_point is None else zero_point
    cols = jnp.arange(k)
    zp_or_none = None if zero_point is None else 0

    def block_step(b, state):
        w, codes = state
        i1 = b * block
        w1, s1, z1 = column_block(i1, block, w, scale, zp)
        u1 = jax.lax.dynamic_slice(upper, (i1, i1), (block, block))

        def column(i, inner):
            w1, c1, e1 = inner
            col = w1[:, i]
            s, z = s1[:, i], None if zp_or_none is None else z1[:, i]
            code = _grid.encode(fmt, col, s, z, symmetric, full_range=full_range)
            q = _grid.decode(fmt, code, s, z)
            err = (col - q) / u1[i, i]
            # U is upper triangular: row i touches columns >= i only.
            w1 = w1 - err[:, None] * u1[i][None, :]
            return w1, c1.at[:, i].set(code), e1.at[:, i].set(err)

        c0 = jnp.zeros((f, block), fmt.code_dtype)
        _, c1, e1 = jax.lax.fori_loop(0, block, column, (w1, c0, jnp.zeros((f, block), w.dtype)))
        rows = jax.lax.dynamic_slice(upper, (i1, 0), (block, k))
        later = jnp.where(cols[None, :] >= i1 + block, rows, 0.0)
        w = w - jnp.dot(e1, later, precision=jax.lax.Precision.HIGHEST)
        codes = jax.lax.dynamic_update_slice(codes, c1, (0, i1))
        return w, codes

    codes = jnp.zeros((f, k), fmt.code_dtype)
    _, codes = jax.lax.fori_loop(0, k // block, block_step, (w, codes))
    return codes


@functools.partial(
    jax.jit, static_argnames=("fmt_name", "symmetric", "full_range", "block", "sweeps")
)
def _refine_codes(
    w, codes, h, scale, zero_point, *, fmt_name, symmetric, full_range, block, sweeps
):
    """Greedy coordinate descent on the codes: column by column, each row's code moves one grid
    level up or down when that lowers ``eᵀ H e`` (e = w - dequantized row), and the gradient
    ``g = e H`` follows (lazily per block of columns, like GPTQ's updates).

    w, codes, scale, zero_point: [F, K] (K a multiple of block); h: [K, K] → codes [F, K].
    """
    fmt = get_format(fmt_name)
    levels = np.asarray(fmt.levels(), np.float32)
    if symmetric:
        low = _grid.lowest(fmt, full_range)
        levels = levels[(levels >= low) & (levels <= fmt.max_value)]
    level_codes = fmt.encode(jnp.asarray(levels))
    levels = jnp.asarray(levels)
    n_levels = levels.shape[0]
    f, k = w.shape
    zp = jnp.zeros_like(w) if zero_point is None else zero_point
    unit = fmt.decode(codes).astype(jnp.float32)
    index = jnp.clip(jnp.searchsorted(levels, unit), 0, n_levels - 1)
    q = (levels[index] - zp) * scale
    g = jnp.dot(w - q, h, precision=jax.lax.Precision.HIGHEST)

    def block_step(b, state):
        index, g = state
        i1 = b * block
        idx1, g1, s1, z1 = column_block(i1, block, index, g, scale, zp)
        h11 = jax.lax.dynamic_slice(h, (i1, i1), (block, block))

        def column(i, inner):
            idx1, g1, d1 = inner
            cur = idx1[:, i]
            s, z = s1[:, i], z1[:, i]
            value = (levels[cur] - z) * s
            best_gain, best_idx = jnp.zeros_like(s), cur
            for step in (-1, 1):
                cand = jnp.clip(cur + step, 0, n_levels - 1)
                de = value - (levels[cand] - z) * s  # change of e = w - q
                gain = -(2 * de * g1[:, i] + de * de * h11[i, i])
                better = (gain > best_gain) & (cand != cur)
                best_gain = jnp.where(better, gain, best_gain)
                best_idx = jnp.where(better, cand, best_idx)
            de = value - (levels[best_idx] - z) * s
            g1 = g1 + de[:, None] * h11[i][None, :]
            return idx1.at[:, i].set(best_idx), g1, d1.at[:, i].set(de)

        d0 = jnp.zeros((f, block), w.dtype)
        idx1, _, d1 = jax.lax.fori_loop(0, block, column, (idx1, g1, d0))
        rows = jax.lax.dynamic_slice(h, (i1, 0), (block, k))
        g = g + jnp.dot(d1, rows, precision=jax.lax.Precision.HIGHEST)
        return jax.lax.dynamic_update_slice(index, idx1, (0, i1)), g

    for _ in range(sweeps):
        index, g = jax.lax.fori_loop(0, k // block, block_step, (index, g))
    return level_codes[index]


def gptq_matrix(
    w: jax.Array,
    gram: jax.Array,
    grid: _grid.Grid,
    fmt_name: str,
    algorithm: GPTQ,
    factors: dict | None = None,
) -> GPTQResult:
    """GPTQ codes of one matrix.

    Args:
      w: [F, K] float weight (rows = outputs, columns = inputs).
      gram: [K, K] input Gram matrix XᵀX (any positive multiple).
      grid: per-element scale / zero point, [F, K] each.
      fmt_name: the element format.
      algorithm: the `GPTQ` settings.
      factors: a dict the caller keeps across weights to reuse the inverse-Hessian factor of
        an identical Gram matrix (q, k and v projections read the same input); None: none.
    Returns:
      `GPTQResult`; `damp` None when the Hessian never factorized (then codes are RTN's).
    """
    f, k = w.shape
    w = jnp.asarray(w, jnp.float32)
    scale, zp = grid.scale, grid.zero_point
    gram = np.asarray(gram)
    perm = None
    if algorithm.act_order:
        perm = np.argsort(-np.diag(gram), kind="stable")
        gram = gram[perm][:, perm]
    upper, damp = _shared_factor(gram, algorithm.damp, factors)
    if upper is None:
        fmt = get_format(fmt_name)
        return GPTQResult(_grid.encode(fmt, w, scale, zp, grid.symmetric), None)
    if perm is not None:
        w, scale = w[:, perm], scale[:, perm]
        zp = None if zp is None else zp[:, perm]
    block = min(algorithm.block, k)
    pad = -k % block
    if pad:
        w, upper = pad_columns(w, upper, pad)
        scale = jnp.pad(scale, ((0, 0), (0, pad)), constant_values=1.0)
        zp = None if zp is None else jnp.pad(zp, ((0, 0), (0, pad)))
    on_grid = dict(
        fmt_name=fmt_name, symmetric=grid.symmetric, full_range=algorithm.full_range, block=block
    )
    codes = _gptq_columns(w, upper, scale, zp, **on_grid)
    if algorithm.refine:
        h = jnp.pad(jnp.asarray(_damped(_live(gram), damp), jnp.float32), ((0, pad), (0, pad)))
        codes = _refine_codes(w, codes, h, scale, zp, **on_grid, sweeps=algorithm.refine)
    codes = codes[:, :k]
    if perm is not None:
        codes = codes[:, np.argsort(perm)]
    return GPTQResult(codes, damp)


def as_matrix(
    x: jax.Array, input_axes: tuple[int, ...]
) -> tuple[jax.Array, tuple[int, ...], tuple[int, ...]]:
    """x [*shape] → ([F, K], permutation, permuted shape) with the input axes last."""
    out_axes = [a for a in range(x.ndim) if a not in input_axes]
    perm = (*out_axes, *input_axes)
    moved = jnp.transpose(x, perm)
    k = int(np.prod([x.shape[a] for a in input_axes]))
    return moved.reshape(-1, k), perm, moved.shape


def from_matrix(m: jax.Array, perm: tuple[int, ...], moved_shape: tuple[int, ...]) -> jax.Array:
    return jnp.transpose(m.reshape(moved_shape), np.argsort(perm))


def gptq_qarray(
    w: jax.Array, q: QArray, stats: list, algorithm: GPTQ, factors: dict | None = None
) -> tuple[QArray, list[str]]:
    """GPTQ on a parameter, per stats entry (one per stacked layer index).

    Args:
      w: the float parameter.
      q: its RTN QArray (the layout and scales kept).
      stats: `WeightStats` of this parameter (one per fixed index).
      algorithm: settings.
      factors: as for `gptq_matrix`.
    Returns:
      (QArray with GPTQ codes, notes such as singular-Hessian fallbacks).
    """
    fmt = q.fmt
    grid = _grid.grid_of(q)
    codes = q.unpacked_codes()
    notes = []
    w = jnp.asarray(w, jnp.float32)
    for s in stats:
        index = [slice(None)] * w.ndim
        for axis, i in s.fixed:
            index[axis] = i
        index = tuple(index)
        kept = [a for a in range(w.ndim) if not isinstance(index[a], int)]
        input_axes = tuple(kept.index(a) for a in s.input_axes)
        wm, perm, moved = as_matrix(w[index], input_axes)
        sub_grid = _grid.Grid(
            as_matrix(grid.scale[index], input_axes)[0],
            None if grid.zero_point is None else as_matrix(grid.zero_point[index], input_axes)[0],
            grid.symmetric,
        )
        result = gptq_matrix(wm, s.gram, sub_grid, fmt.name, algorithm, factors)
        if result.damp is None:
            layer = s.path + "".join(f"[{i}]" for _, i in s.fixed)
            notes.append(f"{layer}: Hessian singular after dampening, RTN codes kept")
        codes = codes.at[index].set(from_matrix(result.codes, perm, moved))
    return _grid.with_codes(q, codes), notes
