"""Integer formats: intN (two's complement, N = 1..8) and uintN (N = 1..8).

`int1` is binary: codes {0, 1} stand for {-1, +1} (sign with a scale, as in BinaryConnect);
there is no zero. Signed formats with N >= 2 use the full two's-complement range
[-2**(N-1), 2**(N-1) - 1] but `max_value` is 2**(N-1) - 1, so symmetric scales map the
calibrated bound to the largest positive code and the grid stays symmetric around 0
(the extra negative code is only reached by asymmetric rounding or clipping ratios < 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats._base import Format


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntFormat(Format):
    """intN / uintN. Sub-byte codes are `uint8` bit patterns; 8-bit codes are int8 / uint8."""

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
        c = codes.astype(jnp.int32)
        if self.bits == 8 or not self.is_signed:
            return c
        if self.bits == 1:
            return 2 * c - 1
        half = 2 ** (self.bits - 1)
        return jnp.where(c >= half, c - 2**self.bits, c)


INT_FORMATS = tuple(IntFormat(name=f"int{n}", bits=n, is_signed=True) for n in range(1, 9))
UINT_FORMATS = tuple(IntFormat(name=f"uint{n}", bits=n, is_signed=False) for n in range(1, 9))
