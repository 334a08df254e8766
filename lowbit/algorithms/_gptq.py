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


def pad_columns(w: jax.Array, upper: jax.Array, pad: int) -> tuple[jax.Array, jax.Array]:
    """w [F, K] and U [K, K] padded by `pad` inputs that nothing reads (U gets 1 there)."""
    k = upper.shape[0]
    w = jnp.pad(w, ((0, 0), (0, pad)))
    ones = jnp.concatenate([jnp.zeros(k), jnp.ones(pad)])
    return w, jnp.pad(upper, ((0, pad), (0, pad))) + jnp.diag(ones)


def _upper_inverse_factor(h: np.ndarray, shift: float) -> np.ndarray:
    """The upper Cholesky factor ``U`` of ``(h + shift I)⁻¹`` (``Uᵀ U = (h + shift I)⁻¹``),
    float64, from one factorization and one triangular inverse, never forming the inverse.

    With ``J`` the reversal permutation and ``J h J = M Mᵀ`` (M lower), ``R = J M J`` is upper
    and ``h = R Rᵀ``, so ``h⁻¹ = R⁻ᵀ R⁻¹`` and ``U = R⁻¹ = J M⁻¹ J``: about 2/3 K³ flops where
    factor, inverse, product and factor again take 14/3 K³ (x7 on a 14336-input weight). Both
    LAPACK calls work in place on one column-major copy (h is symmetric, so its reversal
    read column-major is itself).

    Raises:
      np.linalg.LinAlgError: ``h + shift I`` is not positive definite.
    """
    # Imported here: SciPy's linear algebra is a quarter second of every command's import,
    # and only GPTQ uses it.
    import scipy.linalg

    a = np.array(h[::-1, ::-1], np.float64, order="F")
    a[np.diag_indices_from(a)] += shift
    try:
        m = scipy.linalg.cholesky(a, lower=True, overwrite_a=True, check_finite=False)
    except scipy.linalg.LinAlgError as error:
        raise np.linalg.LinAlgError(str(error)) from error
    inverse, info = scipy.linalg.lapack.dtrtri(m, lower=1, overwrite_c=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"triangular inverse failed (info {info})")
    return inverse[::-1, ::-1]


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
            upper = _upper_inverse_factor(h, frac * mean)
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


# The inner block of `sweep`: a column's update then rewrites F x 16 floats, which stay in the
# core's cache, not the whole F x 128 block (GPTQ of a 1536 x 576 weight: 28 -> 15 ms).
INNER_BLOCK = 16


def sweep_blocks(block: int) -> tuple[int, ...]:
    """`sweep`'s block sizes for lazy blocks of `block` columns: an inner level of
    `INNER_BLOCK` where it divides `block` and is smaller."""
    if block > INNER_BLOCK and block % INNER_BLOCK == 0:
        return (block, INNER_BLOCK)
    return (block,)


def sweep(x, m, inputs, column, out_dtypes, blocks: tuple[int, ...]):
    """Visits the columns of ``x`` [F, B] left to right: ``column(x[:, i], m[i, i], inputs at
    column i)`` gives a change ``d`` [F] and outputs, and ``x += d m[i]`` (an outer product),
    so every later column sees every earlier change. The changes are applied lazily: within a
    block of ``blocks[0]`` columns to the block's own copy, then to all of ``x`` by one matrix
    product, recursively for each level of `blocks` (sizes dividing B and each other).

    Args:
      x: [F, B] float32, the state the columns read (GPTQ's weight, the refinement's gradient).
      m: [B, B] coupling: column i's change moves the state by ``d · m[i]``.
      inputs: tuple of [F, B] arrays read per column.
      column: ``(x_i [F], m_ii, inputs_i) -> (d [F], outputs tuple of [F])``.
      out_dtypes: the dtypes of `column`'s outputs.
      blocks: lazy block sizes, outermost first; () visits columns one at a time.
    Returns:
      (x [F, B] with every change applied, outputs tuple of [F, B]).
    """
    # Columns are visited as the rows of the transposes: each one is contiguous.
    xt, _, outs = _sweep_rows(x.T, m, tuple(a.T for a in inputs), column, out_dtypes, blocks)
    return xt.T, tuple(o.T for o in outs)


