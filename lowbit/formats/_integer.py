"""Integer formats: intN (two's complement, N = 1..8), uintN (N = 1..8), and fixed point.

`int1` is binary: codes {0, 1} stand for {-1, +1} (sign with a scale, as in BinaryConnect);
there is no zero, and `encode` sends 0 and NaN to +1. Signed formats with N >= 2 use the full
two's-complement range [-2**(N-1), 2**(N-1) - 1] but `max_value` is 2**(N-1) - 1, so symmetric
scales map the calibrated bound to the largest positive code and the grid stays symmetric around 0
(the extra negative code is only reached by asymmetric rounding or clipping ratios < 1).

Rounding is to nearest with ties to even (`jnp.round`), saturating to [qmin, qmax]; NaN encodes
to the code of 0 (unsigned formats: code 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats._base import Format


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntFormat(Format):
    """intN / uintN. Sub-byte codes are `uint8` bit patterns; 8-bit codes are int8 / uint8.

    Contract used by integer kernels: `decode(c) == to_int(c)` for every code.
    """

    is_signed: bool

    @property
    def code_dtype(self) -> np.dtype:
        if self.bits == 8:
            return np.dtype(np.int8 if self.is_signed else np.uint8)
        return np.dtype(np.uint8)

    @property
    def qmin(self) -> int:
        """Smallest integer code value (as a number, not a bit pattern)."""
        if not self.is_signed:
            return 0
        return -1 if self.bits == 1 else -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        """Largest integer code value."""
        if not self.is_signed:
            return 2**self.bits - 1
        return 1 if self.bits == 1 else 2 ** (self.bits - 1) - 1

    @property
    def max_value(self) -> float:
        return float(self.qmax)

    @property
    def min_value(self) -> float:
        return float(self.qmin)

    def encode(self, y: jax.Array) -> jax.Array:
        y = jnp.asarray(y, jnp.float32)
        if self.is_signed and self.bits == 1:
            # Binary: sign, with 0 (and NaN) sent to +1 so every code is a valid level.
            return (~(y < 0)).astype(jnp.uint8)
        # NaN has no integer value; without the select its conversion is backend-defined.
        y = jnp.where(jnp.isnan(y), 0.0, y)
        q = jnp.clip(jnp.round(y), self.qmin, self.qmax)
        return self.from_int(q.astype(jnp.int32))

    def decode(self, codes: jax.Array) -> jax.Array:
        return self.to_int(codes).astype(jnp.float32)

    def from_int(self, q: jax.Array) -> jax.Array:
        """Integer code values (already in [qmin, qmax]) to stored codes."""
        if self.is_signed and self.bits == 1:
            return (q > 0).astype(jnp.uint8)
        if self.bits == 8:
            return q.astype(self.code_dtype)
        return (q & (2**self.bits - 1)).astype(jnp.uint8)

    def to_int(self, codes: jax.Array) -> jax.Array:
        """Stored codes to integer code values, as int32."""
        c = jnp.asarray(codes).astype(jnp.int32)
        if self.bits == 8 or not self.is_signed:
            return c
        if self.bits == 1:
            return 2 * c - 1
        half = 2 ** (self.bits - 1)
        return jnp.where(c >= half, c - 2**self.bits, c)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedPointFormat(Format):
    """Two's-complement fixed point: value = to_int(code) / 2**fraction_bits.

    The element of MXINT8 is the 8-bit case with 6 fraction bits: values k/64 for k in
    [-128, 127], i.e. [-2, 1.984375]. Code -128 (= -2) is a valid grid value here, so every
    code decodes to a grid value and round-trips. `encode` reaches -2 for inputs at or below
    -1.9921875; `lowbit.qarray.quantize` with a symmetric config clips to ±`max_value` (127/64)
    first (as the public MX emulation library does), so quantized MXINT8 never holds -2.
    Encode rounds to nearest with ties to even and saturates; NaN encodes to 0.

    Attributes:
      fraction_bits: number of bits after the binary point.
    """

    fraction_bits: int

    def __post_init__(self):
        if self.bits != 8:
            raise ValueError(f"FixedPointFormat supports bits=8 only, got bits={self.bits}")

    @property
    def code_dtype(self) -> np.dtype:
        return np.dtype(np.int8)

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def max_value(self) -> float:
        return self.qmax / 2**self.fraction_bits

    @property
    def min_value(self) -> float:
        return self.qmin / 2**self.fraction_bits

    def encode(self, y: jax.Array) -> jax.Array:
        y = jnp.asarray(y, jnp.float32)
        y = jnp.where(jnp.isnan(y), 0.0, y) * 2.0**self.fraction_bits  # exact: power of two
        return self.from_int(jnp.clip(jnp.round(y), self.qmin, self.qmax).astype(jnp.int32))

    def decode(self, codes: jax.Array) -> jax.Array:
        return self.to_int(codes).astype(jnp.float32) * 2.0**-self.fraction_bits

    def from_int(self, q: jax.Array) -> jax.Array:
        """Integer codes in [qmin, qmax] to stored int8 codes."""
        return q.astype(jnp.int8)

    def to_int(self, codes: jax.Array) -> jax.Array:
        """Stored codes to integers (the value times 2**fraction_bits), as int32."""
        return jnp.asarray(codes).astype(jnp.int32)


INT_FORMATS = tuple(IntFormat(name=f"int{n}", bits=n, is_signed=True) for n in range(1, 9))
UINT_FORMATS = tuple(IntFormat(name=f"uint{n}", bits=n, is_signed=False) for n in range(1, 9))
MXINT8_ELEMENT = FixedPointFormat(name="int8_frac6", bits=8, fraction_bits=6)
