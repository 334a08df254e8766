"""Codecs of the ternary block types TQ1_0 and TQ2_0: 256 trits (-1, 0, 1) and a float16
scale, packed five to a byte in base 3 (TQ1_0) or four to a byte in 2 bits (TQ2_0).

Per type, `decode_*` takes blocks ``[..., nb, type_size]`` to float32 ``[..., nb, 256]`` and
`encode_*` back (llama.cpp's reference: the scale is the block's largest magnitude).
"""

from __future__ import annotations

import jax.numpy as jnp

from lowbit.gguf._bits import (
    f16,
    f16_bytes,
    pack_2bit_128,
    roundf,
    safe_div,
    signed_absmax,
    u8,
    unpack_2bit_128,
)


def _ternary(x):
    amax, _ = signed_absmax(x)
    q = roundf(x * safe_div(1.0, amax)[..., None]).astype(jnp.int8) + jnp.int8(1)
    return amax, u8(q)


_POW3 = (1, 3, 9, 27, 81)


def _tq1_trits(b):
    qs, qh = b[..., 0:48], b[..., 48:52]

    def spread(v, k):
        out = v[..., None, :] * jnp.asarray(_POW3[:k], jnp.uint8)[:, None]  # wraps mod 256
        return out.reshape(*v.shape[:-1], -1)

    v = jnp.concatenate([spread(qs[..., :32], 5), spread(qs[..., 32:], 5), spread(qh, 4)], -1)
    return ((v.astype(jnp.uint16) * 3) >> 8).astype(jnp.int8) - jnp.int8(1)


def decode_tq1_0(b):
    return f16(b[..., 52:54])[..., None] * _tq1_trits(b).astype(jnp.float32)


def encode_tq1_0(x):
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


def decode_tq2_0(b):
    q = unpack_2bit_128(b[..., 0:64]).astype(jnp.int8) - jnp.int8(1)
    return f16(b[..., 64:66])[..., None] * q.astype(jnp.float32)


def encode_tq2_0(x):
    d, q = _ternary(x)
    return jnp.concatenate([pack_2bit_128(q), f16_bytes(d)], -1)
