"""The one table of formats by name. A new format is one module plus one entry here."""

from __future__ import annotations

from collections.abc import Iterator

from lowbit.formats import _block, _codebook, _float, _gguf, _integer, _ternary
from lowbit.formats._base import Format

_TABLE: tuple[Format, ...] = (
    # Integers: int1 (binary ±1) .. int8, uint1 .. uint8.
    *_integer.INT_FORMATS,
    *_integer.UINT_FORMATS,
    # Small floats, bit-identical to ml_dtypes.
    _float.FP8_E4M3FN,
    _float.FP8_E5M2,
    _float.FP8_E4M3FNUZ,
    _float.FP8_E5M2FNUZ,
    _float.FP6_E2M3,
    _float.FP6_E3M2,
    _float.FP4_E2M1,
    # Codebooks and ternary.
    _codebook.NF4,
    _ternary.TERNARY,
    _ternary.TERNARY_B3,
    # Block-scaled: OCP MX v1.0 and NVFP4.
    _block.MXFP8_E4M3,
    _block.MXFP8_E5M2,
    _block.MXFP6_E2M3,
    _block.MXFP6_E3M2,
    _block.MXFP4,
    _block.MXINT8,
    _block.NVFP4,
    # GGUF blocks stored as they are in a GGUF file (K-quants, Q5_0/Q5_1, IQ4_NL, TQ1_0/TQ2_0).
    *_gguf.GGUF_BLOCK_FORMATS,
)

FORMATS: dict[str, Format] = {f.name: f for f in _TABLE}
"""Canonical name → format. A `QArray` always records the canonical name."""

ALIASES: dict[str, str] = {
    "fp8": "fp8_e4m3fn",
    "e4m3": "fp8_e4m3fn",
    "e5m2": "fp8_e5m2",
    "fp4": "fp4_e2m1",
    "mxfp8": "mxfp8_e4m3",
    "binary": "int1",
}
"""Short names accepted by `get_format`, resolved to canonical names."""


def get_format(fmt: str | Format) -> Format:
    """Looks a format up by name or alias (or passes a `Format` through).

    Raises:
      ValueError: naming the unknown format and listing the accepted names.
      TypeError: if `fmt` is neither a str nor a Format.
    """
    if isinstance(fmt, Format):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(
            f"format must be a format name (str) or a Format, got {type(fmt).__name__}: "
            f"{fmt!r}; accepted names: {', '.join(sorted(FORMATS))}"
        )
    found = FORMATS.get(ALIASES.get(fmt, fmt))
    if found is None:
        aliases = ", ".join(f"{a} (= {n})" for a, n in sorted(ALIASES.items()))
        raise ValueError(
            f"unknown format {fmt!r}; accepted: {', '.join(sorted(FORMATS))}; aliases: {aliases}"
        )
    return found


def format_names() -> Iterator[str]:
    """Canonical format names, sorted (aliases are in `ALIASES`)."""
    return iter(sorted(FORMATS))
