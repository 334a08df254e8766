"""Small floating-point formats (fp8, fp6, fp4), exact and bit-identical to `ml_dtypes`.

A value is sign | exponent (E bits, bias b) | mantissa (M bits); exponent field 0 is subnormal
(m * 2**(1 - b - M)), otherwise (1 + m / 2**M) * 2**(e - b). The formats differ in which bit
patterns are special:

  name           E M  bias  specials                          max     ml_dtypes reference
  fp8_e4m3fn     4 3   7    S.1111.111 NaN, no Inf            448     float8_e4m3fn
  fp8_e5m2       5 2  15    IEEE: exp 11111 Inf (m=0) / NaN   57344   float8_e5m2
  fp8_e4m3fnuz   4 3   8    0x80 (negative zero) NaN, no Inf  240     float8_e4m3fnuz
  fp8_e5m2fnuz   5 2  16    0x80 (negative zero) NaN, no Inf  57344   float8_e5m2fnuz
  fp6_e2m3       2 3   1    none (all finite)                 7.5     float6_e2m3fn
  fp6_e3m2       3 2   3    none (all finite)                 28      float6_e3m2fn
  fp4_e2m1       2 1   1    none (all finite)                 6       float4_e2m1fn

`encode` rounds float32 to nearest, ties to even on the mantissa's last bit (exactly as a
correctly rounded cast), and differs from a raw `ml_dtypes` cast only where that cast is not a
quantizer:

  * overflow: `encode` saturates to ±max for every format (±Inf too). The raw cast gives NaN for
    the e4m3fn and fnuz formats, ±Inf for e5m2, and saturates for fp6/fp4.
  * NaN: `encode` gives the format's NaN code where it has one (0x7F for e4m3fn, 0x7E for e5m2,
    0x80 for fnuz) and +0 for fp6/fp4, which have no NaN (the raw cast gives -0 there).
    `lowbit.qarray.quantize` replaces NaN with 0 before encoding, so this only matters for direct
    callers.
  * signed zero: kept (-0 encodes to the negative-zero code) except in the fnuz formats, whose
    negative-zero pattern is NaN, so -0 and negative values rounding to zero encode to +0 — the
    same as the raw cast.

Encode and decode are integer/bit arithmetic on float32 (no reliance on backend casts to narrow
floats), so they trace to a few elementwise ops. fp8 codes are returned as the float8 dtype itself;
fp6/fp4 codes as uint8 bit patterns (sign in bit `bits - 1`), packed densely by `Format.pack`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from lowbit.formats._base import Format, as_bit_patterns

SPECIALS = ("ieee", "fn", "fnuz", "finite")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FloatFormat(Format):
    """A sign / exponent / mantissa format of at most 8 bits.

    Attributes:
      exponent_bits: E, the exponent field width.
      mantissa_bits: M, the mantissa field width (bits = 1 + E + M).
      bias: exponent bias.
      specials: which patterns are NaN/Inf: ``"ieee"`` (all-ones exponent: Inf if m = 0, else
        NaN), ``"fn"`` (only all-ones exponent and mantissa is NaN), ``"fnuz"`` (only the
        negative-zero pattern is NaN) or ``"finite"`` (none).
      reference: name of the `ml_dtypes` type with the same bit layout (the test reference; for
        8-bit formats also `code_dtype`).
    """

    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: str
    reference: str

    def __post_init__(self):
        if self.bits != 1 + self.exponent_bits + self.mantissa_bits or not 4 <= self.bits <= 8:
            raise ValueError(
                f"format {self.name!r}: bits={self.bits} must be 1 + exponent_bits + "
                f"mantissa_bits = {1 + self.exponent_bits + self.mantissa_bits}, in 4..8"
            )
        if self.specials not in SPECIALS:
            raise ValueError(f"specials={self.specials!r}; accepted: {SPECIALS}")

    @property
    def reference_dtype(self) -> np.dtype:
        return np.dtype(getattr(ml_dtypes, self.reference))

    @property
    def code_dtype(self) -> np.dtype:
        return self.reference_dtype if self.bits == 8 else np.dtype(np.uint8)

    @property
    def _max_magnitude_code(self) -> int:
        e_all, m_all = 2**self.exponent_bits - 1, 2**self.mantissa_bits - 1
        if self.specials == "ieee":
            return ((e_all - 1) << self.mantissa_bits) | m_all
        if self.specials == "fn":
            return (e_all << self.mantissa_bits) | (m_all - 1)
        return (e_all << self.mantissa_bits) | m_all

    @property
    def nan_code(self) -> int | None:
        """Bit pattern `encode` gives NaN, or None if the format has no NaN (NaN → +0)."""
        top = 2**self.exponent_bits - 1
        if self.specials == "ieee":
            return (top << self.mantissa_bits) | (1 << (self.mantissa_bits - 1))
        if self.specials == "fn":
            return (top << self.mantissa_bits) | (2**self.mantissa_bits - 1)
        if self.specials == "fnuz":
            return 1 << (self.bits - 1)
        return None

    @property
    def max_value(self) -> float:
        code = self._max_magnitude_code
        exponent, mantissa = code >> self.mantissa_bits, code & (2**self.mantissa_bits - 1)
        return (1 + mantissa / 2**self.mantissa_bits) * 2.0 ** (exponent - self.bias)

    @property
    def min_value(self) -> float:
        return -self.max_value

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2**(1 - bias)."""
        return 2.0 ** (1 - self.bias)

    def encode(self, y: jax.Array) -> jax.Array:
        m_bits = self.mantissa_bits
        y = jnp.asarray(y, jnp.float32)
        # min() keeps NaN; every finite input past max saturates, and max is on the grid, so
        # rounding below never carries past it.
        a = jnp.minimum(jnp.abs(y), self.max_value)
        # Normal range: round the float32 bit pattern to M mantissa bits, ties to even (add
        # half-ulp minus one, plus the kept LSB, then truncate); a carry into the exponent is
        # the correct rounding to the next binade. Then rebias the exponent field.
        pattern = jax.lax.bitcast_convert_type(a, jnp.int32)
        drop = 23 - m_bits
        rounded = (pattern + ((1 << (drop - 1)) - 1) + ((pattern >> drop) & 1)) >> drop
        normal = rounded - ((127 - self.bias) << m_bits)
        # Subnormal range: multiples of 2**(1 - bias - M); scaling by a power of two is exact,
        # and round() is ties-to-even. Rounding up to 2**M is exactly the smallest normal code.
        step_inv = 2.0 ** (m_bits - (1 - self.bias))
        subnormal = jnp.round(a * step_inv).astype(jnp.int32)
        magnitude = jnp.where(a < self.min_normal, subnormal, normal)
        negative = jnp.signbit(y)
        if self.specials == "fnuz":
            negative = negative & (magnitude != 0)  # the negative-zero pattern is NaN here
        code = magnitude | (negative.astype(jnp.int32) << (self.bits - 1))
        nan_code = 0 if self.nan_code is None else self.nan_code
        code = jnp.where(jnp.isnan(y), nan_code, code).astype(jnp.uint8)
        if self.bits == 8:
            return jax.lax.bitcast_convert_type(code, self.code_dtype)
        return code

    def decode(self, codes: jax.Array) -> jax.Array:
        m_bits, e_bits = self.mantissa_bits, self.exponent_bits
        c = as_bit_patterns(codes).astype(jnp.int32)
        negative = ((c >> (self.bits - 1)) & 1) == 1
        exponent = (c >> m_bits) & (2**e_bits - 1)
        mantissa = c & (2**m_bits - 1)
        normal = jax.lax.bitcast_convert_type(
            ((exponent - self.bias + 127) << 23) | (mantissa << (23 - m_bits)), jnp.float32
        )
        subnormal = mantissa.astype(jnp.float32) * 2.0 ** (1 - self.bias - m_bits)
        magnitude = jnp.where(exponent == 0, subnormal, normal)
        top = exponent == 2**e_bits - 1
        if self.specials == "ieee":
            magnitude = jnp.where(top, jnp.where(mantissa == 0, jnp.inf, jnp.nan), magnitude)
        elif self.specials == "fn":
            magnitude = jnp.where(top & (mantissa == 2**m_bits - 1), jnp.nan, magnitude)
        elif self.specials == "fnuz":
            magnitude = jnp.where(c == 1 << (self.bits - 1), jnp.nan, magnitude)
        return jnp.where(negative, -magnitude, magnitude)


def _float(name: str, e: int, m: int, bias: int, specials: str, reference: str) -> FloatFormat:
    return FloatFormat(
        name=name,
        bits=1 + e + m,
        exponent_bits=e,
        mantissa_bits=m,
        bias=bias,
        specials=specials,
        reference=reference,
    )


FP8_E4M3FN = _float("fp8_e4m3fn", 4, 3, 7, "fn", "float8_e4m3fn")
FP8_E5M2 = _float("fp8_e5m2", 5, 2, 15, "ieee", "float8_e5m2")
FP8_E4M3FNUZ = _float("fp8_e4m3fnuz", 4, 3, 8, "fnuz", "float8_e4m3fnuz")
FP8_E5M2FNUZ = _float("fp8_e5m2fnuz", 5, 2, 16, "fnuz", "float8_e5m2fnuz")
FP6_E2M3 = _float("fp6_e2m3", 2, 3, 1, "finite", "float6_e2m3fn")
FP6_E3M2 = _float("fp6_e3m2", 3, 2, 3, "finite", "float6_e3m2fn")
FP4_E2M1 = _float("fp4_e2m1", 2, 1, 1, "finite", "float4_e2m1fn")
