"""GGUF block encoders: float32 to blocks with llama.cpp's reference quantizers.

Vectorised ports of ``quantize_row_*_ref``: the same scale searches, on every block at once.
Values that already are decoded blocks come back with the same values: Q8_K keeps such a
block's own scale, and the K-quants are re-fitted (`_gguf_refit`) where the search misses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import _gguf_refit as refit
from lowbit.formats._gguf_blocks import (
    BLOCK_TYPES,
    GROUP_MAX_EPS,
    IQ4_NL_VALUES,
    QK_K,
    block_type,
    f16,
    f16_bytes,
    k_scales_pack,
    nearest,
    pack_2bit_128,
    pack_nibbles_32,
    pack_nibbles_64,
    pack_q3_k,
    reciprocal,
    roundf,
    safe_div,
    signed_absmax,
    u8,
)

# --- encoders: x [..., nb, block_size] float32 -> [..., nb, type_size] uint8 -----------------


def _enc_q8_0(x):
    amax, _ = signed_absmax(x)
    d = amax / 127
    q = roundf(x * safe_div(1.0, d)[..., None]).astype(jnp.int8)
    return jnp.concatenate([f16_bytes(d), jax.lax.bitcast_convert_type(q, jnp.uint8)], -1)


def _enc_q4_0(x):
    _, mx = signed_absmax(x)
    d = mx / -8
    x0 = x * safe_div(1.0, d)[..., None]
    q = jnp.minimum(15, (x0 + 8.5).astype(jnp.int8))
    return jnp.concatenate([f16_bytes(d), pack_nibbles_32(q)], -1)


def _enc_q4_1(x):
    lo, hi = x.min(-1), x.max(-1)
    d = (hi - lo) / 15
    x0 = (x - lo[..., None]) * safe_div(1.0, d)[..., None]
    q = jnp.minimum(15, (x0 + 0.5).astype(jnp.int8))
    return jnp.concatenate([f16_bytes(d), f16_bytes(lo), pack_nibbles_32(q)], -1)


def _q5_high_bytes(q):
    bits = ((u8(q) >> 4) & 1).reshape(*q.shape[:-1], 4, 8)
    return jnp.sum(bits << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def _enc_q5_0(x):
    _, mx = signed_absmax(x)
    d = mx / -16
    x0 = x * safe_div(1.0, d)[..., None]
    q = jnp.minimum(31, (x0 + 16.5).astype(jnp.int8))
    return jnp.concatenate([f16_bytes(d), _q5_high_bytes(q), pack_nibbles_32(q & 15)], -1)


def _enc_q5_1(x):
    lo, hi = x.min(-1), x.max(-1)
    d = (hi - lo) / 31
    x0 = (x - lo[..., None]) * safe_div(1.0, d)[..., None]
    q = jnp.minimum(31, (x0 + 0.5).astype(jnp.int8))
    parts = [f16_bytes(d), f16_bytes(lo), _q5_high_bytes(q), pack_nibbles_32(q & 15)]
    return jnp.concatenate(parts, -1)


def _best_index_iq4(x):
    """llama.cpp's `best_index_int8` on the IQ4_NL values, elementwise."""
    values = jnp.asarray(IQ4_NL_VALUES, jnp.float32)
    mu = jnp.clip(jnp.searchsorted(values, x, side="right"), 1, 15)
    lower, upper = values[mu - 1], values[mu]
    idx = jnp.where(x - lower < upper - x, mu - 1, mu)
    return jnp.where(x <= values[0], 0, jnp.where(x >= values[15], 15, idx))


def _iq4_scale(x, ntry=7):
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
    q = values[_best_index_iq4(x * (1 / d)[..., None])]
    sumqx, sumq2 = (w * q * x).sum(-1), (w * q * q).sum(-1)
    d = safe_div(sumqx, sumq2)
    best = d * sumqx
    candidates = [(itry + values[0]) / mx_safe for itry in range(-ntry, ntry + 1)]
    for i, inv in enumerate([*candidates, values[15] / mx_safe]):
        q = values[_best_index_iq4(x * inv[..., None])]
        sqx, sq2 = (w * q * x).sum(-1), (w * q * q).sum(-1)
        slack = 1 - 1e-6 if i == len(candidates) else 1.0
        better = (sq2 > 0) & (sqx * sqx > best * sq2 * slack)
        d = jnp.where(better, safe_div(sqx, sq2), d)
        best = jnp.where(better, d * sqx, best)
    return jnp.where(flat, 0.0, d)


