"""llama.cpp's reference scale searches, on every group of a tensor at once: the IQ4_NL
search (also IQ4_XS's per sub-block), `make_qkx2_quants` (Q2_K, Q4_K, Q5_K), `make_qx_quants`
(Q6_K) and `make_q3_quants` (Q3_K). Each takes groups along the last axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.gguf._bits import GROUP_MAX_EPS, IQ4_NL_VALUES, nearest, safe_div, signed_absmax


def best_index_iq4(x):
    """llama.cpp's `best_index_int8` on the IQ4_NL values, elementwise."""
    values = jnp.asarray(IQ4_NL_VALUES, jnp.float32)
    mu = jnp.clip(jnp.searchsorted(values, x, side="right"), 1, 15)
    lower, upper = values[mu - 1], values[mu]
    idx = jnp.where(x - lower < upper - x, mu - 1, mu)
    return jnp.where(x <= values[0], 0, jnp.where(x >= values[15], 15, idx))


def iq4_scale(x, ntry=7):
    """llama.cpp's IQ4_NL scale search on every block (last axis), 0 for a flat block.

    Besides llama.cpp's candidates, one maps the extreme value onto the top level (113): it can
    only lower the error and makes decoded blocks re-encode to themselves. A tie with it (a
    constant block fits every candidate exactly) goes to the extra one: which of equal scores
    wins is otherwise float rounding, which differs across XLA builds.
    """
    values = jnp.asarray(IQ4_NL_VALUES, jnp.float32)
    w = x * x
    amax, mx = signed_absmax(x)
    flat = amax < GROUP_MAX_EPS
    mx_safe = jnp.where(flat, 1.0, mx)
    d = -mx_safe / values[0]
    q = values[best_index_iq4(x * (1 / d)[..., None])]
    sumqx, sumq2 = (w * q * x).sum(-1), (w * q * q).sum(-1)
    d = safe_div(sumqx, sumq2)
    best = d * sumqx
    # Each candidate's level for the extreme value, and its slack: a rolled loop over them
    # keeps the compiled program small (unrolled, every candidate was its own ops).
    tops = jnp.asarray([*(values[0] + itry for itry in range(-ntry, ntry + 1)), values[15]])
    slacks = jnp.asarray([1.0] * (2 * ntry + 1) + [1 - 1e-6], jnp.float32)

    def candidate(i, state):
        d, best = state
        q = values[best_index_iq4(x * (tops[i] / mx_safe)[..., None])]
        sqx, sq2 = (w * q * x).sum(-1), (w * q * q).sum(-1)
        better = (sq2 > 0) & (sqx * sqx > best * sq2 * slacks[i])
        d = jnp.where(better, safe_div(sqx, sq2), d)
        return d, jnp.where(better, d * sqx, best)

    d, _ = jax.lax.fori_loop(0, tops.shape[0], candidate, (d, best))
    return jnp.where(flat, 0.0, d)


