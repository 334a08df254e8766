"""Codecs of the 32-element block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL.

Each block is a float16 scale ``d`` (Q4_1 / Q5_1 also a float16 minimum ``m``) and 32 codes.
Per type: `fields_*` splits blocks ``[..., nb, type_size]`` into ``d [..., nb]`` (float32,
float16 values), ``m`` (or None) and the stored codes ``q [..., nb, 32]`` in element order
(Q8_0's int8, the others' unsigned), read by the decoder and by importers that keep the codes
as they are; `join_*` is its inverse, used by the encoder and by layouts that rebuild blocks
from codes; `decode_*` gives ``[..., nb, 32]`` float32 and `encode_*` takes it back to blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.gguf import _search as search
from lowbit.gguf._bits import (
    IQ4_NL_VALUES,
    f16,
    f16_bytes,
    pack_nibbles_32,
    roundf,
    safe_div,
    signed_absmax,
    u8,
    unpack_nibbles_32,
)

# --- Q8_0 ---------------------------------------------------------------------------------


def fields_q8_0(b):
    return f16(b[..., 0:2]), None, jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8)


def join_q8_0(d, m, q):
    del m
    q = jax.lax.bitcast_convert_type(q.astype(jnp.int8), jnp.uint8)
    return jnp.concatenate([f16_bytes(d), q], -1)


def decode_q8_0(b):
    d, _, q = fields_q8_0(b)
    return d[..., None] * q


def encode_q8_0(x):
    amax, _ = signed_absmax(x)
    d = amax / 127
    q = roundf(x * safe_div(1.0, d)[..., None]).astype(jnp.int8)
    return join_q8_0(d, None, q)


# --- Q4_0 ---------------------------------------------------------------------------------


def fields_q4_0(b):
    return f16(b[..., 0:2]), None, unpack_nibbles_32(b[..., 2:])


def join_q4_0(d, m, q):
    del m
    return jnp.concatenate([f16_bytes(d), pack_nibbles_32(q)], -1)


def decode_q4_0(b):
    d, _, q = fields_q4_0(b)
    q = q.astype(jnp.int8) - jnp.int8(8)
    return d[..., None] * q.astype(jnp.float32)


def encode_q4_0(x):
    _, mx = signed_absmax(x)
    d = mx / -8
    x0 = x * safe_div(1.0, d)[..., None]
    q = jnp.minimum(15, (x0 + 8.5).astype(jnp.int8))
    return join_q4_0(d, None, q)


# --- Q4_1 ---------------------------------------------------------------------------------


def fields_q4_1(b):
    return f16(b[..., 0:2]), f16(b[..., 2:4]), unpack_nibbles_32(b[..., 4:])


def join_q4_1(d, m, q):
    return jnp.concatenate([f16_bytes(d), f16_bytes(m), pack_nibbles_32(q)], -1)


def decode_q4_1(b):
    d, m, q = fields_q4_1(b)
    return d[..., None] * q.astype(jnp.float32) + m[..., None]


def encode_q4_1(x):
    lo, hi = x.min(-1), x.max(-1)
    d = (hi - lo) / 15
    x0 = (x - lo[..., None]) * safe_div(1.0, d)[..., None]
    q = jnp.minimum(15, (x0 + 0.5).astype(jnp.int8))
    return join_q4_1(d, lo, q)


# --- Q5_0 ---------------------------------------------------------------------------------


def _q5_high(qh: jax.Array) -> jax.Array:
    """4 bytes -> [..., 32] bits (element j's fifth bit is bit j of the little-endian u32)."""
    bits = qh[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)
    return (bits & 1).reshape(*qh.shape[:-1], 32)


def q5_high_bytes(q):
    """Codes [..., 32] < 32 -> their fifth bits as 4 bytes (`_q5_high`'s inverse)."""
    bits = ((u8(q) >> 4) & 1).reshape(*q.shape[:-1], 4, 8)
    return jnp.sum(bits << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def fields_q5_0(b):
    return f16(b[..., 0:2]), None, unpack_nibbles_32(b[..., 6:]) | (_q5_high(b[..., 2:6]) << 4)


def join_q5_0(d, m, q):
    del m
    return jnp.concatenate([f16_bytes(d), q5_high_bytes(q), pack_nibbles_32(u8(q) & 15)], -1)


def decode_q5_0(b):
    d, _, q = fields_q5_0(b)
    q = q.astype(jnp.int8) - jnp.int8(16)
    return d[..., None] * q.astype(jnp.float32)


def encode_q5_0(x):
    _, mx = signed_absmax(x)
    d = mx / -16
    x0 = x * safe_div(1.0, d)[..., None]
    q = jnp.minimum(31, (x0 + 16.5).astype(jnp.int8))
    return join_q5_0(d, None, q)


# --- Q5_1 ---------------------------------------------------------------------------------


def fields_q5_1(b):
    q = unpack_nibbles_32(b[..., 8:]) | (_q5_high(b[..., 4:8]) << 4)
    return f16(b[..., 0:2]), f16(b[..., 2:4]), q


def join_q5_1(d, m, q):
    parts = [f16_bytes(d), f16_bytes(m), q5_high_bytes(q), pack_nibbles_32(u8(q) & 15)]
    return jnp.concatenate(parts, -1)


def decode_q5_1(b):
    d, m, q = fields_q5_1(b)
    return d[..., None] * q.astype(jnp.float32) + m[..., None]


def encode_q5_1(x):
    lo, hi = x.min(-1), x.max(-1)
    d = (hi - lo) / 31
    x0 = (x - lo[..., None]) * safe_div(1.0, d)[..., None]
    q = jnp.minimum(31, (x0 + 0.5).astype(jnp.int8))
    return join_q5_1(d, lo, q)


# --- IQ4_NL -------------------------------------------------------------------------------


def fields_iq4_nl(b):
    return f16(b[..., 0:2]), None, unpack_nibbles_32(b[..., 2:])


def join_iq4_nl(d, m, q):
    del m
    return jnp.concatenate([f16_bytes(d), pack_nibbles_32(q)], -1)


def decode_iq4_nl(b):
    d, _, q = fields_iq4_nl(b)
    values = jnp.asarray(IQ4_NL_VALUES, jnp.int8)[q]
    return d[..., None] * values.astype(jnp.float32)


def encode_iq4_nl(x):
    d = search.iq4_scale(x)
    idx = search.best_index_iq4(x * safe_div(1.0, d)[..., None])
    return join_iq4_nl(d, None, idx)