def _enc_iq4_nl(x):
    d = _iq4_scale(x)
    idx = _best_index_iq4(x * safe_div(1.0, d)[..., None])
    return jnp.concatenate([f16_bytes(d), pack_nibbles_32(idx)], -1)


def _enc_iq4_xs(x):
    """llama.cpp's `quantize_row_iq4_xs_impl` without an importance matrix: the IQ4_NL scale
    search per 32 elements (`_iq4_scale`), then 6-bit sub-block scales under one fp16
    superblock scale."""
    xb = x.reshape(*x.shape[:-1], 8, 32)
    scales = _iq4_scale(xb)  # [..., 8]
    first = jnp.argmax(jnp.abs(scales), axis=-1)
    max_scale = jnp.take_along_axis(scales, first[..., None], axis=-1)[..., 0]
    dsup = -max_scale / 32
    level = jnp.clip(nearest(safe_div(1.0, dsup)[..., None] * scales), -32, 31)
    dl = dsup[..., None] * level.astype(jnp.float32)
    idx = _best_index_iq4(xb * safe_div(1.0, dl)[..., None])
    ls = (level + 32).astype(jnp.uint8)
    low = ls[..., 0::2] & 15 | ((ls[..., 1::2] & 15) << 4)
    high = jnp.sum((ls >> 4).astype(jnp.uint16) << (2 * jnp.arange(8, dtype=jnp.uint16)), -1)
    high = jax.lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.uint8)
    qs = pack_nibbles_32(idx).reshape(*x.shape[:-1], 128)
    return jnp.concatenate([f16_bytes(dsup), high, low, qs], -1)


def _make_qkx2(x, weights, nmax, rmin, rdelta, nstep, use_mad):
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
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * step + nmax) / span
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
        q = jnp.where(better[..., None], ql, q)
        best = jnp.where(better, cur, best)
        scale = jnp.where(better, this_scale, scale)
        mn = jnp.where(better, this_min, mn)
    scale = jnp.where(flat, 0.0, scale)
    q = jnp.where(flat[..., None], 0.0, q)
    return scale, -mn, q


def _make_qx(x, nmax):
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
    for step in range(-9, 10):
        if step == 0:
            continue
        ql, slx, sl2 = try_scale(-(nmax + 0.1 * step) / mx)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        q = jnp.where(better[..., None], ql, q)
        scale = jnp.where(better, safe_div(slx, sl2), scale)
        best = jnp.where(better, scale * slx, best)
    return jnp.where(flat, 0.0, scale), jnp.where(flat[..., None], 0.0, q + nmax)


def _make_q3(x, nmax=4, tries=5):
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


def _k_min_encode(x, nmax, rmin, nstep):
    """Q4_K / Q5_K: (d, dmin bytes, 12 scale bytes, codes [..., 256] in [0, nmax])."""
    xs = x.reshape(*x.shape[:-1], 8, 32)
    av_x = jnp.sqrt((xs * xs).sum(-1) / 32)
    weights = av_x[..., None] + jnp.abs(xs)
    scales, mins, q = _make_qkx2(xs, weights, nmax, rmin, 0.1, nstep, False)
    max_scale = jnp.maximum(scales.max(-1), 0.0)
    max_min = jnp.maximum(mins.max(-1), 0.0)
    inv_scale = safe_div(63.0, max_scale)
    inv_min = safe_div(63.0, max_min)
    ls = jnp.clip(nearest(inv_scale[..., None] * scales), 0, 63)
    lm = jnp.clip(nearest(inv_min[..., None] * mins), 0, 63)
    d16, dmin16 = f16_bytes(max_scale / 63), f16_bytes(max_min / 63)
    dl = f16(d16)[..., None] * ls.astype(jnp.float32)
    ml = f16(dmin16)[..., None] * lm.astype(jnp.float32)
    new = jnp.clip(nearest((xs + ml[..., None]) / jnp.where(dl == 0, 1, dl)[..., None]), 0, nmax)
    q = jnp.where((dl == 0)[..., None], q, new.astype(jnp.float32))
    d16, dmin16, ls, lm, q = refit.exact_k_min(xs, d16, dmin16, ls, lm, q, nmax, 63)
    header = [d16, dmin16, k_scales_pack(ls, lm)]
    return header, q.reshape(*x.shape[:-1], QK_K).astype(jnp.uint8)


