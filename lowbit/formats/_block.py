"""Block-scaled formats: OCP Microscaling (MX v1.0) and NVFP4.

A block format is an element format plus a block rule: `block_size` consecutive elements along
the quantized axis share one scale, stored as `scale_encoding`. Encode, decode and packing are
the element's; the scale selection lives in `lowbit.qarray.quantize`:

  MX (scale "e8m0"): X = 2**(floor(log2 amax) - emax_elem), emax_elem = floor(log2 max_value)
    of the element, clamped to the E8M0 range [2**-127, 2**127]; elements = encode(x / X),
    saturating (amax / X can reach just under 2**(emax_elem + 1) > max_value).
  NVFP4 (scale "e4m3"): a float32 tensor scale T = amax(tensor) / (6 * 448), block scales
    s = e4m3(amax(block) / 6 / T), elements = encode(x / (s * T)).

  name         element                          block  scale  bits/value incl. scale
  mxfp8_e4m3   fp8_e4m3fn                        32    e8m0   8.25
  mxfp8_e5m2   fp8_e5m2                          32    e8m0   8.25
  mxfp6_e2m3   fp6_e2m3                          32    e8m0   6.25
  mxfp6_e3m2   fp6_e3m2                          32    e8m0   6.25
  mxfp4        fp4_e2m1                          32    e8m0   4.25
  mxint8       int8 with 6 fraction bits (k/64)  32    e8m0   8.25
  nvfp4        fp4_e2m1                          16    e4m3   4.5 (+ one float32 per tensor)
"""

from __future__ import annotations

import dataclasses

from lowbit.formats._base import Format
from lowbit.formats._float import FP4_E2M1, FP6_E2M3, FP6_E3M2, FP8_E4M3FN, FP8_E5M2
from lowbit.formats._integer import MXINT8_ELEMENT

BLOCK_SCALE_ENCODINGS = ("e8m0", "e4m3")


def _element_attribute(name: str) -> property:
    """A block format's `name`: its element format's (a value, or a bound method)."""
    return property(lambda self: getattr(self.element, name), doc=f"The element format's `{name}`.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockFormat(Format):
    """An element format whose values share one scale per `block_size` elements.

    Attributes:
      element: the element format (its encode/decode/pack are used as they are).
    """

    element: Format

    def __post_init__(self):
        if self.bits != self.element.bits:
            raise ValueError(
                f"format {self.name!r}: bits={self.bits} differs from its element "
                f"{self.element.name!r} ({self.element.bits} bits)"
            )
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"format {self.name!r}: block_size must be a positive int")
        if self.scale_encoding not in BLOCK_SCALE_ENCODINGS:
            raise ValueError(
                f"format {self.name!r}: scale_encoding={self.scale_encoding!r}; accepted: "
                f"{BLOCK_SCALE_ENCODINGS}"
            )

    # A value's grid, rounding and packing are the element's; only the scale rule is the block's.
    code_dtype = _element_attribute("code_dtype")
    max_value = _element_attribute("max_value")
    min_value = _element_attribute("min_value")
    bits_per_value = _element_attribute("bits_per_value")
    encode = _element_attribute("encode")
    decode = _element_attribute("decode")
    packed_length = _element_attribute("packed_length")
    pack = _element_attribute("pack")
    unpack = _element_attribute("unpack")
    codes = _element_attribute("codes")


def _block(name: str, element: Format, block_size: int, scale_encoding: str) -> BlockFormat:
    return BlockFormat(
        name=name,
        bits=element.bits,
        element=element,
        block_size=block_size,
        scale_encoding=scale_encoding,
    )


MXFP8_E4M3 = _block("mxfp8_e4m3", FP8_E4M3FN, 32, "e8m0")
MXFP8_E5M2 = _block("mxfp8_e5m2", FP8_E5M2, 32, "e8m0")
MXFP6_E2M3 = _block("mxfp6_e2m3", FP6_E2M3, 32, "e8m0")
MXFP6_E3M2 = _block("mxfp6_e3m2", FP6_E3M2, 32, "e8m0")
MXFP4 = _block("mxfp4", FP4_E2M1, 32, "e8m0")
MXINT8 = _block("mxint8", MXINT8_ELEMENT, 32, "e8m0")
NVFP4 = _block("nvfp4", FP4_E2M1, 16, "e4m3")
