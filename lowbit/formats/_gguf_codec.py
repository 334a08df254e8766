"""GGUF (GGML) block encodings: exact decoders and encoders from float.

Every GGML quantization type stores a row as consecutive blocks of `block_size` elements in
`type_size` bytes, each block carrying its own scales. Decoders here reproduce llama.cpp's
dequantization bit for bit (same float32 operations in the same order, so the values equal
`gguf.quants.dequantize`); encoders are vectorised ports of llama.cpp's reference quantizers
(``quantize_row_*_ref``: the same scale searches, on every block at once). Values that already
are decoded blocks come back with the same values: Q8_K keeps such a block's own scale; where
some K-quant sub-block already decodes exactly from the search's result, the blocks are
re-fitted onto the grid the values lie on (Q2_K / Q4_K / Q5_K / Q6_K levels near the searched
ones or from the values' own steps, Q3_K's recovered outright); float weights never take that
path.

  type     block bytes  bits/value  layout (little-endian)
  Q8_0       32    34     8.5      d f16, q int8[32]                          x = d q
  Q4_0       32    18     4.5      d f16, nibbles[16]                          x = d (q - 8)
  Q4_1       32    20     5.0      d f16, m f16, nibbles[16]                   x = d q + m
  Q5_0       32    22     5.5      d f16, qh u32, nibbles[16]                  x = d (q - 16)
  Q5_1       32    24     6.0      d f16, m f16, qh u32, nibbles[16]           x = d q + m
  IQ4_NL     32    18     4.5      d f16, nibbles[16]                          x = d K[q]
  Q2_K      256    84     2.625    sc/m 4+4 bit [16], q 2-bit[64], d, dmin     x = d sc q - dmin m
  Q3_K      256   110     3.4375   hmask[32], q 2-bit[64], sc 6-bit[12], d     x = d (sc-32) q
  Q4_K      256   144     4.5      d, dmin, sc/m 6-bit[12], nibbles[128]       x = d sc q - dmin m
  Q5_K      256   176     5.5      d, dmin, sc/m 6-bit[12], qh[32], nib[128]   x = d sc q - dmin m
  Q6_K      256   210     6.5625   ql[128], qh[64], sc int8[16], d             x = d sc (q - 32)
  Q8_K      256   292     9.125    d f32, q int8[256], bsums i16[16]           x = d q
  TQ1_0     256    54     1.6875   base-3 trits[48 + 4], d                     x = d (t - 1)
  TQ2_0     256    66     2.0625   2-bit trits[64], d                          x = d (t - 1)

Sub-block sizes: Q2_K, Q3_K and Q6_K 16 elements, Q4_K and Q5_K 32. In the 4-bit 32-element
types byte `j` holds element `j` (low nibble) and `j + 16` (high); in the K types a 64-element
chunk's byte `l` holds element `l` (low) and `l + 32` (high).

Arrays: `decode(name, blocks)` takes ``uint8 [..., n_blocks * type_size]`` and returns
``float32 [..., n_blocks * block_size]``; `encode(name, x)` the reverse. Both are jitted JAX
functions (so a decoder also runs inside a traced `QArray.dequantize`), vectorised over every
block of a tensor.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

QK_K = 256
GROUP_MAX_EPS = 1e-15
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclasses.dataclass(frozen=True)
class BlockType:
    """One GGML block type: its name, block size and bytes per block."""

    name: str
    block_size: int
    type_size: int

    @property
    def bits_per_value(self) -> float:
        return self.type_size * 8 / self.block_size


BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        BlockType("Q8_0", 32, 34),
        BlockType("Q4_0", 32, 18),
        BlockType("Q4_1", 32, 20),
        BlockType("Q5_0", 32, 22),
        BlockType("Q5_1", 32, 24),
        BlockType("IQ4_NL", 32, 18),
        BlockType("Q2_K", QK_K, 84),
        BlockType("Q3_K", QK_K, 110),
        BlockType("Q4_K", QK_K, 144),
        BlockType("Q5_K", QK_K, 176),
        BlockType("Q6_K", QK_K, 210),
        BlockType("Q8_K", QK_K, 292),
        BlockType("TQ1_0", QK_K, 54),
        BlockType("TQ2_0", QK_K, 66),
    )
}
"""GGML type name -> `BlockType`, for every type this module encodes and decodes."""


def block_type(name: str) -> BlockType:
    """The `BlockType` called `name` (e.g. ``"Q4_K"``); ValueError listing the known ones."""
    found = BLOCK_TYPES.get(name)
    if found is None:
        raise ValueError(f"unknown GGUF block type {name!r}; accepted: {', '.join(BLOCK_TYPES)}")
    return found


# --- small helpers (jnp, traced) ---------------------------------------------------------------


def _f16(b: jax.Array) -> jax.Array:
    """uint8 [..., 2] little-endian half -> float32 [...]."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _f16_bytes(x: jax.Array) -> jax.Array:
    """float32 [...] -> uint8 [..., 2] of its nearest float16."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint8)


def _u8(x: jax.Array) -> jax.Array:
    return x.astype(jnp.uint8)


def _shifts(*values: int) -> jax.Array:
    return jnp.asarray(values, jnp.uint8)


def _reciprocal(x: jax.Array) -> jax.Array:
    """1 / x as one rounded division (the barrier keeps XLA from folding it into x's own
    division, which changes the last bit)."""
    return 1 / jax.lax.optimization_barrier(x)


def _nearest(x: jax.Array) -> jax.Array:
    """llama.cpp's `nearest_int`: round half to even (as int32)."""
    return jnp.round(x).astype(jnp.int32)


def _roundf(x: jax.Array) -> jax.Array:
    """C `roundf`: half away from zero."""
    return jnp.sign(x) * jnp.floor(jnp.abs(x) + 0.5)


def _signed_absmax(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(max |x|, the signed value where it is first reached) along the last axis."""
    idx = jnp.argmax(jnp.abs(x), axis=-1)
    value = jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    return jnp.abs(value), value


def _safe_div(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(b != 0, a / jnp.where(b != 0, b, 1), 0)


def _pack_2bit_128(q: jax.Array) -> jax.Array:
    """[..., 256] values < 4 -> [..., 64] bytes: chunk c's byte l holds elements
    128c + l + 32s at bits 2s (s = 0..3)."""
    q = _u8(q).reshape(*q.shape[:-1], 2, 4, 32)
    packed = q[..., 0, :] | (q[..., 1, :] << 2) | (q[..., 2, :] << 4) | (q[..., 3, :] << 6)
    return packed.reshape(*q.shape[:-3], 64)


def _unpack_2bit_128(qs: jax.Array) -> jax.Array:
    """Inverse of `_pack_2bit_128`: [..., 64] -> [..., 256] uint8."""
    q = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> _shifts(0, 2, 4, 6)[:, None]
    return (q & 3).reshape(*qs.shape[:-1], QK_K)


def _pack_nibbles_64(q: jax.Array) -> jax.Array:
    """[..., 256] values < 16 -> [..., 128]: chunk c's byte l holds 64c + l (low), + 32 (high)."""
    q = _u8(q).reshape(*q.shape[:-1], 4, 2, 32)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:-3], 128)