def _enc_q4_k(x):
    header, q = _k_min_encode(x, 15, -1.0, 20)
    return jnp.concatenate([*header, pack_nibbles_64(q)], -1)


def _enc_q5_k(x):
    header, q = _k_min_encode(x, 31, -0.5, 15)
    high = ((q >> 4) & 1).reshape(*q.shape[:-1], 8, 32)
    qh = jnp.sum(high << jnp.arange(8, dtype=jnp.uint8)[:, None], axis=-2, dtype=jnp.uint8)
    return jnp.concatenate([*header, qh, pack_nibbles_64(q & 15)], -1)


def _enc_q6_k(x):
    xs = x.reshape(*x.shape[:-1], 16, 16)
    scales, q = _make_qx(xs, 32)
    amax, max_scale = signed_absmax(scales)
    flat = amax < GROUP_MAX_EPS
    iscale = -128.0 / jnp.where(flat, 1.0, max_scale)
    d16 = f16_bytes(jnp.where(flat, 0.0, reciprocal(iscale)))
    sc = jnp.minimum(127, nearest(iscale[..., None] * scales))
    sc = jnp.where(flat[..., None], 0, sc)
    dl = f16(d16)[..., None] * sc.astype(jnp.float32)
    new = jnp.clip(nearest(xs / jnp.where(dl == 0, 1, dl)[..., None]), -32, 31) + 32
    q = jnp.where((dl == 0)[..., None], q, new.astype(jnp.float32))
    q = jnp.where(flat[..., None, None], 0.0, q)
    hit = jnp.all(dl[..., None] * (q - 32) == xs, axis=-1)

    d16, sc, q = jax.lax.cond(
        refit.needs_refit(xs, hit),
        lambda: refit.refit_q6_k(xs, d16, sc.astype(jnp.int32), q),
        lambda: (d16, sc.astype(jnp.int32), q),
    )
    q = u8(q.reshape(*x.shape[:-1], QK_K)).reshape(*x.shape[:-1], 2, 4, 32)
    ql = jnp.concatenate(
        [
            q[..., 0, :] & 15 | (q[..., 2, :] & 15) << 4,
            q[..., 1, :] & 15 | (q[..., 3, :] & 15) << 4,
        ],
        axis=-1,
    ).reshape(*x.shape[:-1], 128)
    qh = (
        (q[..., 0, :] >> 4)
        | ((q[..., 1, :] >> 4) << 2)
        | ((q[..., 2, :] >> 4) << 4)
        | ((q[..., 3, :] >> 4) << 6)
    ).reshape(*x.shape[:-1], 64)
    sc8 = jax.lax.bitcast_convert_type(sc.astype(jnp.int8), jnp.uint8)
    return jnp.concatenate([ql, qh, sc8, d16], -1)


def _enc_q2_k(x):
    xs = x.reshape(*x.shape[:-1], 16, 16)
    scales, mins, q = _make_qkx2(xs, jnp.abs(xs), 3, -0.5, 0.1, 15, True)
    max_scale = jnp.maximum(scales.max(-1), 0.0)
    max_min = jnp.maximum(mins.max(-1), 0.0)
    ls = jnp.clip(nearest(safe_div(15.0, max_scale)[..., None] * scales), 0, 15)
    lm = jnp.clip(nearest(safe_div(15.0, max_min)[..., None] * mins), 0, 15)
    d16, dmin16 = f16_bytes(max_scale / 15), f16_bytes(max_min / 15)
    dl = f16(d16)[..., None] * ls.astype(jnp.float32)
    ml = f16(dmin16)[..., None] * lm.astype(jnp.float32)
    new = jnp.clip(nearest((xs + ml[..., None]) / jnp.where(dl == 0, 1, dl)[..., None]), 0, 3)
    q = jnp.where((dl == 0)[..., None], q, new.astype(jnp.float32))
    d16, dmin16, ls, lm, q = refit.exact_k_min(xs, d16, dmin16, ls, lm, q, 3, 15, codes=4)
    qs = pack_2bit_128(q.reshape(*x.shape[:-1], QK_K))
    return jnp.concatenate([u8(ls | (lm << 4)), qs, d16, dmin16], -1)