def make_qkx2(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    """llama.cpp's `make_qkx2_quants` on every group (last axis): (scale, -min, codes)."""
    lo = jnp.minimum(x.min(-1), 0.0)
    hi = x.max(-1)
    sum_w = weights.sum(-1)
    sum_x = (weights * x).sum(-1)
    flat = hi == lo
    span = jnp.where(flat, 1.0, hi - lo)

    def err(scale, mn, q):
        diff = scale[..., None] * q + mn[..., None] - x
        return (weights * (jnp.abs(diff) if use_mad else diff * diff)).sum(-1)

    iscale = nmax / span
    scale = 1 / iscale
    q = jnp.clip(nearest(iscale[..., None] * (x - lo[..., None])), 0, nmax).astype(jnp.float32)
    best = err(scale, lo, q)
    mn = lo
    # The levels each step tries, rounded to float32 as the unrolled loop's constants were;
    # a rolled loop keeps the compiled program small (Q4_K's 21 steps unrolled took 7 s to
    # compile for one weight shape).
    levels = jnp.asarray([rmin + rdelta * step + nmax for step in range(nstep + 1)], jnp.float32)

    def step(i, state):
        q, best, scale, mn = state
        iscale = levels[i] / span
        ql = jnp.clip(nearest(iscale[..., None] * (x - lo[..., None])), 0, nmax)
        ql = ql.astype(jnp.float32)
        sum_l = (weights * ql).sum(-1)
        sum_l2 = (weights * ql * ql).sum(-1)
        sum_xl = (weights * ql * x).sum(-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        det_safe = jnp.where(ok, det, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det_safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det_safe
        clamp = this_min > 0
        this_min = jnp.where(clamp, 0.0, this_min)
        this_scale = jnp.where(clamp, safe_div(sum_xl, sum_l2), this_scale)
        cur = err(this_scale, this_min, ql)
        better = ok & (cur < best)
        return (
            jnp.where(better[..., None], ql, q),
            jnp.where(better, cur, best),
            jnp.where(better, this_scale, scale),
            jnp.where(better, this_min, mn),
        )

    q, best, scale, mn = jax.lax.fori_loop(0, nstep + 1, step, (q, best, scale, mn))
    scale = jnp.where(flat, 0.0, scale)
    q = jnp.where(flat[..., None], 0.0, q)
    return scale, -mn, q


def make_qx(x, nmax):
    """llama.cpp's `make_qx_quants(rmse_type=1)` per group: (scale, codes in [0, 2 nmax))."""
    amax, mx = signed_absmax(x)
    flat = amax < GROUP_MAX_EPS
    mx = jnp.where(flat, 1.0, mx)
    w = x * x

    def try_scale(iscale):
        q = jnp.clip(nearest(iscale[..., None] * x), -nmax, nmax - 1).astype(jnp.float32)
        return q, (w * x * q).sum(-1), (w * q * q).sum(-1)

    q, sumlx, suml2 = try_scale(-nmax / mx)
    scale = safe_div(sumlx, suml2)
    best = scale * sumlx
    # The other levels tried, rounded to float32 as the unrolled loop's constants were.
    levels = jnp.asarray([nmax + 0.1 * step for step in range(-9, 10) if step != 0], jnp.float32)

    def step(i, state):
        q, scale, best = state
        ql, slx, sl2 = try_scale(-levels[i] / mx)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        scale = jnp.where(better, safe_div(slx, sl2), scale)
        return (
            jnp.where(better[..., None], ql, q),
            scale,
            jnp.where(better, scale * slx, best),
        )

    q, scale, _ = jax.lax.fori_loop(0, levels.shape[0], step, (q, scale, best))
    return jnp.where(flat, 0.0, scale), jnp.where(flat[..., None], 0.0, q + nmax)


def make_q3(x, nmax=4, tries=5):
    """llama.cpp's `make_q3_quants(do_rmse=true)` per group of 16: (scale, codes + nmax)."""
    amax, mx = signed_absmax(x)
    flat = amax < GROUP_MAX_EPS
    mx = jnp.where(flat, 1.0, mx)
    q = jnp.clip(nearest((-nmax / mx)[..., None] * x), -nmax, nmax - 1).astype(jnp.float32)
    w = x * x
    sumlx, suml2 = (w * x * q).sum(-1), (w * q * q).sum(-1)
    n = x.shape[-1]

    # One element at a time, in order, as llama.cpp does (each step sees the previous ones);
    # a rolled loop keeps the compiled program small.
    def step(k, state):
        q, sumlx, suml2 = state
        i = k % n
        xi = jax.lax.dynamic_index_in_dim(x, i, -1, keepdims=False)
        wi = jax.lax.dynamic_index_in_dim(w, i, -1, keepdims=False)
        li = jax.lax.dynamic_index_in_dim(q, i, -1, keepdims=False)
        slx = sumlx - wi * xi * li
        sl2 = suml2 - wi * li * li
        new = jnp.clip(nearest(xi * safe_div(sl2, slx)), -nmax, nmax - 1).astype(jnp.float32)
        slx2, sl22 = slx + wi * xi * new, sl2 + wi * new * new
        take = (slx > 0) & (new != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
        li = jnp.where(take, new, li)
        q = jax.lax.dynamic_update_index_in_dim(q, li, i, -1)
        return q, jnp.where(take, slx2, sumlx), jnp.where(take, sl22, suml2)

    q, sumlx, suml2 = jax.lax.fori_loop(0, tries * n, step, (q, sumlx, suml2))
    scale = safe_div(sumlx, suml2)
    return jnp.where(flat, 0.0, scale), jnp.where(flat[..., None], 0.0, q + nmax)
