"""The bit-level pieces the block codecs share: float16 fields, llama.cpp's rounding, and the
packings of 2-bit, 4-bit and 6-bit fields into block bytes (layouts: `lowbit.gguf._types`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QK_K = 256
GROUP_MAX_EPS = 1e-15
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def f16(b: jax.Array) -> jax.Array:
    """uint8 [..., 2] little-endian half -> float32 [...]."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def f16_bytes(x: jax.Array) -> jax.Array:
    """float32 [...] -> uint8 [..., 2] of its nearest float16."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint8)


def u8(x: jax.Array) -> jax.Array:
    return x.astype(jnp.uint8)


def shifts(*values: int) -> jax.Array:
    return jnp.asarray(values, jnp.uint8)


def reciprocal(x: jax.Array) -> jax.Array:
    """1 / x as one rounded division (the barrier keeps XLA from folding it into x's own
    division, which changes the last bit)."""
    return 1 / jax.lax.optimization_barrier(x)


def nearest(x: jax.Array) -> jax.Array:
    """llama.cpp's `nearest_int`: round half to even (as int32)."""
    return jnp.round(x).astype(jnp.int32)


def roundf(x: jax.Array) -> jax.Array:
    """C `roundf`: half away from zero."""
    return jnp.sign(x) * jnp.floor(jnp.abs(x) + 0.5)


def signed_absmax(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(max |x|, the signed value where it is first reached) along the last axis."""
    idx = jnp.argmax(jnp.abs(x), axis=-1)
    value = jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    return jnp.abs(value), value


def safe_div(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(b != 0, a / jnp.where(b != 0, b, 1), 0)


def pack_2bit_128(q: jax.Array) -> jax.Array:
    """[..., 256] values < 4 -> [..., 64] bytes: chunk c's byte l holds elements
    128c + l + 32s at bits 2s (s = 0..3)."""
    q = u8(q).reshape(*q.shape[:-1], 2, 4, 32)
    packed = q[..., 0, :] | (q[..., 1, :] << 2) | (q[..., 2, :] << 4) | (q[..., 3, :] << 6)
    return packed.reshape(*q.shape[:-3], 64)


def unpack_2bit_128(qs: jax.Array) -> jax.Array:
    """Inverse of `pack_2bit_128`: [..., 64] -> [..., 256] uint8."""
    q = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts(0, 2, 4, 6)[:, None]
    return (q & 3).reshape(*qs.shape[:-1], QK_K)


def pack_nibbles_64(q: jax.Array) -> jax.Array:
    """[..., 256] values < 16 -> [..., 128]: chunk c's byte l holds 64c + l (low), + 32 (high)."""
    q = u8(q).reshape(*q.shape[:-1], 4, 2, 32)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:-3], 128)


def unpack_nibbles_64(qs: jax.Array) -> jax.Array:
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> shifts(0, 4)[:, None]
    return (q & 15).reshape(*qs.shape[:-1], QK_K)


def pack_nibbles_32(q: jax.Array) -> jax.Array:
    """[..., 32] values < 16 -> [..., 16]: byte j holds element j (low), j + 16 (high)."""
    q = u8(q)
    return q[..., :16] | (q[..., 16:] << 4)


def unpack_nibbles_32(qs: jax.Array) -> jax.Array:
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1)


def k_scales_unpack(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K's 12 scale bytes -> (scales, mins) [..., 8] uint8 (6 bits each)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 63, (md & 15) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 63, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def k_scales_pack(ls: jax.Array, lm: jax.Array) -> jax.Array:
    """Inverse of `k_scales_unpack`: scales, mins [..., 8] (< 64) -> [..., 12] bytes."""
    ls, lm = u8(ls), u8(lm)
    lo = ls[..., :4] | ((ls[..., 4:] >> 4) << 6)
    mid = lm[..., :4] | ((lm[..., 4:] >> 4) << 6)
    hi = (ls[..., 4:] & 15) | ((lm[..., 4:] & 15) << 4)
    return jnp.concatenate([lo, mid, hi], axis=-1)


def q3_scales_unpack(s: jax.Array) -> jax.Array:
    """Q3_K's 12 scale bytes -> [..., 16] uint8 6-bit scales (stored + 32)."""
    low = (s[..., :8][..., None, :] >> shifts(0, 4)[:, None]).reshape(*s.shape[:-1], 16)
    high = (s[..., 8:][..., None, :] >> shifts(0, 2, 4, 6)[:, None]).reshape(*s.shape[:-1], 16)
    return (low & 15) | ((high & 3) << 4)


def q3_scales_pack(l6: jax.Array) -> jax.Array:
    l6 = u8(l6)
    low = (l6[..., :8] & 15) | ((l6[..., 8:] & 15) << 4)
    h = (l6 >> 4).reshape(*l6.shape[:-1], 4, 4)
    high = h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)
    return jnp.concatenate([low, high], axis=-1)


def pack_q3_k(d16, l6, q):
    """d16 [..., 2] bytes, l6 [..., 16] (scale + 32), q [..., 16, 16] codes 0..7 -> blocks."""
    q = u8(q.reshape(*q.shape[:-2], QK_K))
    high = (q > 3).reshape(*q.shape[:-1], 8, 32).astype(jnp.uint8)
    hmask = jnp.sum(high << jnp.arange(8, dtype=jnp.uint8)[:, None], axis=-2, dtype=jnp.uint8)
    q = jnp.where(q > 3, q - 4, q)
    return jnp.concatenate([hmask, pack_2bit_128(q), q3_scales_pack(l6), d16], -1)
