"""GGUF block formats: GGML's K-quants and friends stored as their own block bytes.

A QArray of one of these formats keeps a tensor exactly as a GGUF file stores it: the codes
along `packed_axis` are the GGML blocks (``type_size`` bytes per ``block_size`` elements, the
block scales inside them), so ``nbytes`` is exactly the GGUF size (the QArray's one-byte unit
`scale` is a placeholder, not counted: `Format.scales_in_codes`). The codecs are the block
type's in `lowbit.gguf` (bit-identical to llama.cpp), and the "codes" a format hands to
`decode` are already the decoded float32 values: `unpack` decodes, `decode` is the identity,
and `pack` encodes float values to blocks with llama.cpp's reference quantizer.

  name     GGML type  block  bytes  bits/value
  q5_0     Q5_0         32     22   5.5
  q5_1     Q5_1         32     24   6.0
  iq4_nl   IQ4_NL       32     18   4.5
  q2_k     Q2_K        256     84   2.625
  q3_k     Q3_K        256    110   3.4375
  q4_k     Q4_K        256    144   4.5
  q5_k     Q5_K        256    176   5.5
  q6_k     Q6_K        256    210   6.5625
  q8_k     Q8_K        256    292   9.125
  iq4_xs   IQ4_XS      256    136   4.25
  tq1_0    TQ1_0       256     54   1.6875
  tq2_0    TQ2_0       256     66   2.0625

These formats carry their own scales, so they are not element formats: `encode` (scaled values
to codes) raises; `lowbit.qarray.quantize` builds them from float directly. Every other type of
`lowbit.gguf.BLOCK_TYPES` (Q8_0, Q4_0, Q4_1: one scale per 32 plain codes) is held as the element
format its codes are (`GGUF_ELEMENT_FORMATS`: int8, int4, uint4), which the integer kernels run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats._base import Format
from lowbit.gguf import BLOCK_TYPES, BlockType, block_type


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFBlockFormat(Format):
    """A GGML block type as a storage format (see the module docstring).

    Attributes:
      ggml_type: the GGML type name, e.g. ``"Q4_K"``.
    """

    ggml_type: str
    bits: int = 8

    @property
    def scales_in_codes(self) -> bool:
        return True

    @property
    def block(self) -> BlockType:
        return block_type(self.ggml_type)

    @property
    def code_dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def max_value(self) -> float:
        return 1.0

    @property
    def min_value(self) -> float:
        return -1.0

    @property
    def bits_per_value(self) -> float:
        return self.block.bits_per_value

    def encode(self, y: jax.Array) -> jax.Array:
        raise ValueError(
            f"format {self.name!r} stores GGUF {self.ggml_type} blocks with their own scales; it "
            "has no element encoding: quantize float arrays with lowbit.qarray.quantize (blocks "
            "along the granularity's axis) or pack them with this format's `pack`"
        )

    def decode(self, codes: jax.Array) -> jax.Array:
        return jnp.asarray(codes, jnp.float32)

    def check_length(self, n: int) -> None:
        """ValueError unless `n` elements are whole blocks."""
        if n % self.block.block_size:
            raise ValueError(
                f"format {self.name!r}: {n} elements along the block axis are not a multiple of "
                f"the {self.ggml_type} block size {self.block.block_size}"
            )

    def packed_length(self, n: int) -> int:
        self.check_length(n)
        return n // self.block.block_size * self.block.type_size

    def pack(self, codes: jax.Array, axis: int) -> jax.Array:
        """values: [..., n, ...] float → [..., packed_length(n), ...] uint8 GGML blocks."""
        values = jnp.moveaxis(jnp.asarray(codes, jnp.float32), axis, -1)
        self.check_length(values.shape[-1])
        return jnp.moveaxis(self.block.encode(values), -1, axis)

    def unpack(self, packed: jax.Array, n: int, axis: int) -> jax.Array:
        """GGML blocks [..., packed_length(n), ...] uint8 → [..., n, ...] float32 values."""
        raw = jnp.moveaxis(jnp.asarray(packed), axis, -1)
        if raw.shape[-1] != self.packed_length(n):
            raise ValueError(
                f"packed axis has {raw.shape[-1]} bytes, expected {self.packed_length(n)} for "
                f"{n} {self.ggml_type} values"
            )
        return jnp.moveaxis(self.block.decode(raw), -1, axis)

    def codes(self) -> np.ndarray:
        raise ValueError(f"format {self.name!r} has no finite code table (GGUF block storage)")

    def levels(self) -> np.ndarray:
        raise ValueError(f"format {self.name!r} has no fixed grid (scales live in its blocks)")


GGUF_ELEMENT_FORMATS = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "uint4"}
"""The GGML types held as element formats (x = d q, d (q - 8), d q + m: codes and one scale per
32 of them), not as block formats."""

GGUF_BLOCK_FORMATS = tuple(
    GGUFBlockFormat(name=name.lower(), ggml_type=name)
    for name in BLOCK_TYPES
    if name not in GGUF_ELEMENT_FORMATS
)
"""A block format for every other GGML type of `lowbit.gguf.BLOCK_TYPES`."""