def _enc_q3_k(x):
    xs = x.reshape(*x.shape[:-1], 16, 16)
    scales, q = _make_q3(xs)
    amax, max_scale = signed_absmax(scales)
    has = max_scale != 0
    iscale = -32.0 / jnp.where(has, max_scale, 1.0)
    l6 = jnp.clip(nearest(iscale[..., None] * scales), -32, 31) + 32
    l6 = jnp.where(has[..., None], l6, 0)
    d16 = f16_bytes(jnp.where(has, reciprocal(iscale), 0.0))
    dl = f16(d16)[..., None] * (l6 - 32).astype(jnp.float32)
    new = jnp.clip(nearest(xs / jnp.where(dl == 0, 1, dl)[..., None]), -4, 3) + 4
    q = jnp.where((dl == 0)[..., None], q, new.astype(jnp.float32))
    searched = pack_q3_k(d16, l6, q)
    hit = jnp.all(dl[..., None] * (q - 4) == xs, axis=-1)

    def lattice():
        found, exact = refit.q3_k_lattice(x)
        return jnp.where(found[..., None], exact, searched)

    return jax.lax.cond(refit.needs_refit(xs, hit), lattice, lambda: searched)


def _enc_q8_k(x):
    amax, mx = signed_absmax(x)
    flat = amax == 0
    iscale = -127.0 / jnp.where(flat, 1.0, mx)
    q = jnp.minimum(127, nearest(iscale[..., None] * x))
    d = jnp.where(flat, 0.0, reciprocal(iscale)).astype(jnp.float32)
    # Values that are already a Q8_K block's (d q, the extreme one at q = -127) keep that d
    # and those codes: the reference's d = 1 / (-127 / mx) can land one ulp away from it, so
    # re-encoding decoded blocks would not give them back. mx / -127 is d or one ulp from it.
    found = flat
    for toward in (None, jnp.inf, -jnp.inf):
        d_try = mx / -127.0
        if toward is not None:
            d_try = jnp.nextafter(d_try, jnp.float32(toward))
        q_try = jnp.clip(nearest(x / jnp.where(flat, 1.0, d_try)[..., None]), -128, 127)
        exact = ~found & jnp.all(d_try[..., None] * q_try.astype(jnp.float32) == x, axis=-1)
        q = jnp.where(exact[..., None], q_try, q)
        d = jnp.where(exact, d_try, d).astype(jnp.float32)
        found = found | exact
    q = jnp.where(flat[..., None], 0, q).astype(jnp.int8)
    bsums = q.astype(jnp.int16).reshape(*x.shape[:-1], 16, 16).sum(-1, dtype=jnp.int16)
    parts = [
        jax.lax.bitcast_convert_type(d, jnp.uint8),
        jax.lax.bitcast_convert_type(q, jnp.uint8),
        jax.lax.bitcast_convert_type(bsums, jnp.uint8).reshape(*x.shape[:-1], 32),
    ]
    return jnp.concatenate(parts, -1)


def _ternary(x):
    amax, _ = signed_absmax(x)
    q = roundf(x * safe_div(1.0, amax)[..., None]).astype(jnp.int8) + jnp.int8(1)
    return amax, u8(q)


