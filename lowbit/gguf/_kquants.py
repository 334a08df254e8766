"""Codecs of the 256-element K-quant types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K and IQ4_XS.

Per type, `decode_*` takes blocks ``[..., nb, type_size]`` to float32 ``[..., nb, 256]`` and
`encode_*` back, with llama.cpp's reference scale searches (`lowbit.gguf._search`). Values that
already are decoded blocks come back with the same values: Q8_K keeps such a block's own scale,
and the K-quants are re-fitted (`lowbit.gguf._refit`) where the search misses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.gguf import _refit as refit
from lowbit.gguf import _search as search
from lowbit.gguf._bits import (
    GROUP_MAX_EPS,
    IQ4_NL_VALUES,
    QK_K,
    f16,
    f16_bytes,
    k_scales_pack,
    k_scales_unpack,
    nearest,
    pack_2bit_128,
    pack_nibbles_32,
    pack_nibbles_64,
    pack_q3_k,
    q3_scales_unpack,
    reciprocal,
    safe_div,
    shifts,
    signed_absmax,
    u8,
    unpack_2bit_128,
    unpack_nibbles_32,
    unpack_nibbles_64,
)

# --- Q2_K ---------------------------------------------------------------------------------


def decode_q2_k(b):
    sc, qs = b[..., 0:16], b[..., 16:80]
    d, dmin = f16(b[..., 80:82])[..., None], f16(b[..., 82:84])[..., None]
    dl = (d * (sc & 15).astype(jnp.float32))[..., None]
    ml = (dmin * (sc >> 4).astype(jnp.float32))[..., None]
    q = unpack_2bit_128(qs).reshape(*b.shape[:-1], 16, 16).astype(jnp.float32)
    return (dl * q - ml).reshape(*b.shape[:-1], QK_K)


def encode_q2_k(x):
    xs = x.reshape(*x.shape[:-1], 16, 16)
    scales, mins, q = search.make_qkx2(xs, jnp.abs(xs), 3, -0.5, 0.1, 15, True)
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


# --- Q3_K ---------------------------------------------------------------------------------


def decode_q3_k(b):
    hmask, qs = b[..., 0:32], b[..., 32:96]
    d = f16(b[..., 108:110])[..., None]
    sc = (q3_scales_unpack(b[..., 96:108]).astype(jnp.int8) - jnp.int8(32)).astype(jnp.float32)
    dl = (d * sc)[..., None]
    ql = unpack_2bit_128(qs)
    qh = (hmask[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1
    qh = qh.reshape(*b.shape[:-1], QK_K) ^ 1
    q = ql.astype(jnp.int8) - (qh << 2).astype(jnp.int8)
    q = q.astype(jnp.float32).reshape(*b.shape[:-1], 16, 16)
    return (dl * q).reshape(*b.shape[:-1], QK_K)


def encode_q3_k(x):
    xs = x.reshape(*x.shape[:-1], 16, 16)
    scales, q = search.make_q3(xs)
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
        found, exact = refit.q3_k_lattice(x, decode_q3_k)
        return jnp.where(found[..., None], exact, searched)

    return jax.lax.cond(refit.needs_refit(xs, hit), lattice, lambda: searched)


# --- Q4_K and Q5_K ------------------------------------------------------------------------


def _k_min_decode(b, q):
    d, dmin = f16(b[..., 0:2])[..., None], f16(b[..., 2:4])[..., None]
    sc, mn = k_scales_unpack(b[..., 4:16])
    dl = (d * sc.astype(jnp.float32))[..., None]
    ml = (dmin * mn.astype(jnp.float32))[..., None]
    q = q.reshape(*b.shape[:-1], 8, 32).astype(jnp.float32)
    return (dl * q - ml).reshape(*b.shape[:-1], QK_K)


def _k_min_encode(x, nmax, rmin, nstep):
    """Q4_K / Q5_K: (d, dmin bytes, 12 scale bytes, codes [..., 256] in [0, nmax])."""
    xs = x.reshape(*x.shape[:-1], 8, 32)
    av_x = jnp.sqrt((xs * xs).sum(-1) / 32)
    weights = av_x[..., None] + jnp.abs(xs)
    scales, mins, q = search.make_qkx2(xs, weights, nmax, rmin, 0.1, nstep, False)
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


def decode_q4_k(b):
    return _k_min_decode(b, unpack_nibbles_64(b[..., 16:144]))


def encode_q4_k(x):
    header, q = _k_min_encode(x, 15, -1.0, 20)
    return jnp.concatenate([*header, pack_nibbles_64(q)], -1)


def _q5k_high(qh):
    bits = (qh[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1
    return bits.reshape(*qh.shape[:-1], QK_K)


def decode_q5_k(b):
    q = unpack_nibbles_64(b[..., 48:176]) | (_q5k_high(b[..., 16:48]) << 4)
    return _k_min_decode(b, q)


def encode_q5_k(x):
    header, q = _k_min_encode(x, 31, -0.5, 15)
    return jnp.concatenate([*header, q5_k_high_bytes(q), pack_nibbles_64(q & 15)], -1)


def q5_k_high_bytes(q):
    """Q5_K codes [..., 256] < 32 -> their fifth bits [..., 32] (`_q5k_high`'s inverse)."""
    high = ((u8(q) >> 4) & 1).reshape(*q.shape[:-1], 8, 32)
    return jnp.sum(high << jnp.arange(8, dtype=jnp.uint8)[:, None], axis=-2, dtype=jnp.uint8)


# --- Q6_K ---------------------------------------------------------------------------------


def _q6k_codes(b):
    """Q6_K's 6-bit codes [..., 256] uint8 (value + 32)."""
    ql, qh = b[..., 0:128], b[..., 128:192]
    low = ql.reshape(*b.shape[:-1], 2, 1, 64) >> shifts(0, 4)[:, None]
    low = (low & 15).reshape(*b.shape[:-1], QK_K)
    high = qh.reshape(*b.shape[:-1], 2, 1, 32) >> shifts(0, 2, 4, 6)[:, None]
    high = (high & 3).reshape(*b.shape[:-1], QK_K)
    return low | (high << 4)


def decode_q6_k(b):
    sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    dl = (f16(b[..., 208:210])[..., None] * sc)[..., None]
    q = (_q6k_codes(b).astype(jnp.int8) - jnp.int8(32)).astype(jnp.float32)
    return (dl * q.reshape(*b.shape[:-1], 16, 16)).reshape(*b.shape[:-1], QK_K)


def encode_q6_k(x):
    xs = x.reshape(*x.shape[:-1], 16, 16)
    scales, q = search.make_qx(xs, 32)
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
    sc8 = jax.lax.bitcast_convert_type(sc.astype(jnp.int8), jnp.uint8)
    return jnp.concatenate([q6_k_code_bytes(q.reshape(*x.shape[:-1], QK_K)), sc8, d16], -1)


def q6_k_code_bytes(q):
    """Q6_K codes [..., 256] (value + 32) -> ql [..., 128] and qh [..., 64], concatenated
    (`_q6k_codes`' inverse)."""
    q = u8(q).reshape(*q.shape[:-1], 2, 4, 32)
    ql = jnp.concatenate(
        [
            q[..., 0, :] & 15 | (q[..., 2, :] & 15) << 4,
            q[..., 1, :] & 15 | (q[..., 3, :] & 15) << 4,
        ],
        axis=-1,
    ).reshape(*q.shape[:-3], 128)
    qh = (
        (q[..., 0, :] >> 4)
        | ((q[..., 1, :] >> 4) << 2)
        | ((q[..., 2, :] >> 4) << 4)
        | ((q[..., 3, :] >> 4) << 6)
    ).reshape(*q.shape[:-3], 64)
    return jnp.concatenate([ql, qh], -1)


# --- Q8_K ---------------------------------------------------------------------------------


def decode_q8_k(b):
    d = jax.lax.bitcast_convert_type(b[..., 0:4], jnp.float32)[..., None]
    return d * jax.lax.bitcast_convert_type(b[..., 4:260], jnp.int8).astype(jnp.float32)


def encode_q8_k(x):
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


# --- IQ4_XS -------------------------------------------------------------------------------


def decode_iq4_xs(b):
    d = f16(b[..., 0:2])
    high = b[..., 2].astype(jnp.int32) | (b[..., 3].astype(jnp.int32) << 8)
    j = jnp.arange(8)
    low = (b[..., 4:8][..., j // 2].astype(jnp.int32) >> (4 * (j % 2))) & 15
    ls = low | (((high[..., None] >> (2 * j)) & 3) << 4)
    dl = d[..., None] * (ls - 32).astype(jnp.float32)
    qs = b[..., 8:].reshape(*b.shape[:-1], 8, 16)
    values = jnp.asarray(IQ4_NL_VALUES, jnp.int8)[unpack_nibbles_32(qs)].astype(jnp.float32)
    return (dl[..., None] * values).reshape(*b.shape[:-1], QK_K)


def encode_iq4_xs(x):
    """llama.cpp's `quantize_row_iq4_xs_impl` without an importance matrix: the IQ4_NL scale
    search per 32 elements (`search.iq4_scale`), then 6-bit sub-block scales under one fp16
    superblock scale."""
    xb = x.reshape(*x.shape[:-1], 8, 32)
    scales = search.iq4_scale(xb)  # [..., 8]
    first = jnp.argmax(jnp.abs(scales), axis=-1)
    max_scale = jnp.take_along_axis(scales, first[..., None], axis=-1)[..., 0]
    dsup = -max_scale / 32
    level = jnp.clip(nearest(safe_div(1.0, dsup)[..., None] * scales), -32, 31)
    dl = dsup[..., None] * level.astype(jnp.float32)
    idx = search.best_index_iq4(xb * safe_div(1.0, dl)[..., None])
    ls = (level + 32).astype(jnp.uint8)
    low = ls[..., 0::2] & 15 | ((ls[..., 1::2] & 15) << 4)
    high = jnp.sum((ls >> 4).astype(jnp.uint16) << (2 * jnp.arange(8, dtype=jnp.uint16)), -1)
    high = jax.lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.uint8)
    qs = pack_nibbles_32(idx).reshape(*x.shape[:-1], 128)
    return jnp.concatenate([f16_bytes(dsup), high, low, qs], -1)
