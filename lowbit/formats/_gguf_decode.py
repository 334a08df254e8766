"""GGUF block decoders: blocks to float32, bit-identical to llama.cpp's dequantization (see
`_gguf_blocks` for the layouts)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats._gguf_blocks import (
    BLOCK_TYPES,
    IQ4_NL_VALUES,
    QK_K,
    block_type,
    f16,
    k_scales_unpack,
    q3_scales_unpack,
    shifts,
    unpack_2bit_128,
    unpack_nibbles_32,
    unpack_nibbles_64,
)

# --- decoders: blocks [..., nb, type_size] -> [..., nb, block_size] float32 ------------------


def _dec_q8_0(b):
    return f16(b[..., 0:2])[..., None] * jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8)


def _dec_q4_0(b):
    q = unpack_nibbles_32(b[..., 2:]).astype(jnp.int8) - jnp.int8(8)
    return f16(b[..., 0:2])[..., None] * q.astype(jnp.float32)


def _dec_q4_1(b):
    q = unpack_nibbles_32(b[..., 4:]).astype(jnp.float32)
    return f16(b[..., 0:2])[..., None] * q + f16(b[..., 2:4])[..., None]


def _q5_high(qh: jax.Array) -> jax.Array:
    """4 bytes -> [..., 32] bits (element j's fifth bit is bit j of the little-endian u32)."""
    bits = qh[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)
    return (bits & 1).reshape(*qh.shape[:-1], 32)


def _dec_q5_0(b):
    q = unpack_nibbles_32(b[..., 6:]) | (_q5_high(b[..., 2:6]) << 4)
    q = q.astype(jnp.int8) - jnp.int8(16)
    return f16(b[..., 0:2])[..., None] * q.astype(jnp.float32)


def _dec_q5_1(b):
    q = (unpack_nibbles_32(b[..., 8:]) | (_q5_high(b[..., 4:8]) << 4)).astype(jnp.float32)
    return f16(b[..., 0:2])[..., None] * q + f16(b[..., 2:4])[..., None]


def _dec_iq4_nl(b):
    values = jnp.asarray(IQ4_NL_VALUES, jnp.int8)[unpack_nibbles_32(b[..., 2:])]
    return f16(b[..., 0:2])[..., None] * values.astype(jnp.float32)


def _dec_iq4_xs(b):
    d = f16(b[..., 0:2])
    high = b[..., 2].astype(jnp.int32) | (b[..., 3].astype(jnp.int32) << 8)
    j = jnp.arange(8)
    low = (b[..., 4:8][..., j // 2].astype(jnp.int32) >> (4 * (j % 2))) & 15
    ls = low | (((high[..., None] >> (2 * j)) & 3) << 4)
    dl = d[..., None] * (ls - 32).astype(jnp.float32)
    qs = b[..., 8:].reshape(*b.shape[:-1], 8, 16)
    values = jnp.asarray(IQ4_NL_VALUES, jnp.int8)[unpack_nibbles_32(qs)].astype(jnp.float32)
    return (dl[..., None] * values).reshape(*b.shape[:-1], QK_K)


def _dec_q2_k(b):
    sc, qs = b[..., 0:16], b[..., 16:80]
    d, dmin = f16(b[..., 80:82])[..., None], f16(b[..., 82:84])[..., None]
    dl = (d * (sc & 15).astype(jnp.float32))[..., None]
    ml = (dmin * (sc >> 4).astype(jnp.float32))[..., None]
    q = unpack_2bit_128(qs).reshape(*b.shape[:-1], 16, 16).astype(jnp.float32)
    return (dl * q - ml).reshape(*b.shape[:-1], QK_K)


def _dec_q3_k(b):
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


def _k_min_decode(b, q):
    d, dmin = f16(b[..., 0:2])[..., None], f16(b[..., 2:4])[..., None]
    sc, mn = k_scales_unpack(b[..., 4:16])
    dl = (d * sc.astype(jnp.float32))[..., None]
    ml = (dmin * mn.astype(jnp.float32))[..., None]
    q = q.reshape(*b.shape[:-1], 8, 32).astype(jnp.float32)
    return (dl * q - ml).reshape(*b.shape[:-1], QK_K)


def _dec_q4_k(b):
    return _k_min_decode(b, unpack_nibbles_64(b[..., 16:144]))


def _q5k_high(qh):
    bits = (qh[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1
    return bits.reshape(*qh.shape[:-1], QK_K)


def _dec_q5_k(b):
    q = unpack_nibbles_64(b[..., 48:176]) | (_q5k_high(b[..., 16:48]) << 4)
    return _k_min_decode(b, q)


def _q6k_codes(b):
    """Q6_K's 6-bit codes [..., 256] uint8 (value + 32)."""
    ql, qh = b[..., 0:128], b[..., 128:192]
    low = ql.reshape(*b.shape[:-1], 2, 1, 64) >> shifts(0, 4)[:, None]
    low = (low & 15).reshape(*b.shape[:-1], QK_K)
    high = qh.reshape(*b.shape[:-1], 2, 1, 32) >> shifts(0, 2, 4, 6)[:, None]
    high = (high & 3).reshape(*b.shape[:-1], QK_K)
    return low | (high << 4)


def _dec_q6_k(b):
    sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    dl = (f16(b[..., 208:210])[..., None] * sc)[..., None]
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
    return f16(b[..., 52:54])[..., None] * _tq1_trits(b).astype(jnp.float32)


def _dec_tq2_0(b):
    q = unpack_2bit_128(b[..., 0:64]).astype(jnp.int8) - jnp.int8(1)
    return f16(b[..., 64:66])[..., None] * q.astype(jnp.float32)


# Every block type has its decoder, `_dec_` and the type's name in lower case.
_DECODERS = {name: globals()[f"_dec_{name.lower()}"] for name in BLOCK_TYPES}


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
