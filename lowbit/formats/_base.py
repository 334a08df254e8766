"""The `Format` interface: a number grid and its exact code mapping.

A format maps *scaled* real values (the value divided by its scale, plus a zero point where
asymmetric) to integer-coded storage and back. Scale selection, granularity and packing live
elsewhere (`lowbit.qarray`), so that a format is only the number grid and its code mapping.

Codes are returned in `code_dtype`:
  * 8-bit integer formats: `int8` / `uint8` (so integer matmuls can read them directly);
  * fp8 formats: the `ml_dtypes` float8 dtype itself (so fp8 matmuls can read them directly);
  * sub-byte formats: `uint8` bit patterns in `[0, 2**bits)`, ready for `Format.pack`.
"""

from __future__ import annotations

import abc
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import _packing


def as_bit_patterns(codes: jax.Array) -> jax.Array:
    """Codes of any 8-bit-or-narrower code dtype as uint8 bit patterns (float8 is bitcast)."""
    codes = jnp.asarray(codes)
    if jnp.issubdtype(codes.dtype, jnp.floating):
        if codes.dtype.itemsize != 1:
            raise TypeError(f"float codes must be a float8 dtype, got {codes.dtype}")
        return jax.lax.bitcast_convert_type(codes, jnp.uint8)
    return codes.astype(jnp.uint8)


def from_bit_patterns(patterns: jax.Array, code_dtype: np.dtype) -> jax.Array:
    """uint8 bit patterns to `code_dtype` (bitcast for float8, two's complement for int8)."""
    if np.dtype(code_dtype) == np.uint8:
        return patterns.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(patterns.astype(jnp.uint8), code_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format(abc.ABC):
    """A number format: a finite grid of real values with an exact code mapping.

    Attributes:
      name: registry name, e.g. ``"int4"``, ``"fp8_e4m3fn"``.
      bits: bits per code before packing (the width `pack` works with).
      overflow: what `encode` does with values past the largest magnitude: ``"saturate"``
        (clamp to the largest finite value) for every format in this library; documented here
        because the raw ``ml_dtypes`` casts of some formats give NaN/Inf instead.
      block_size: for block formats (MX, NVFP4), the number of consecutive elements along the
        quantized axis that share one scale; None for plain element formats.
      scale_encoding: how block scales are stored: ``"float"`` (a float array), ``"e8m0"``
        (power-of-two exponents, MX) or ``"e4m3"`` (float8_e4m3fn with an extra float32 tensor
        scale, NVFP4).
    """

    name: str
    bits: int
    overflow: str = "saturate"
    block_size: int | None = None
    scale_encoding: str = "float"

    @property
    def scales_in_codes(self) -> bool:
        """True when the codes carry their own scales (GGUF blocks): a QArray's `scale` is
        then a one-element placeholder, not part of the format's size."""
        return False

    @property
    def code_dtype(self) -> np.dtype:
        """dtype of the unpacked codes `encode` returns: uint8, where sub-byte codes sit before
        they are packed, unless a format says otherwise."""
        return np.dtype(np.uint8)

    @property
    @abc.abstractmethod
    def max_value(self) -> float:
        """Largest value on the grid; a scale maps a block's calibrated bound to this."""

    @property
    @abc.abstractmethod
    def min_value(self) -> float:
        """Smallest (most negative) value on the grid; 0 for unsigned formats."""

    @property
    def signed(self) -> bool:
        return self.min_value < 0

    @property
    def bits_per_value(self) -> float:
        """Storage bits per value once packed (element codes only, block scales excluded)."""
        return float(self.bits)

    @abc.abstractmethod
    def encode(self, y: jax.Array) -> jax.Array:
        """Round scaled values to the nearest grid value, saturating.

        Args:
          y: [...] float, values already divided by the scale (and offset by a zero point).
        Returns:
          [...] codes in `code_dtype`.
        """

    @abc.abstractmethod
    def decode(self, codes: jax.Array) -> jax.Array:
        """Codes to grid values.

        Args:
          codes: [...] in `code_dtype`.
        Returns:
          [...] float32 grid values.
        """

    # Storage: dense bit packing of sub-byte codes by default. A format with another storage
    # (e.g. base-3 ternary, 5 trits a byte) overrides these three together.
    def packed_length(self, n: int) -> int:
        """Bytes that `n` codes take along the packed axis."""
        return _packing.packed_length(n, self.bits)

    def pack(self, codes: jax.Array, axis: int) -> jax.Array:
        """codes: [..., n, ...] `code_dtype` → [..., packed_length(n), ...] uint8."""
        return _packing.pack(as_bit_patterns(codes), self.bits, axis)

    def unpack(self, packed: jax.Array, n: int, axis: int) -> jax.Array:
        """Inverse of `pack`: [..., packed_length(n), ...] uint8 → [..., n, ...] `code_dtype`."""
        return from_bit_patterns(_packing.unpack(packed, self.bits, n, axis), self.code_dtype)

    def codes(self) -> np.ndarray:
        """Every code that stands for a finite grid value, in `code_dtype` (NaN and Inf
        encodings and unused bit patterns left out); `encode(decode(codes()))` returns them."""
        return _finite_codes(self).copy()

    def levels(self) -> np.ndarray:
        """All finite grid values, sorted ascending and distinct, as float64 (for tests and
        stochastic rounding; safe to call while tracing)."""
        return _levels(self).copy()


def decode_constant(fmt: Format, codes: np.ndarray) -> np.ndarray:
    """`fmt.decode` of concrete codes as a NumPy array, even while tracing a jitted function."""
    with jax.ensure_compile_time_eval():
        return np.asarray(jax.jit(fmt.decode)(jnp.asarray(codes)))


# Formats are frozen and hashable, so their code tables are computed once per process (one
# compiled decode each, rather than one compilation per primitive in eager mode).
@functools.cache
def _finite_codes(fmt: Format) -> np.ndarray:
    patterns = np.arange(2**fmt.bits, dtype=np.uint16).astype(np.uint8)
    codes = patterns.view(fmt.code_dtype) if fmt.bits == 8 else patterns
    return codes[np.isfinite(decode_constant(fmt, codes))]


@functools.cache
def _levels(fmt: Format) -> np.ndarray:
    # + 0.0 turns -0.0 into +0.0, so the zero level is +0 in formats with signed zeros.
    return np.unique(decode_constant(fmt, fmt.codes()).astype(np.float64) + 0.0)