def _unpack_nibbles_64(qs: jax.Array) -> jax.Array:
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> _shifts(0, 4)[:, None]
    return (q & 15).reshape(*qs.shape[:-1], QK_K)


def _pack_nibbles_32(q: jax.Array) -> jax.Array:
    """[..., 32] values < 16 -> [..., 16]: byte j holds element j (low), j + 16 (high)."""
    q = _u8(q)
    return q[..., :16] | (q[..., 16:] << 4)


def _unpack_nibbles_32(qs: jax.Array) -> jax.Array:
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales_unpack(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K's 12 scale bytes -> (scales, mins) [..., 8] uint8 (6 bits each)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 63, (md & 15) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scales_pack(ls: jax.Array, lm: jax.Array) -> jax.Array:
    """Inverse of `_k_scales_unpack`: scales, mins [..., 8] (< 64) -> [..., 12] bytes."""
    ls, lm = _u8(ls), _u8(lm)
    lo = ls[..., :4] | ((ls[..., 4:] >> 4) << 6)
    mid = lm[..., :4] | ((lm[..., 4:] >> 4) << 6)
    hi = (ls[..., 4:] & 15) | ((lm[..., 4:] & 15) << 4)
    return jnp.concatenate([lo, mid, hi], axis=-1)


def _q3_scales_unpack(s: jax.Array) -> jax.Array:
    """Q3_K's 12 scale bytes -> [..., 16] uint8 6-bit scales (stored + 32)."""
    low = (s[..., :8][..., None, :] >> _shifts(0, 4)[:, None]).reshape(*s.shape[:-1], 16)
    high = (s[..., 8:][..., None, :] >> _shifts(0, 2, 4, 6)[:, None]).reshape(*s.shape[:-1], 16)
    return (low & 15) | ((high & 3) << 4)


def _q3_scales_pack(l6: jax.Array) -> jax.Array:
    l6 = _u8(l6)
    low = (l6[..., :8] & 15) | ((l6[..., 8:] & 15) << 4)
    h = (l6 >> 4).reshape(*l6.shape[:-1], 4, 4)
    high = h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)
    return jnp.concatenate([low, high], axis=-1)


# --- decoders: blocks [..., nb, type_size] -> [..., nb, block_size] float32 ------------------


def _dec_q8_0(b):
    return _f16(b[..., 0:2])[..., None] * jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8)


def _dec_q4_0(b):
    q = _unpack_nibbles_32(b[..., 2:]).astype(jnp.int8) - jnp.int8(8)
    return _f16(b[..., 0:2])[..., None] * q.astype(jnp.float32)


def _dec_q4_1(b):
    q = _unpack_nibbles_32(b[..., 4:]).astype(jnp.float32)
    return _f16(b[..., 0:2])[..., None] * q + _f16(b[..., 2:4])[..., None]


def _q5_high(qh: jax.Array) -> jax.Array:
    """4 bytes -> [..., 32] bits (element j's fifth bit is bit j of the little-endian u32)."""
    bits = qh[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)
    return (bits & 1).reshape(*qh.shape[:-1], 32)


def _dec_q5_0(b):
    q = _unpack_nibbles_32(b[..., 6:]) | (_q5_high(b[..., 2:6]) << 4)
    q = q.astype(jnp.int8) - jnp.int8(16)
    return _f16(b[..., 0:2])[..., None] * q.astype(jnp.float32)


def _dec_q5_1(b):
    q = (_unpack_nibbles_32(b[..., 8:]) | (_q5_high(b[..., 4:8]) << 4)).astype(jnp.float32)
    return _f16(b[..., 0:2])[..., None] * q + _f16(b[..., 2:4])[..., None]


def _dec_iq4_nl(b):
    values = jnp.asarray(IQ4_NL_VALUES, jnp.int8)[_unpack_nibbles_32(b[..., 2:])]
    return _f16(b[..., 0:2])[..., None] * values.astype(jnp.float32)


def _dec_q2_k(b):
    sc, qs = b[..., 0:16], b[..., 16:80]
    d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    dl = (d * (sc & 15).astype(jnp.float32))[..., None]
    ml = (dmin * (sc >> 4).astype(jnp.float32))[..., None]
    q = _unpack_2bit_128(qs).reshape(*b.shape[:-1], 16, 16).astype(jnp.float32)
    return (dl * q - ml).reshape(*b.shape[:-1], QK_K)