def _sweep_rows(x, m, inputs, column, out_dtypes, blocks):
    """`sweep` on the transposes: x and inputs [B, F]; returns (x, changes, outputs) [B, F]."""
    b, f = x.shape
    init = (x, jnp.zeros_like(x), tuple(jnp.zeros((b, f), dtype) for dtype in out_dtypes))
    if not blocks:

        def one(i, state):
            x, d, outs = state
            di, out = column(x[i], m[i, i], tuple(a[i] for a in inputs))
            outs = tuple(o.at[i].set(v) for o, v in zip(outs, out, strict=True))
            return x + m[i][:, None] * di[None, :], d.at[i].set(di), outs

        return jax.lax.fori_loop(0, b, one, init)
    size = blocks[0]

    def lazy(j, state):
        x, d, outs = state
        i1 = j * size
        xb, *inb = (jax.lax.dynamic_slice(a, (i1, 0), (size, f)) for a in (x, *inputs))
        mb = jax.lax.dynamic_slice(m, (i1, i1), (size, size))
        _, db, ob = _sweep_rows(xb, mb, tuple(inb), column, out_dtypes, blocks[1:])
        rows = jax.lax.dynamic_slice(m, (i1, 0), (size, b))
        x = x + jnp.dot(rows.T, db, precision=jax.lax.Precision.HIGHEST)
        d = jax.lax.dynamic_update_slice(d, db, (i1, 0))
        outs = tuple(
            jax.lax.dynamic_update_slice(o, v, (i1, 0)) for o, v in zip(outs, ob, strict=True)
        )
        return x, d, outs

    return jax.lax.fori_loop(0, b // size, lazy, init)


def _gptq_columns(w, upper, scale, zero_point, *, fmt_name, symmetric, full_range, block):
    """w, scale, zero_point: [F, K] (K a multiple of block); upper: [K, K] → codes [F, K]
    (traced: `_gptq_codes` compiles it)."""
    fmt = get_format(fmt_name)
    zp = jnp.zeros_like(w) if zero_point is None else zero_point
    asym = zero_point is not None

    def column(col, u_ii, at):
        s, z = at
        z = z if asym else None
        code = _grid.encode(fmt, col, s, z, symmetric, full_range=full_range)
        # U is upper triangular: column i's error moves the columns >= i only.
        return -(col - _grid.decode(fmt, code, s, z)) / u_ii, (code,)

    blocks = sweep_blocks(block)
    _, (codes,) = sweep(w, upper, (scale, zp), column, (fmt.code_dtype,), blocks)
    return codes


def _refine_codes(
    w, codes, h, scale, zero_point, *, fmt_name, symmetric, full_range, block, sweeps
):
    """Greedy coordinate descent on the codes: column by column, each row's code moves one grid
    level up or down when that lowers ``eᵀ H e`` (e = w - dequantized row), and the gradient
    ``g = e H`` follows (lazily per block of columns, like GPTQ's updates).

    w, codes, scale, zero_point: [F, K] (K a multiple of block); h: [K, K] → codes [F, K]
    (traced: `_gptq_codes` compiles it).
    """
    fmt = get_format(fmt_name)
    levels = np.asarray(fmt.levels(), np.float32)
    if symmetric:
        low = _grid.lowest(fmt, full_range)
        levels = levels[(levels >= low) & (levels <= fmt.max_value)]
    level_codes = fmt.encode(jnp.asarray(levels))
    levels = jnp.asarray(levels)
    n_levels = levels.shape[0]
    zp = jnp.zeros_like(w) if zero_point is None else zero_point
    unit = fmt.decode(codes).astype(jnp.float32)
    index = jnp.clip(jnp.searchsorted(levels, unit), 0, n_levels - 1)
    q = (levels[index] - zp) * scale
    g = jnp.dot(w - q, h, precision=jax.lax.Precision.HIGHEST)

    def column(g_i, h_ii, at):
        cur, s, z = at
        value = (levels[cur] - z) * s
        best_gain, best_idx = jnp.zeros_like(s), cur
        for step in (-1, 1):
            cand = jnp.clip(cur + step, 0, n_levels - 1)
            de = value - (levels[cand] - z) * s  # change of e = w - q
            gain = -(2 * de * g_i + de * de * h_ii)
            better = (gain > best_gain) & (cand != cur)
            best_gain = jnp.where(better, gain, best_gain)
            best_idx = jnp.where(better, cand, best_idx)
        return value - (levels[best_idx] - z) * s, (best_idx,)

    blocks = sweep_blocks(block)
    for _ in range(sweeps):
        g, (index,) = sweep(g, h, (index, scale, zp), column, (index.dtype,), blocks)
    return level_codes[index]


@functools.partial(
    jax.jit, static_argnames=("fmt_name", "symmetric", "full_range", "block", "sweeps")
)
def _gptq_codes(
    w,
    gram,
    upper,
    damp,
    scale,
    zero_point,
    perm,
    *,
    fmt_name,
    symmetric,
    full_range,
    block,
    sweeps,
):
    """GPTQ's codes of one matrix in one program: inputs permuted by `perm` (act order; None
    keeps them), padded to whole blocks, rounded column by column, refined by `sweeps` sweeps,
    then put back in the inputs' order.

    w, scale, zero_point: [F, K]; gram: [K, K] (inputs' order); upper: [K, K] (perm's order);
    damp: the dampening fraction `upper` was factorized with; perm: [K] int or None
    → codes [F, K].
    """
    k = w.shape[1]
    if perm is not None:
        w, scale, gram = w[:, perm], scale[:, perm], gram[perm][:, perm]
        zero_point = None if zero_point is None else zero_point[:, perm]
    pad = -k % block
    if pad:
        w, upper = pad_columns(w, upper, pad)
        scale = jnp.pad(scale, ((0, 0), (0, pad)), constant_values=1.0)
        zero_point = None if zero_point is None else jnp.pad(zero_point, ((0, 0), (0, pad)))
    on_grid = dict(fmt_name=fmt_name, symmetric=symmetric, full_range=full_range, block=block)
    codes = _gptq_columns(w, upper, scale, zero_point, **on_grid)
    if sweeps:
        # The Hessian the factor was taken of (`_live`, then `inverse_hessian_factor`'s shift),
        # rebuilt here in float32 rather than sent over from the host's float64 copy.
        diag = jnp.diagonal(gram)
        live = jnp.where(diag > 0, diag, 1.0)
        h = gram + jnp.diag(live - diag + damp * jnp.mean(live))
        h = jnp.pad(h, ((0, pad), (0, pad)))
        codes = _refine_codes(w, codes, h, scale, zero_point, **on_grid, sweeps=sweeps)
    codes = codes[:, :k]
    if perm is not None:
        codes = codes[:, jnp.argsort(perm)]
    return codes


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
    k = w.shape[1]
    w = jnp.asarray(w, jnp.float32)
    scale, zp = grid.scale, grid.zero_point
    host = np.asarray(gram)
    perm = None
    if algorithm.act_order:
        perm = np.argsort(-np.diag(host), kind="stable")
        host = host[perm][:, perm]
    upper, damp = _shared_factor(host, algorithm.damp, factors)
    if upper is None:
        fmt = get_format(fmt_name)
        return GPTQResult(_grid.encode(fmt, w, scale, zp, grid.symmetric), None)
    codes = _gptq_codes(
        w,
        jnp.asarray(gram, jnp.float32),
        upper,
        jnp.float32(damp),
        scale,
        zp,
        None if perm is None else jnp.asarray(perm, jnp.int32),
        fmt_name=fmt_name,
        symmetric=grid.symmetric,
        full_range=algorithm.full_range,
        block=min(algorithm.block, k),
        sweeps=algorithm.refine,
    )
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


def _fixed_index(ndim: int, fixed) -> tuple[int | None, ...]:
    """Per axis the index a stats entry fixes (a stacked layer), or None (the whole axis):
    hashable, so it can be a compiled helper's static argument."""
    index: list[int | None] = [None] * ndim
    for axis, i in fixed:
        index[axis] = i
    return tuple(index)


def _at(index: tuple[int | None, ...]) -> tuple:
    return tuple(slice(None) if i is None else i for i in index)


@functools.partial(jax.jit, static_argnames=("index", "input_axes"))
def _problem(w, q, *, index, input_axes):
    """One stats entry's weight, scale and zero point as [F, K] matrices (inputs last)."""
    grid = _grid.grid_of(q)
    at = _at(index)

    def take(x):
        return None if x is None else as_matrix(x[at], input_axes)[0]

    return take(w.astype(jnp.float32)), take(grid.scale), take(grid.zero_point)


@functools.partial(jax.jit, static_argnames=("places",))
def _with_matrix_codes(q, matrices, *, places):
    """`q` with its codes at each place ``(index, input_axes)`` replaced by the matching
    [F, K] codes of `matrices` (GPTQ's), packed like `q`'s."""
    codes = q.unpacked_codes()
    for m, (index, input_axes) in zip(matrices, places, strict=True):
        at = _at(index)
        _, perm, moved = as_matrix(codes[at], input_axes)
        codes = codes.at[at].set(from_matrix(m, perm, moved))
    return _grid.with_codes(q, codes)


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
    notes, matrices, places = [], [], []
    for s in stats:
        index = _fixed_index(w.ndim, s.fixed)
        kept = [a for a in range(w.ndim) if index[a] is None]
        input_axes = tuple(kept.index(a) for a in s.input_axes)
        wm, scale, zero_point = _problem(w, q, index=index, input_axes=input_axes)
        sub_grid = _grid.Grid(scale, zero_point, q.zero_point is None)
        result = gptq_matrix(wm, s.gram, sub_grid, q.fmt.name, algorithm, factors)
        if result.damp is None:
            layer = s.path + "".join(f"[{i}]" for _, i in s.fixed)
            notes.append(f"{layer}: Hessian singular after dampening, RTN codes kept")
        matrices.append(result.codes)
        places.append((index, input_axes))
    return _with_matrix_codes(q, matrices, places=tuple(places)), notes
