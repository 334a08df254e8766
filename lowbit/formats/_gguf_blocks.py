"""GGUF (GGML) block types, their constants and the bit packing their codecs share.

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
  IQ4_XS    256   136     4.25     d, sc 2+4 bit [8], nibbles[128]             x = d (sc-32) K[q]
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

import jax
import jax.numpy as jnp

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
        BlockType("IQ4_XS", QK_K, 136),
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
