"""The one table of GGUF (GGML) block types: each type's sizes and its codec, by name.

Every GGML quantization type stores a row as consecutive blocks of `block_size` elements in
`type_size` bytes, each block carrying its own scales. Decoders reproduce llama.cpp's
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

Arrays: `BlockType.decode` takes ``uint8 [..., n_blocks * type_size]`` and returns
``float32 [..., n_blocks * block_size]``; `BlockType.encode` the reverse. Both are traced JAX
functions (so a decoder also runs inside a traced `QArray.dequantize`), vectorised over every
block of a tensor; `decode` and `encode` here are their compiled NumPy entry points.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from lowbit.gguf._bits import QK_K
from lowbit.gguf._kquants import (
    decode_iq4_xs,
    decode_q2_k,
    decode_q3_k,
    decode_q4_k,
    decode_q5_k,
    decode_q6_k,
    decode_q8_k,
    encode_iq4_xs,
    encode_q2_k,
    encode_q3_k,
    encode_q4_k,
    encode_q5_k,
    encode_q6_k,
    encode_q8_k,
)
from lowbit.gguf._legacy import (
    decode_iq4_nl,
    decode_q4_0,
    decode_q4_1,
    decode_q5_0,
    decode_q5_1,
    decode_q8_0,
    encode_iq4_nl,
    encode_q4_0,
    encode_q4_1,
    encode_q5_0,
    encode_q5_1,
    encode_q8_0,
    fields_iq4_nl,
    fields_q4_0,
    fields_q4_1,
    fields_q5_0,
    fields_q5_1,
    fields_q8_0,
    join_iq4_nl,
    join_q4_0,
    join_q4_1,
    join_q5_0,
    join_q5_1,
    join_q8_0,
)
from lowbit.gguf._ternary import (
    decode_tq1_0,
    decode_tq2_0,
    encode_tq1_0,
    encode_tq2_0,
)

_F16_MAX = float(np.finfo(np.float16).max)

Blocks = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class BlockType:
    """One GGML block type: its sizes and its codec.

    Attributes:
      name: the GGML type name, e.g. ``"Q4_K"``.
      block_size: elements per block.
      type_size: bytes per block.
      decode_blocks: blocks ``uint8 [..., nb, type_size]`` -> ``float32 [..., nb, block_size]``.
      encode_blocks: ``float32 [..., nb, block_size]`` -> blocks ``uint8 [..., nb, type_size]``.
      fields: for the 32-element types, blocks -> their scale, minimum (or None) and stored
        codes (`lowbit.gguf._legacy`); None for the others.
      joins: ``fields``' inverse, (scale, minimum or None, codes) -> blocks; None likewise.
      max_abs: the largest magnitude every block can hold. The blocks store their scales (and
        minimums) as float16, so values past float16's maximum cannot be stored; llama.cpp's
        quantizers turn them into infinite scales. Q8_K's scale is a float32, and its scale
        search overflows only in the top bit of float32's range.
    """

    name: str
    block_size: int
    type_size: int
    decode_blocks: Blocks = dataclasses.field(repr=False, compare=False)
    encode_blocks: Blocks = dataclasses.field(repr=False, compare=False)
    fields: Callable | None = dataclasses.field(default=None, repr=False, compare=False)
    joins: Callable | None = dataclasses.field(default=None, repr=False, compare=False)
    max_abs: float = _F16_MAX

    @property
    def bits_per_value(self) -> float:
        return self.type_size * 8 / self.block_size

    @property
    def ggml_type(self) -> gguf.GGMLQuantizationType:
        """The `gguf` package's enum member (its value is the type id GGUF files store)."""
        return gguf.GGMLQuantizationType[self.name]

    @property
    def ggml_id(self) -> int:
        """The type id GGUF files store for this type, e.g. 12 for Q4_K."""
        return int(self.ggml_type)

    def decode(self, raw: jax.Array) -> jax.Array:
        """Blocks ``uint8 [..., n_blocks * type_size]`` -> ``float32 [..., n_blocks *
        block_size]``, bit-identical to llama.cpp's dequantization (traced: usable inside jit).
        """
        raw = jnp.asarray(raw)
        if raw.dtype != jnp.uint8 or raw.shape[-1] % self.type_size:
            raise ValueError(
                f"{self.name} blocks must be uint8 with a last axis that is a multiple of "
                f"{self.type_size} bytes, got {raw.dtype} {tuple(raw.shape)}"
            )
        return _decode(self, raw)

    def encode(self, x: jax.Array) -> jax.Array:
        """Float values ``[..., n]`` (n whole blocks) -> blocks ``uint8 [..., n / block_size *
        type_size]`` with llama.cpp's reference quantizer (traced: usable inside jit).

        Values beyond ``±max_abs`` (which `encode` refuses) saturate to it, so the blocks
        always decode to finite values.
        """
        x = jnp.asarray(x, jnp.float32)
        if x.ndim == 0 or x.shape[-1] % self.block_size:
            raise ValueError(
                f"{self.name} encodes rows whose length is a multiple of {self.block_size}, "
                f"got shape {tuple(x.shape)}"
            )
        x = jnp.clip(x, -self.max_abs, self.max_abs)
        blocks = x.reshape(*x.shape[:-1], -1, self.block_size)
        return self.encode_blocks(blocks).reshape(*x.shape[:-1], -1)

    def split(self, raw: jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """A 32-element type's blocks ``uint8 [..., n_blocks * type_size]`` as their fields:
        scale ``d`` ``[..., n_blocks]`` float32 (float16 values), minimum ``m`` likewise (None
        for the types without one) and the stored codes ``[..., n_blocks * 32]`` in element
        order (int8 for Q8_0, unsigned for the others: Q4_0's ``q`` of ``x = d (q - 8)``).

        Raises:
          ValueError: for a type without such fields (the 256-element types).
        """
        if self.fields is None:
            raise ValueError(f"{self.name} blocks have no scale / minimum / codes split")
        raw = jnp.asarray(raw)
        if raw.dtype != jnp.uint8 or raw.shape[-1] % self.type_size:
            raise ValueError(
                f"{self.name} blocks must be uint8 with a last axis that is a multiple of "
                f"{self.type_size} bytes, got {raw.dtype} {tuple(raw.shape)}"
            )
        d, m, q = self.fields(raw.reshape(*raw.shape[:-1], -1, self.type_size))
        return d, m, q.reshape(*raw.shape[:-1], -1)

    def join(self, d: jax.Array, m: jax.Array | None, q: jax.Array) -> jax.Array:
        """`split`'s inverse: scale ``d`` ``[..., n_blocks]`` (rounded to float16), minimum
        ``m`` likewise (None for the types without one) and stored codes ``[..., n_blocks *
        32]`` in element order -> blocks ``uint8 [..., n_blocks * type_size]``.

        Raises:
          ValueError: for a type without such fields, or codes not whole blocks.
        """
        if self.joins is None:
            raise ValueError(f"{self.name} blocks have no scale / minimum / codes split")
        q = jnp.asarray(q)
        if q.ndim == 0 or q.shape[-1] % self.block_size:
            raise ValueError(
                f"{self.name} codes must have a last axis that is a multiple of "
                f"{self.block_size}, got shape {tuple(q.shape)}"
            )
        blocks = self.joins(d, m, q.reshape(*q.shape[:-1], -1, self.block_size))
        return blocks.reshape(*q.shape[:-1], -1)


# Jitted so that a traced program traces a type's decode once per shape, not at each use:
# a model's portable products decode every weight (a Q4_K decode is ~9 ms of tracing, over
# 500 of them in a 1.5B decoder's two programs).
@functools.partial(jax.jit, static_argnums=0)
def _decode(block_type: BlockType, raw: jax.Array) -> jax.Array:
    blocks = raw.reshape(*raw.shape[:-1], -1, block_type.type_size)
    values = block_type.decode_blocks(blocks).astype(jnp.float32)
    return values.reshape(*raw.shape[:-1], -1)


BLOCK_TYPES: types.MappingProxyType[str, BlockType] = types.MappingProxyType(
    {
        t.name: t
        for t in (
            BlockType("Q8_0", 32, 34, decode_q8_0, encode_q8_0, fields_q8_0, join_q8_0),
            BlockType("Q4_0", 32, 18, decode_q4_0, encode_q4_0, fields_q4_0, join_q4_0),
            BlockType("Q4_1", 32, 20, decode_q4_1, encode_q4_1, fields_q4_1, join_q4_1),
            BlockType("Q5_0", 32, 22, decode_q5_0, encode_q5_0, fields_q5_0, join_q5_0),
            BlockType("Q5_1", 32, 24, decode_q5_1, encode_q5_1, fields_q5_1, join_q5_1),
            BlockType("IQ4_NL", 32, 18, decode_iq4_nl, encode_iq4_nl, fields_iq4_nl, join_iq4_nl),
            BlockType("Q2_K", QK_K, 84, decode_q2_k, encode_q2_k),
            BlockType("Q3_K", QK_K, 110, decode_q3_k, encode_q3_k),
            BlockType("Q4_K", QK_K, 144, decode_q4_k, encode_q4_k),
            BlockType("Q5_K", QK_K, 176, decode_q5_k, encode_q5_k),
            BlockType("Q6_K", QK_K, 210, decode_q6_k, encode_q6_k),
            BlockType("Q8_K", QK_K, 292, decode_q8_k, encode_q8_k, max_abs=2.0**127),
            BlockType("IQ4_XS", QK_K, 136, decode_iq4_xs, encode_iq4_xs),
            BlockType("TQ1_0", QK_K, 54, decode_tq1_0, encode_tq1_0),
            BlockType("TQ2_0", QK_K, 66, decode_tq2_0, encode_tq2_0),
        )
    }
)
"""GGML type name -> `BlockType`: every type lowbit encodes and decodes (the one list)."""


def block_type(name: str) -> BlockType:
    """The `BlockType` called `name` (e.g. ``"Q4_K"``); ValueError listing the known ones."""
    found = BLOCK_TYPES.get(name)
    if found is None:
        raise ValueError(f"unknown GGUF block type {name!r}; accepted: {', '.join(BLOCK_TYPES)}")
    return found


# A tensor of any shape is coded as a flat list of blocks, in chunks of a few fixed sizes (in
# elements), so each type compiles a few programs per process whatever the tensor shapes, and
# the largest chunk bounds the temporaries. The encoder takes whole chunks of 2**20 elements,
# then the rest in chunks of 2**14, the last one padded: its refits are decided per chunk, so
# the chunks stay these. Decoding and splitting are per block: chunks of every power of two
# between the two, so that any tensor takes a few calls.
_ENCODE_CHUNKS = (1 << 20, 1 << 14)
_BLOCKWISE_CHUNKS = tuple(1 << k for k in range(20, 13, -1))


@functools.partial(jax.jit, static_argnums=0)
def _encode_jit(name, x):
    return block_type(name).encode(x)


@functools.partial(jax.jit, static_argnums=0)
def _split_jit(name, raw):
    return block_type(name).split(raw)


def _chunked(
    code: Callable, rows: np.ndarray, t: BlockType, sizes: tuple[int, ...], *outs: np.ndarray | None
) -> None:
    """Fills `outs` [n, ...] with the outputs of `code` ([k, width] -> a tuple of [k, ...], None
    where an out is None) on every row (block) of `rows` [n, width]: as many whole chunks of
    each of `sizes` (elements, largest first) as fit in what is left, then the rest padded with
    zeros to the smallest."""
    starts, i = [], 0
    for size in sizes:
        k = size // t.block_size
        while rows.shape[0] - i >= k:
            starts.append((i, k))
            i += k
    if i < rows.shape[0]:
        starts.append((i, sizes[-1] // t.block_size))
    for i, k in starts:
        chunk = rows[i : i + k]
        n = chunk.shape[0]
        if n < k:
            chunk = np.concatenate([chunk, np.zeros((k - n, rows.shape[1]), rows.dtype)])
        for out, value in zip(outs, code(chunk), strict=True):
            if out is not None:
                out[i : i + n] = np.asarray(value)[:n]


def _whole_blocks(name: str, raw: jax.Array | np.ndarray) -> tuple[BlockType, np.ndarray]:
    """`name`'s block type and `raw` as a NumPy array of whole blocks.

    Raises:
      ValueError: for an unknown type, or bytes that are not uint8 whole blocks.
    """
    t = block_type(name)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim == 0 or raw.shape[-1] % t.type_size:
        raise ValueError(
            f"{name} blocks must be uint8 with a last axis that is a multiple of "
            f"{t.type_size} bytes, got {raw.dtype} {raw.shape}"
        )
    return t, raw


def decode(name: str, raw: jax.Array | np.ndarray) -> np.ndarray:
    """GGUF blocks to float32, bit-identical to llama.cpp's dequantization.

    Args:
      name: GGML type name, e.g. ``"Q4_K"``.
      raw: uint8 [..., n_blocks * type_size].
    Returns:
      float32 [..., n_blocks * block_size] (NumPy).
    Raises:
      ValueError: for an unknown type, or bytes that are not uint8 whole blocks.
    """
    t, raw = _whole_blocks(name, raw)
    if raw.size == 0:
        return np.zeros((*raw.shape[:-1], raw.shape[-1] // t.type_size * t.block_size), np.float32)
    blocks = np.ascontiguousarray(raw).reshape(-1, t.type_size)
    values = np.empty((blocks.shape[0], t.block_size), np.float32)
    _chunked(lambda chunk: (t.decode(chunk),), blocks, t, _BLOCKWISE_CHUNKS, values)
    return values.reshape(*raw.shape[:-1], -1)


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
        values, or values beyond ``±max_abs`` (`BlockType.max_abs`).
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
    if peak > t.max_abs:
        raise ValueError(
            f"format {name.lower()!r} stores values up to ±{t.max_abs:g} (the range its "
            f"block scales can encode), but this array reaches {peak:g}; keep it in float or "
            "use a format with float32 scales (int8, int4, nf4, ...)"
        )
    if x.size == 0:
        return np.zeros((*x.shape[:-1], 0), np.uint8)
    values = np.ascontiguousarray(x).reshape(-1, t.block_size)
    blocks = np.empty((values.shape[0], t.type_size), np.uint8)
    _chunked(lambda chunk: (_encode_jit(name, chunk),), values, t, _ENCODE_CHUNKS, blocks)
    return blocks.reshape(*x.shape[:-1], -1)


@functools.cache
def _fields_of(name: str) -> tuple[jax.ShapeDtypeStruct | None, ...]:
    """Shape and dtype of one block's `BlockType.split` fields (None: the type has no such
    field); ValueError for a type without fields."""
    t = block_type(name)
    one = jax.eval_shape(t.split, jax.ShapeDtypeStruct((t.type_size,), np.uint8))
    return tuple(None if f is None else jax.ShapeDtypeStruct(f.shape, f.dtype) for f in one)


def split(
    name: str, raw: jax.Array | np.ndarray
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A 32-element type's blocks as their fields (`BlockType.split`), in NumPy.

    Args:
      name: GGML type name: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL.
      raw: uint8 [..., n_blocks * type_size].
    Returns:
      ``(d, m, q)``: scales and minimums (None for the types without) float32
      [..., n_blocks], float16 values; the stored codes [..., n_blocks * 32] in element order
      (int8 for Q8_0, else uint8).
    Raises:
      ValueError: for a type without such fields, or bytes that are not uint8 whole blocks.
    """
    t, raw = _whole_blocks(name, raw)
    blocks = np.ascontiguousarray(raw).reshape(-1, t.type_size)
    n = blocks.shape[0]
    outs = [None if f is None else np.empty((n, *f.shape), f.dtype) for f in _fields_of(name)]
    if n:
        _chunked(lambda chunk: _split_jit(name, chunk), blocks, t, _BLOCKWISE_CHUNKS, *outs)
    lead = raw.shape[:-1]
    return tuple(None if o is None else o.reshape(*lead, -1) for o in outs)