def _dec_q3_k(b):
    hmask, qs = b[..., 0:32], b[..., 32:96]
    d = _f16(b[..., 108:110])[..., None]
    sc = (_q3_scales_unpack(b[..., 96:108]).astype(jnp.int8) - jnp.int8(32)).astype(jnp.float32)
    dl = (d * sc)[..., None]
    ql = _unpack_2bit_128(qs)
    qh = (hmask[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1
    qh = qh.reshape(*b.shape[:-1], QK_K) ^ 1
    q = ql.astype(jnp.int8) - (qh << 2).astype(jnp.int8)
    q = q.astype(jnp.float32).reshape(*b.shape[:-1], 16, 16)
    return (dl * q).reshape(*b.shape[:-1], QK_K)


def _k_min_decode(b, q):
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales_unpack(b[..., 4:16])
    dl = (d * sc.astype(jnp.float32))[..., None]
    ml = (dmin * mn.astype(jnp.float32))[..., None]
    q = q.reshape(*b.shape[:-1], 8, 32).astype(jnp.float32)
    return (dl * q - ml).reshape(*b.shape[:-1], QK_K)


def _dec_q4_k(b):
    return _k_min_decode(b, _unpack_nibbles_64(b[..., 16:144]))


def _q5k_high(qh):
    bits = (qh[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1
    return bits.reshape(*qh.shape[:-1], QK_K)


def _dec_q5_k(b):
    q = _unpack_nibbles_64(b[..., 48:176]) | (_q5k_high(b[..., 16:48]) << 4)
    return _k_min_decode(b, q)


def _q6k_codes(b):
    """Q6_K's 6-bit codes [..., 256] uint8 (value + 32)."""
    ql, qh = b[..., 0:128], b[..., 128:192]
    low = ql.reshape(*b.shape[:-1], 2, 1, 64) >> _shifts(0, 4)[:, None]
    low = (low & 15).reshape(*b.shape[:-1], QK_K)
    high = qh.reshape(*b.shape[:-1], 2, 1, 32) >> _shifts(0, 2, 4, 6)[:, None]
    high = (high & 3).reshape(*b.shape[:-1], QK_K)
    return low | (high << 4)


def _dec_q6_k(b):
    sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    dl = (_f16(b[..., 208:210])[..., None] * sc)[..., None]
    q = (_q6k_codes(b).astype(jnp.int8) - jnp.int8(32)).astype(jnp.float32)
    return (dl * q.reshape(*b.shape[:-1], 16, 16)).reshape(*b.shape[:-1], QK_K)


def _dec_q8_k(b):
    d = jax.lax.bitcast_convert_type(b[..., 0:4], jnp.float32)[..., None]
    return d * jax.lax.bitcast_convert_type(b[..., 4:260], jnp.int8).astype(jnp.float32)


_POW3 = (1, 3, 9, 27, 81)


def _tq1_trits(b):
    qs, qh = b[..., 0:48], b[..., 48:52]

    def spread(v, k):
        out = v[..., None, :] * jnp.asarray(_POW3[:k], jnp.uint8)[:, None]  # wraps mod 256
        return out.reshape(*v.shape[:-1], -1)

    v = jnp.concatenate([spread(qs[..., :32], 5), spread(qs[..., 32:], 5), spread(qh, 4)], -1)
    return ((v.astype(jnp.uint16) * 3) >> 8).astype(jnp.int8) - jnp.int8(1)


def _dec_tq1_0(b):
    return _f16(b[..., 52:54])[..., None] * _tq1_trits(b).astype(jnp.float32)


def _dec_tq2_0(b):
    q = _unpack_2bit_128(b[..., 0:64]).astype(jnp.int8) - jnp.int8(1)
    return _f16(b[..., 64:66])[..., None] * q.astype(jnp.float32)


_DECODERS = {
    "Q8_0": _dec_q8_0,
    "Q4_0": _dec_q4_0,
    "Q4_1": _dec_q4_1,
    "Q5_0": _dec_q5_0,
    "Q5_1": _dec_q5_1,
    "IQ4_NL": _dec_iq4_nl,
    "Q2_K": _dec_q2_k,
    "Q3_K": _dec_q3_k,
    "Q4_K": _dec_q4_k,
    "Q5_K": _dec_q5_k,
    "Q6_K": _dec_q6_k,
    "Q8_K": _dec_q8_k,
    "TQ1_0": _dec_tq1_0,
    "TQ2_0": _dec_tq2_0,
}


def decode_traced(name: str, raw: jax.Array) -> jax.Array:
    """`decode` without its own jit (for use inside a traced function)."""
    t = block_type(name)
    raw = jnp.asarray(raw)
    if raw.dtype != jnp.uint8 or raw.shape[-1] % t.type_size:
        raise ValueError(
            f"{name} blocks must be uint8 with a last axis that is a multiple of "
            f"{t.type_size} bytes, got {raw.dtype} {tuple(raw.shape)}"
        )
    blocks = raw.reshape(*raw.shape[:-1], -1, t.type_size)
    values = _DECODERS[name](blocks).astype(jnp.float32)
    return values.reshape(*raw.shape[:-1], -1)


@functools.partial(jax.jit, static_argnums=0)
def _decode_jit(name, raw):
    return decode_traced(name, raw)


def decode(name: str, raw: jax.Array | np.ndarray) -> np.ndarray:
    """GGUF blocks to float32, bit-identical to llama.cpp's dequantization.

    Args:
      name: GGML type name, e.g. ``"Q4_K"``.
      raw: uint8 [..., n_blocks * type_size].
    Returns:
      float32 [..., n_blocks * block_size] (NumPy).
    """
    block_type(name)
    return np.asarray(_decode_jit(name, jnp.asarray(raw)))


# --- encoders: x [..., nb, block_size] float32 -> [..., nb, type_size] uint8 -----------------


def _enc_q8_0(x):
    amax, _ = _signed_absmax(x)
    d = amax / 127
    q = _roundf(x * _safe_div(1.0, d)[..., None]).astype(jnp.int8)
    return jnp.concatenate([_f16_bytes(d), jax.lax.bitcast_convert_type(q, jnp.uint8)], -1)


def _enc_q4_0(x):
    _, mx = _signed_absmax(x)
    d = mx / -8
    x0 = x * _safe_div(1.0, d)[..., None]
    q = jnp.minimum(15, (x0 + 8.5).astype(jnp.int8))
    return jnp.concatenate([_f16_bytes(d), _pack_nibbles_32(q)], -1)


def _enc_q4_1(x):
    lo, hi = x.min(-1), x.max(-1)
    d = (hi - lo) / 15
    x0 = (x - lo[..., None]) * _safe_div(1.0, d)[..., None]
    q = jnp.minimum(15, (x0 + 0.5).astype(jnp.int8))
    return jnp.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles_32(q)], -1)


def _q5_high_bytes(q):
    bits = ((_u8(q) >> 4) & 1).reshape(*q.shape[:-1], 4, 8)
    return jnp.sum(bits << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def _enc_q5_0(x):
    _, mx = _signed_absmax(x)
    d = mx / -16
    x0 = x * _safe_div(1.0, d)[..., None]
    q = jnp.minimum(31, (x0 + 16.5).astype(jnp.int8))
    return jnp.concatenate([_f16_bytes(d), _q5_high_bytes(q), _pack_nibbles_32(q & 15)], -1)


def _enc_q5_1(x):
    lo, hi = x.min(-1), x.max(-1)
    d = (hi - lo) / 31
    x0 = (x - lo[..., None]) * _safe_div(1.0, d)[..., None]
    q = jnp.minimum(31, (x0 + 0.5).astype(jnp.int8))
    parts = [_f16_bytes(d), _f16_bytes(lo), _q5_high_bytes(q), _pack_nibbles_32(q & 15)]
    return jnp.concatenate(parts, -1)


def _best_index_iq4(x):
    """llama.cpp's `best_index_int8` on the IQ4_NL values, elementwise."""
    values = jnp.asarray(IQ4_NL_VALUES, jnp.float32)
    mu = jnp.clip(jnp.searchsorted(values, x, side="right"), 1, 15)
    lower, upper = values[mu - 1], values[mu]
    idx = jnp.where(x - lower < upper - x, mu - 1, mu)
    return jnp.where(x <= values[0], 0, jnp.where(x >= values[15], 15, idx))


def _enc_iq4_nl(x, ntry=7):
    values = jnp.asarray(IQ4_NL_VALUES, jnp.float32)
    w = x * x
    amax, mx = _signed_absmax(x)
    flat = amax < GROUP_MAX_EPS
    mx_safe = jnp.where(flat, 1.0, mx)
    d = -mx_safe / values[0]
    q = values[_best_index_iq4(x * (1 / d)[..., None])]
    sumqx, sumq2 = (w * q * x).sum(-1), (w * q * q).sum(-1)
    d = _safe_div(sumqx, sumq2)
    best = d * sumqx
    # llama.cpp's candidates, plus one mapping the extreme value onto the top level (113):
    # it can only lower the error and makes decoded blocks re-encode to themselves.
    # A tie with it (a constant block fits every candidate exactly) goes to the extra one:
    # which of equal scores wins is otherwise float rounding, which differs across XLA builds.
    candidates = [(itry + values[0]) / mx_safe for itry in range(-ntry, ntry + 1)]
    for i, inv in enumerate([*candidates, values[15] / mx_safe]):
        q = values[_best_index_iq4(x * inv[..., None])]
        sqx, sq2 = (w * q * x).sum(-1), (w * q * q).sum(-1)
        slack = 1 - 1e-6 if i == len(candidates) else 1.0
        better = (sq2 > 0) & (sqx * sqx > best * sq2 * slack)
        d = jnp.where(better, _safe_div(sqx, sq2), d)
        best = jnp.where(better, d * sqx, best)
    d = jnp.where(flat, 0.0, d)
    idx = _best_index_iq4(x * _safe_div(1.0, d)[..., None])
    return jnp.concatenate([_f16_bytes(d), _pack_nibbles_32(idx)], -1)


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
    q = jnp.clip(_nearest(iscale[..., None] * (x - lo[..., None])), 0, nmax).astype(jnp.float32)
    best = err(scale, lo, q)
    mn = lo
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * step + nmax) / span
        ql = jnp.clip(_nearest(iscale[..., None] * (x - lo[..., None])), 0, nmax)
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
        this_scale = jnp.where(clamp, _safe_div(sum_xl, sum_l2), this_scale)
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
    amax, mx = _signed_absmax(x)
    flat = amax < GROUP_MAX_EPS
    mx = jnp.where(flat, 1.0, mx)
    w = x * x

    def try_scale(iscale):
        q = jnp.clip(_nearest(iscale[..., None] * x), -nmax, nmax - 1).astype(jnp.float32)
        return q, (w * x * q).sum(-1), (w * q * q).sum(-1)

    q, sumlx, suml2 = try_scale(-nmax / mx)
    scale = _safe_div(sumlx, suml2)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        ql, slx, sl2 = try_scale(-(nmax + 0.1 * step) / mx)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        q = jnp.where(better[..., None], ql, q)
        scale = jnp.where(better, _safe_div(slx, sl2), scale)
        best = jnp.where(better, scale * slx, best)
    return jnp.where(flat, 0.0, scale), jnp.where(flat[..., None], 0.0, q + nmax)


def _make_q3(x, nmax=4, tries=5):
    """llama.cpp's `make_q3_quants(do_rmse=true)` per group of 16: (scale, codes + nmax)."""
    amax, mx = _signed_absmax(x)
    flat = amax < GROUP_MAX_EPS
    mx = jnp.where(flat, 1.0, mx)
    q = jnp.clip(_nearest((-nmax / mx)[..., None] * x), -nmax, nmax - 1).astype(jnp.float32)
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
        new = jnp.clip(_nearest(xi * _safe_div(sl2, slx)), -nmax, nmax - 1).astype(jnp.float32)
        slx2, sl22 = slx + wi * xi * new, sl2 + wi * new * new
        take = (slx > 0) & (new != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
        li = jnp.where(take, new, li)
        q = jax.lax.dynamic_update_index_in_dim(q, li, i, -1)
        return q, jnp.where(take, slx2, sumlx), jnp.where(take, sl22, suml2)

    q, sumlx, suml2 = jax.lax.fori_loop(0, tries * n, step, (q, sumlx, suml2))
    scale = _safe_div(sumlx, suml2)
    return jnp.where(flat, 0.0, scale), jnp.where(flat[..., None], 0.0, q + nmax)


def _exact_sub_blocks(xs, d, dmin, ls, lm, q, codes, levels, reach, skip=None):
    """K-quant sub-blocks re-fitted to decode exactly to `xs` where they can.

    When `xs` already are decoded values, the reference search usually lands on the same
    super-scales `d`, `dmin` but can miss a sub-block's scale or min level (1 decoded Q5_K block
    in 16, by one to five levels; 1 real Q6_K block in 100, by one). Scale levels within
    `reach` of the searched one are tried, nearest first, with the searched min level, its
    neighbours and the levels that put the sub-block's smallest value at code 0, 1 or 2; the
    first pair that reproduces every value exactly is kept.

    Args:
      xs: [..., n_sub, sub] values, ``x = d ls q - dmin lm``; d, dmin: [...] super-scales (as
        decoded from float16; `dmin` zero for the types without mins); ls, lm: [..., n_sub]
        searched levels; q: [..., n_sub, sub] codes; codes, levels: (lowest, highest) code and
        scale level; reach: largest scale change tried; skip: [...] blocks to leave as they
        are (reported done).
    Returns:
      (ls, lm, q) with the exact fits substituted, and done [..., n_sub]: which are exact.
    """
    ls, lm = ls.astype(jnp.int32), lm.astype(jnp.int32)
    x_min = xs.min(-1)
    inv_dmin = _safe_div(1.0, dmin)[..., None]

    def attempt(state):
        k, out_ls, out_lm, out_q, done = state
        # Offsets 0, -1, +1, -2, +2, ...
        ls2 = ls + jnp.where(k % 2 == 1, -1, 1) * ((k + 1) // 2)
        dl = d[..., None] * ls2.astype(jnp.float32)
        # The min level that gives the smallest value code 0, 1 or 2: x = dl q - ml.
        at_code = [_nearest(inv_dmin * (dl * c - x_min)) for c in range(3)]
        for lm_try in (lm, lm - 1, lm + 1, *at_code):
            lm2 = jnp.clip(lm_try, 0, levels[1])
            ml = dmin[..., None] * lm2.astype(jnp.float32)
            q2 = _nearest((xs + ml[..., None]) / jnp.where(dl == 0, 1, dl)[..., None])
            q2 = jnp.where((dl == 0)[..., None], q, jnp.clip(q2, *codes).astype(jnp.float32))
            ok = jnp.all(dl[..., None] * q2 - ml[..., None] == xs, axis=-1)
            ok &= (ls2 >= levels[0]) & (ls2 <= levels[1]) & ~done
            out_ls, out_lm = jnp.where(ok, ls2, out_ls), jnp.where(ok, lm2, out_lm)
            out_q = jnp.where(ok[..., None], q2, out_q)
            done |= ok
        return k + 1, out_ls, out_lm, out_q, done

    def more(state):
        return (state[0] < 2 * reach + 1) & ~jnp.all(state[-1])

    done = jnp.zeros(ls.shape, bool)
    if skip is not None:
        done = jnp.broadcast_to(skip[..., None], ls.shape)
    return jax.lax.while_loop(more, attempt, (0, ls, lm, q, done))[1:]


def _exact_k_min(xs, d16, dmin16, ls, lm, q, nmax, smax, codes=None):
    """Q2_K / Q4_K / Q5_K blocks re-fitted to decode exactly to `xs` where they can.

    First around the searched super-scales (`_exact_sub_blocks`); where that leaves a
    sub-block inexact, around super-scales recovered from the values the way the reference
    sets them: the sub-blocks of largest scale and largest min have level ``smax``, so the
    steepest line through a sub-block's codes and values is ``smax`` times `d`, the largest
    offset ``smax`` times `dmin`. (The search misses them, by a few float16 steps or by a
    sub-block's whole level, on 1 decoded Q5_K block in 100 and 1 Q2_K block in 200; on 1
    real Q2_K block in 1500 it lands on 2/3 of `d`, fooled by an outlier sub-block that uses
    only codes 0 and 2.)

    Args:
      xs: [..., n_sub, sub] values; d16, dmin16: [..., 2] float16 bytes; ls, lm: [..., n_sub]
      levels; q: [..., n_sub, sub] codes; nmax: largest code; smax: largest level;
      codes: for `_needs_refit` to count distinct values against (Q2_K: its 4 codes in
      sub-blocks of 16; Q4_K blocks re-encode without it, and the sort costs its float
      encoding 10%).
    Returns:
      (d16, dmin16, ls, lm, q).
    """
    d, dmin = _f16(d16), _f16(dmin16)
    ls, lm = ls.astype(jnp.int32), lm.astype(jnp.int32)
    searched = (d16, dmin16, ls, lm, q)
    dl = d[..., None] * ls.astype(jnp.float32)
    ml = dmin[..., None] * lm.astype(jnp.float32)
    hit = jnp.all(dl[..., None] * q - ml[..., None] == xs, axis=-1)
    return jax.lax.cond(
        _needs_refit(xs, hit, codes),
        lambda: _refit_k_min(xs, *searched, nmax, smax),
        lambda: searched,
    )


def _needs_refit(xs: jax.Array, hit: jax.Array, codes: int | None = None) -> jax.Array:
    """Whether the exact refits should run on these blocks: the values look decoded, and some
    varied sub-block of `xs` [..., n_sub, sub] does not decode exactly from the search's
    result (`hit` [..., n_sub]). Decoded values: some varied sub-block already decodes
    exactly, or (given `codes`, a number of codes below a sub-block's size) every sub-block
    holds at most `codes` distinct values: a search that lands on the wrong super-scale (2/3
    of the right one, for a Q2_K outlier block) leaves no sub-block exact. Float weights look
    decoded by neither test; decoded blocks the search gives back need no refit. The refits
    (a few times the search's cost) run on neither."""
    varied = xs.max(-1) > xs.min(-1)
    decoded = jnp.any(hit & varied)
    if codes is not None:
        distinct = 1 + jnp.sum(jnp.diff(jnp.sort(xs, axis=-1), axis=-1) > 0, axis=-1)
        decoded |= jnp.any(varied) & jnp.all(distinct <= codes)
    return decoded & ~jnp.all(hit | ~varied)


def _smallest_gap(xs: jax.Array) -> jax.Array:
    """[..., n] -> [...]: the smallest positive difference between two values (0 if all are
    equal): a decoded sub-block's step, when two of its values sit on neighbouring codes."""
    gaps = jnp.diff(jnp.sort(xs, axis=-1), axis=-1)
    gap = jnp.min(jnp.where(gaps > 0, gaps, jnp.inf), axis=-1)
    return jnp.where(jnp.isfinite(gap), gap, 0.0)


def _per_block(use: jax.Array, new: tuple, old: tuple) -> tuple:
    """Fields of `new` where `use` [...] is set, of `old` elsewhere (fields [..., *rest])."""
    return tuple(
        jnp.where(use.reshape(use.shape + (1,) * (a.ndim - use.ndim)), a, b)
        for a, b in zip(new, old, strict=True)
    )


def _refit_k_min(xs, d16, dmin16, ls, lm, q, nmax, smax):
    """`_exact_k_min`'s refits, on every block."""

    def fit(d, dmin, ls, lm, skip=None):
        return _exact_sub_blocks(xs, d, dmin, ls, lm, q, (0, nmax), (0, smax), 8, skip)

    d, dmin = _f16(d16), _f16(dmin16)
    best = (d16, dmin16, *fit(d, dmin, ls, lm))
    found = jnp.all(best[-1], axis=-1)
    # Lines x = slope q - offset through each sub-block, from the searched levels' codes or
    # from codes that count the smallest gap between two values from the smallest value.
    starts = (
        (d[..., None] * ls.astype(jnp.float32), dmin[..., None] * lm.astype(jnp.float32)),
        (_smallest_gap(xs), -xs.min(-1)),
    )
    for slope, offset in starts:
        for _ in range(2):
            codes = _nearest((xs + offset[..., None]) / jnp.where(slope == 0, 1, slope)[..., None])
            codes = jnp.clip(codes, 0, nmax).astype(jnp.float32)
            q_mean, x_mean = codes.mean(-1), xs.mean(-1)
            centred = codes - q_mean[..., None]
            slope = _safe_div((centred * xs).sum(-1), (centred * centred).sum(-1))
            offset = slope * q_mean - x_mean
        dmin_c16 = _f16_bytes(jnp.maximum(offset.max(-1), 0.0) / smax)
        dmin_c = _f16(dmin_c16)
        lm_c = jnp.clip(_nearest(_safe_div(1.0, dmin_c)[..., None] * offset), 0, smax)
        # A sub-block that uses only every other (or third) code, like an outlier at level
        # smax holding codes 0 and 2, has a line `stride` times too steep: try d / 2, d / 3.
        for stride in (1, 2, 3):
            d_c16 = _f16_bytes(slope.max(-1) / (smax * stride))
            d_c = _f16(d_c16)
            ls_c = jnp.clip(_nearest(_safe_div(1.0, d_c)[..., None] * slope), 0, smax)
            candidate = (d_c16, dmin_c16, *fit(d_c, dmin_c, ls_c, lm_c, skip=found))
            use = jnp.all(candidate[-1], axis=-1) & ~found
            best = _per_block(use, candidate, best)
            found |= use
    return best[:5]


def _k_min_encode(x, nmax, rmin, nstep):
    """Q4_K / Q5_K: (d, dmin bytes, 12 scale bytes, codes [..., 256] in [0, nmax])."""
    xs = x.reshape(*x.shape[:-1], 8, 32)
    av_x = jnp.sqrt((xs * xs).sum(-1) / 32)
    weights = av_x[..., None] + jnp.abs(xs)
    scales, mins, q = _make_qkx2(xs, weights, nmax, rmin, 0.1, nstep, False)
    max_scale = jnp.maximum(scales.max(-1), 0.0)
    max_min = jnp.maximum(mins.max(-1), 0.0)
    inv_scale = _safe_div(63.0, max_scale)
    inv_min = _safe_div(63.0, max_min)
    ls = jnp.clip(_nearest(inv_scale[..., None] * scales), 0, 63)
    lm = jnp.clip(_nearest(inv_min[..., None] * mins), 0, 63)
    d16, dmin16 = _f16_bytes(max_scale / 63), _f16_bytes(max_min / 63)
    dl = _f16(d16)[..., None] * ls.astype(jnp.float32)
    ml = _f16(dmin16)[..., None] * lm.astype(jnp.float32)
    new = jnp.clip(_nearest((xs + ml[..., None]) / jnp.where(dl == 0, 1, dl)[..., None]), 0, nmax)
    q = jnp.where((dl == 0)[..., None], q, new.astype(jnp.float32))
    d16, dmin16, ls, lm, q = _exact_k_min(xs, d16, dmin16, ls, lm, q, nmax, 63)
    header = [d16, dmin16, _k_scales_pack(ls, lm)]
    return header, q.reshape(*x.shape[:-1], QK_K).astype(jnp.uint8)


def _enc_q4_k(x):
    header, q = _k_min_encode(x, 15, -1.0, 20)
    return jnp.concatenate([*header, _pack_nibbles_64(q)], -1)


def _enc_q5_k(x):
    header, q = _k_min_encode(x, 31, -0.5, 15)
    high = ((q >> 4) & 1).reshape(*q.shape[:-1], 8, 32)
    qh = jnp.sum(high << jnp.arange(8, dtype=jnp.uint8)[:, None], axis=-2, dtype=jnp.uint8)
    return jnp.concatenate([*header, qh, _pack_nibbles_64(q & 15)], -1)


def _refit_q6_k(xs, d16, sc, q):
    """Q6_K blocks re-fitted to decode exactly to `xs` (decoded values) where they can.

    Scales within 8 levels of the searched ones, of either sign (the search can turn a
    sub-block of scale -128 into +127), around the searched `d` and, where that leaves a
    sub-block inexact, around the `d` that gives the steepest sub-block scale -128, as the
    reference does. (1 real Q6_K block in 5000 needed that.)

    Args:
      xs: [..., 16, 16] values; d16: [..., 2] float16 bytes; sc: [..., 16] int32 scales;
      q: [..., 16, 16] codes + 32.
    Returns:
      (d16, sc, q).
    """
    zero = jnp.zeros(xs.shape[:-2], jnp.float32)

    def fit(d, sc, skip=None):
        tries = [
            _exact_sub_blocks(
                xs, d, zero, s, jnp.zeros_like(s), q - 32, (-32, 31), (-128, 127), 8, skip
            )
            for s in (sc, -sc)
        ]
        use = ~tries[0][3] & tries[1][3]
        sc_fit = jnp.where(use, tries[1][0], tries[0][0])
        q_fit = jnp.where(use[..., None], tries[1][2], tries[0][2])
        return sc_fit, q_fit + 32, tries[0][3] | tries[1][3]

    best = (d16, *fit(_f16(d16), sc))
    # Lines x = slope q through each sub-block, codes counting the smallest gap between two
    # values (the searched scales' codes lead straight back to the searched `d`).
    slope = _smallest_gap(xs)
    for _ in range(2):
        codes = jnp.clip(_nearest(xs / jnp.where(slope == 0, 1, slope)[..., None]), -32, 31)
        codes = codes.astype(jnp.float32)
        slope = _safe_div((codes * xs).sum(-1), (codes * codes).sum(-1))
    steepest = jnp.take_along_axis(slope, jnp.argmax(jnp.abs(slope), -1)[..., None], -1)[..., 0]
    d_c16 = _f16_bytes(steepest / -128)
    d_c = _f16(d_c16)
    sc_c = jnp.clip(_nearest(_safe_div(1.0, d_c)[..., None] * slope), -128, 127)
    found = jnp.all(best[-1], axis=-1)
    candidate = (d_c16, *fit(d_c, sc_c, skip=found))
    use = jnp.all(candidate[-1], axis=-1) & ~found
    return _per_block(use, candidate[:3], best[:3])


def _enc_q6_k(x):
    xs = x.reshape(*x.shape[:-1], 16, 16)
    scales, q = _make_qx(xs, 32)
    amax, max_scale = _signed_absmax(scales)
    flat = amax < GROUP_MAX_EPS
    iscale = -128.0 / jnp.where(flat, 1.0, max_scale)
    d16 = _f16_bytes(jnp.where(flat, 0.0, _reciprocal(iscale)))
    sc = jnp.minimum(127, _nearest(iscale[..., None] * scales))
    sc = jnp.where(flat[..., None], 0, sc)
    dl = _f16(d16)[..., None] * sc.astype(jnp.float32)
    new = jnp.clip(_nearest(xs / jnp.where(dl == 0, 1, dl)[..., None]), -32, 31) + 32
    q = jnp.where((dl == 0)[..., None], q, new.astype(jnp.float32))
    q = jnp.where(flat[..., None, None], 0.0, q)
    hit = jnp.all(dl[..., None] * (q - 32) == xs, axis=-1)

    d16, sc, q = jax.lax.cond(
        _needs_refit(xs, hit),
        lambda: _refit_q6_k(xs, d16, sc.astype(jnp.int32), q),
        lambda: (d16, sc.astype(jnp.int32), q),
    )
    q = _u8(q.reshape(*x.shape[:-1], QK_K)).reshape(*x.shape[:-1], 2, 4, 32)
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
    ls = jnp.clip(_nearest(_safe_div(15.0, max_scale)[..., None] * scales), 0, 15)
    lm = jnp.clip(_nearest(_safe_div(15.0, max_min)[..., None] * mins), 0, 15)
    d16, dmin16 = _f16_bytes(max_scale / 15), _f16_bytes(max_min / 15)
    dl = _f16(d16)[..., None] * ls.astype(jnp.float32)
    ml = _f16(dmin16)[..., None] * lm.astype(jnp.float32)
    new = jnp.clip(_nearest((xs + ml[..., None]) / jnp.where(dl == 0, 1, dl)[..., None]), 0, 3)
    q = jnp.where((dl == 0)[..., None], q, new.astype(jnp.float32))
    d16, dmin16, ls, lm, q = _exact_k_min(xs, d16, dmin16, ls, lm, q, 3, 15, codes=4)
    qs = _pack_2bit_128(q.reshape(*x.shape[:-1], QK_K))
    return jnp.concatenate([_u8(ls | (lm << 4)), qs, d16, dmin16], -1)


def _enc_q3_k(x):
    xs = x.reshape(*x.shape[:-1], 16, 16)
    scales, q = _make_q3(xs)
    amax, max_scale = _signed_absmax(scales)
    has = max_scale != 0
    iscale = -32.0 / jnp.where(has, max_scale, 1.0)
    l6 = jnp.clip(_nearest(iscale[..., None] * scales), -32, 31) + 32
    l6 = jnp.where(has[..., None], l6, 0)
    d16 = _f16_bytes(jnp.where(has, _reciprocal(iscale), 0.0))
    dl = _f16(d16)[..., None] * (l6 - 32).astype(jnp.float32)
    new = jnp.clip(_nearest(xs / jnp.where(dl == 0, 1, dl)[..., None]), -4, 3) + 4
    q = jnp.where((dl == 0)[..., None], q, new.astype(jnp.float32))
    searched = _pack_q3_k(d16, l6, q)
    hit = jnp.all(dl[..., None] * (q - 4) == xs, axis=-1)

    def lattice():
        found, exact = _q3_k_lattice(x)
        return jnp.where(found[..., None], exact, searched)

    return jax.lax.cond(_needs_refit(xs, hit), lattice, lambda: searched)


def _pack_q3_k(d16, l6, q):
    """d16 [..., 2] bytes, l6 [..., 16] (scale + 32), q [..., 16, 16] codes 0..7 -> blocks."""
    q = _u8(q.reshape(*q.shape[:-2], QK_K))
    high = (q > 3).reshape(*q.shape[:-1], 8, 32).astype(jnp.uint8)
    hmask = jnp.sum(high << jnp.arange(8, dtype=jnp.uint8)[:, None], axis=-2, dtype=jnp.uint8)
    q = jnp.where(q > 3, q - 4, q)
    return jnp.concatenate([hmask, _pack_2bit_128(q), _q3_scales_pack(l6), d16], -1)


def _q3_k_lattice(x):
    """The Q3_K block whose decoded values are exactly `x`, when there is one.

    The scale search does not find the grid that decoded values already lie on (about half of
    decoded Q3_K blocks came back different), so it is recovered directly. A Q3_K value is
    ``d * sc * q`` with every product exact in float32 (11 + 6 + 3 significant bits), so
    ``x / d`` is an integer in [-128, 128] for every element when `d` is right. The reference
    quantizer gives the sub-block of largest scale ``sc = -32`` and maps a sub-block's largest
    value to a negative code (-4, or -3 after its refinement): those name the candidates for
    `d`, tried on the sub-blocks in order of their largest values. Each sub-block's scale is
    then the smallest one (sign first: its largest value's code negative) that leaves every
    code an integer in [-4, 3].

    Args:
      x: [..., 256] float32 values.
    Returns:
      (found [...] bool: the blocks decode exactly to `x`, blocks [..., 110] uint8).
    """
    xs = x.reshape(*x.shape[:-1], 16, 16)
    peak = jnp.max(jnp.abs(xs), axis=-1)
    # The sign of each sub-block's first largest value. (Decoding can tie the reference's
    # largest value with one of the other sign; neither the first, nor the larger or smaller
    # group of tied values names it right much more than half the time.)
    sign = jnp.where(_signed_absmax(xs)[1] < 0, -1.0, 1.0)
    order = jnp.argsort(-peak, axis=-1)

    def candidate(k, state):
        d, found = state
        j = order[..., k, None]
        top = jnp.take_along_axis(peak, j, axis=-1)[..., 0]
        sub = jnp.take_along_axis(xs, j[..., None], axis=-2)[..., 0, :]
        top_sign = jnp.take_along_axis(sign, j, axis=-1)[..., 0]
        for flip, code in ((1, 4), (1, 3), (-1, 3)):
            # Sub-block j has sc = -32 and its peak elements (of sign top_sign * flip) code
            # -code: x = d * -32 * -code.
            c = flip * top_sign * top / (32.0 * code)
            safe = jnp.where(c == 0, 1, c)[..., None]
            # round(x / c) * c == x, not x / c == round(x / c): XLA divides by a broadcast
            # as a multiply by its reciprocal, which is not exact.
            n = jnp.round(x / safe)
            n_sub = jnp.round(sub / safe)
            ok = (c != 0) & (c.astype(jnp.float16).astype(jnp.float32) == c)
            ok &= jnp.all((n * c[..., None] == x) & (jnp.abs(n) <= 128), axis=-1)
            ok &= jnp.all((n_sub % 32 == 0) & (n_sub <= 128) & (n_sub >= -96), axis=-1)
            d = jnp.where(ok & ~found, c, d)
            found |= ok
        return d, found

    init = (jnp.zeros(x.shape[:-1], jnp.float32), jnp.zeros(x.shape[:-1], bool))
    d, found = jax.lax.fori_loop(0, 16, candidate, init)
    n = jnp.round(xs / jnp.where(found, d, 1)[..., None, None])
    first = jnp.where(_signed_absmax(n)[1] < 0, 1.0, -1.0)

    def scale(magnitude, state):
        sc, done = state
        for direction in (first, -first):
            s = direction * magnitude.astype(jnp.float32)
            q = jnp.round(n / s[..., None])
            ok = (s <= 31) & jnp.all((q * s[..., None] == n) & (q >= -4) & (q <= 3), axis=-1)
            sc = jnp.where(ok & ~done, s, sc)
            done |= ok
        return sc, done

    init = (jnp.zeros(first.shape, jnp.float32), jnp.all(n == 0, axis=-1))
    sc, done = jax.lax.fori_loop(1, 33, scale, init)
    q = jnp.where((sc == 0)[..., None], 0.0, jnp.round(n / jnp.where(sc == 0, 1, sc)[..., None]))
    blocks = _pack_q3_k(_f16_bytes(d), (sc + 32).astype(jnp.int32), q + 4)
    found &= jnp.all(done, axis=-1)
    found &= jnp.all(_dec_q3_k(blocks) == x, axis=-1)
    return found, blocks


def _enc_q8_k(x):
    amax, mx = _signed_absmax(x)
    flat = amax == 0
    iscale = -127.0 / jnp.where(flat, 1.0, mx)
    q = jnp.minimum(127, _nearest(iscale[..., None] * x))
    d = jnp.where(flat, 0.0, _reciprocal(iscale)).astype(jnp.float32)
    # Values that are already a Q8_K block's (d q, the extreme one at q = -127) keep that d
    # and those codes: the reference's d = 1 / (-127 / mx) can land one ulp away from it, so
    # re-encoding decoded blocks would not give them back. mx / -127 is d or one ulp from it.
    found = flat
    for toward in (None, jnp.inf, -jnp.inf):
        d_try = mx / -127.0
        if toward is not None:
            d_try = jnp.nextafter(d_try, jnp.float32(toward))
        q_try = jnp.clip(_nearest(x / jnp.where(flat, 1.0, d_try)[..., None]), -128, 127)
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
    amax, _ = _signed_absmax(x)
    q = _roundf(x * _safe_div(1.0, amax)[..., None]).astype(jnp.int8) + jnp.int8(1)
    return amax, _u8(q)


def _enc_tq1_0(x):
    d, q = _ternary(x)

    def fold(v, k, n):
        v = v.reshape(*v.shape[:-1], k, n).astype(jnp.uint16)
        weights = jnp.asarray([81, 27, 9, 3, 1][:k], jnp.uint16)[:, None]
        return (v * weights).sum(-2, dtype=jnp.uint16)

    packed = jnp.concatenate(
        [fold(q[..., :160], 5, 32), fold(q[..., 160:240], 5, 16), fold(q[..., 240:], 4, 4)], -1
    )
    packed = _u8((packed * 256 + 242) // 243)
    return jnp.concatenate([packed, _f16_bytes(d)], -1)


def _enc_tq2_0(x):
    d, q = _ternary(x)
    return jnp.concatenate([_pack_2bit_128(q), _f16_bytes(d)], -1)


_ENCODERS = {
    "Q8_0": _enc_q8_0,
    "Q4_0": _enc_q4_0,
    "Q4_1": _enc_q4_1,
    "Q5_0": _enc_q5_0,
    "Q5_1": _enc_q5_1,
    "IQ4_NL": _enc_iq4_nl,
    "Q2_K": _enc_q2_k,
    "Q3_K": _enc_q3_k,
    "Q4_K": _enc_q4_k,
    "Q5_K": _enc_q5_k,
    "Q6_K": _enc_q6_k,
    "Q8_K": _enc_q8_k,
    "TQ1_0": _enc_tq1_0,
    "TQ2_0": _enc_tq2_0,
}


def encode_traced(name: str, x: jax.Array) -> jax.Array:
    """`encode` without its own jit (for use inside a traced function)."""
    t = block_type(name)
    x = jnp.asarray(x, jnp.float32)
    if x.ndim == 0 or x.shape[-1] % t.block_size:
        raise ValueError(
            f"{name} encodes rows whose length is a multiple of {t.block_size}, got shape "
            f"{tuple(x.shape)}"
        )
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
      ValueError: for an unknown type, a row length that is not whole blocks, or non-finite
        values.
    """
    t = block_type(name)
    x = np.asarray(x, np.float32)
    if x.ndim == 0 or x.shape[-1] % t.block_size:
        raise ValueError(
            f"{name} encodes rows whose length is a multiple of {t.block_size}, got shape {x.shape}"
        )
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: cannot encode NaN or Inf values")
    if x.size == 0:
        return np.zeros((*x.shape[:-1], 0), np.uint8)
    out = _encode_blocks(name, np.ascontiguousarray(x).reshape(-1), t.block_size)
    return out.reshape(*x.shape[:-1], -1)


# --- linear-kernel views -----------------------------------------------------------------------


def q4_k_fields(raw: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Q4_K blocks as an asymmetric 4-bit grouped weight: ``x = scale * q - minimum``.

    Args:
      raw: uint8 [..., n / 256 * 144].
    Returns:
      ``(q, scale, minimum)``: q uint8 [..., n] in [0, 16); scale ``d * sc`` and minimum
      ``dmin * m`` float32 [..., n / 32] (both exact products of the stored fields).
    """
    b = raw.reshape(*raw.shape[:-1], -1, 144)
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales_unpack(b[..., 4:16])
    q = _unpack_nibbles_64(b[..., 16:144]).reshape(*raw.shape[:-1], -1)
    scale = (d * sc.astype(jnp.float32)).reshape(*raw.shape[:-1], -1)
    minimum = (dmin * mn.astype(jnp.float32)).reshape(*raw.shape[:-1], -1)
    return q, scale, minimum


def q6_k_fields(raw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q6_K blocks as a symmetric int8 weight in groups of 16: ``x = scale * q``.

    Args:
      raw: uint8 [..., n / 256 * 210].
    Returns:
      ``(q, scale)``: q int8 [..., n] in [-32, 32); scale ``d * sc`` float32 [..., n / 16]
      (exact: an fp16 times an int8).
    """
    b = raw.reshape(*raw.shape[:-1], -1, 210)
    q = (_q6k_codes(b).astype(jnp.int8) - jnp.int8(32)).reshape(*raw.shape[:-1], -1)
    sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    scale = (_f16(b[..., 208:210])[..., None] * sc).reshape(*raw.shape[:-1], -1)
    return q, scale