def _enc_tq1_0(x):
    d, q = _ternary(x)

    def fold(v, k, n):
        v = v.reshape(*v.shape[:-1], k, n).astype(jnp.uint16)
        weights = jnp.asarray([81, 27, 9, 3, 1][:k], jnp.uint16)[:, None]
        return (v * weights).sum(-2, dtype=jnp.uint16)

    packed = jnp.concatenate(
        [fold(q[..., :160], 5, 32), fold(q[..., 160:240], 5, 16), fold(q[..., 240:], 4, 4)], -1
    )
    packed = u8((packed * 256 + 242) // 243)
    return jnp.concatenate([packed, f16_bytes(d)], -1)


def _enc_tq2_0(x):
    d, q = _ternary(x)
    return jnp.concatenate([pack_2bit_128(q), f16_bytes(d)], -1)


# Every block type has its encoder, `_enc_` and the type's name in lower case.
_ENCODERS = {name: globals()[f"_enc_{name.lower()}"] for name in BLOCK_TYPES}


def max_abs(name: str) -> float:
    """The largest magnitude every block of type `name` can hold.

    The blocks store their scales (and minimums) as float16, so values past float16's maximum
    cannot be stored; llama.cpp's quantizers turn them into infinite scales. Q8_K's scale is a
    float32, and its scale search overflows only in the top bit of float32's range.
    """
    return 2.0**127 if name == "Q8_K" else float(np.finfo(np.float16).max)


def encode_traced(name: str, x: jax.Array) -> jax.Array:
    """`encode` without its own jit (for use inside a traced function).

    Values beyond ``±max_abs(name)`` (which `encode` refuses) saturate to it, so the blocks
    always decode to finite values.
    """
    t = block_type(name)
    x = jnp.asarray(x, jnp.float32)
    if x.ndim == 0 or x.shape[-1] % t.block_size:
        raise ValueError(
            f"{name} encodes rows whose length is a multiple of {t.block_size}, got shape "
            f"{tuple(x.shape)}"
        )
    x = jnp.clip(x, -max_abs(name), max_abs(name))
    blocks = x.reshape(*x.shape[:-1], -1, t.block_size)
    out = _ENCODERS[name](blocks)
    return out.reshape(*x.shape[:-1], -1)


@functools.partial(jax.jit, static_argnums=0)
def _encode_jit(name, x):
    return encode_traced(name, x)


# Blocks are encoded independently, so a tensor of any shape is encoded as a flat list of blocks
# in chunks of two fixed sizes: each type compiles at most twice per process, whatever the
# tensor shapes, and the large chunk bounds the scale searches' temporaries.
_LARGE_CHUNK = 1 << 20
_SMALL_CHUNK = 1 << 14


def _encode_blocks(name: str, flat: np.ndarray, block_size: int) -> np.ndarray:
    """flat: [n] float32, n a multiple of block_size -> [n / block_size, type_size] uint8."""
    parts = []
    n_large = flat.size // _LARGE_CHUNK * _LARGE_CHUNK
    for i in range(0, n_large, _LARGE_CHUNK):
        chunk = flat[i : i + _LARGE_CHUNK].reshape(-1, block_size)
        parts.append(np.asarray(_encode_jit(name, chunk)))
    rest = flat[n_large:]
    for i in range(0, rest.size, _SMALL_CHUNK):
        chunk = rest[i : i + _SMALL_CHUNK]
        n_blocks = chunk.size // block_size
        padded = np.zeros(_SMALL_CHUNK, np.float32)
        padded[: chunk.size] = chunk
        parts.append(np.asarray(_encode_jit(name, padded.reshape(-1, block_size)))[:n_blocks])
    return np.concatenate(parts, axis=0)


def encode(name: str, x: jax.Array | np.ndarray) -> np.ndarray:
    """Float values to GGUF blocks with llama.cpp's reference quantizer for `name`.

    Non-finite inputs are not representable: NaN / Inf raise.

    Args:
      name: GGML type name, e.g. ``"Q4_K"``.
      x: [..., n] float, n a multiple of the type's block size.
    Returns:
      uint8 [..., n / block_size * type_size] (NumPy).
    Raises:
      ValueError: for an unknown type, a row length that is not whole blocks, non-finite
        values, or values beyond ``±max_abs(name)``.
    """
    t = block_type(name)
    x = np.asarray(x, np.float32)
    if x.ndim == 0 or x.shape[-1] % t.block_size:
        raise ValueError(
            f"{name} encodes rows whose length is a multiple of {t.block_size}, got shape {x.shape}"
        )
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: cannot encode NaN or Inf values")
    peak = float(np.max(np.abs(x), initial=0.0))
    if peak > max_abs(name):
        raise ValueError(
            f"format {name.lower()!r} stores values up to ±{max_abs(name):g} (the range its "
            f"block scales can encode), but this array reaches {peak:g}; keep it in float or "
            "use a format with float32 scales (int8, int4, nf4, ...)"
        )
    if x.size == 0:
        return np.zeros((*x.shape[:-1], 0), np.uint8)
    out = _encode_blocks(name, np.ascontiguousarray(x).reshape(-1), t.block_size)
    return out.reshape(*x.shape[:-1], -1)
