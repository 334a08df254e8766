"""How the accelerator kernels read a weight-only QArray: its static layout and its codes.

Shared by the Triton (CUDA) and Mosaic (TPU) bodies of `lowbit.kernels.pallas`: which weights
they read (`layout_of`), the operands they take as stored (`weight_operands`), and the decoding
of 4- and 8-bit codes to values inside a kernel (`decode_codes`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowbit.formats import get_format
from lowbit.qarray import QArray, broadcast_blocks

PALLAS_FORMATS = ("int4", "uint4", "nf4", "int8")
"""Weight formats the weight-only kernels read."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a kernel needs to know about a weight: static, hashable.

    kind: one of PALLAS_FORMATS. k, n: logical weight shape. groups: scale rows G (K / G
    elements each; 1 per channel). packed: "k", "n" or None (int8: unpacked).
    zero: has a zero point.
    """

    kind: str
    k: int
    n: int
    groups: int
    packed: str | None
    zero: bool

    @property
    def group(self) -> int:
        """K elements per scale row."""
        return self.k // self.groups


def layout_of(q: QArray) -> Layout | None:
    """The kernels' view of a weight-only QArray `[K, N]`, or None if they cannot read it.

    Scales must vary along K in groups (or not at all) and along N per column or not at all;
    the packed axis must be 0 or 1 with two codes a byte.
    """
    if q.ndim != 2 or q.format not in PALLAS_FORMATS or q.activation is not None:
        return None
    if q.input_scale is not None and q.input_scale.shape[1] != 1:
        return None
    k, n = q.shape
    groups, scale_n = q.scale.shape
    if scale_n not in (1, n) or k % groups:
        return None
    packed = {None: None, 0: "k", 1: "n"}.get(q.packed_axis, "bad")
    if packed == "bad" or (q.format == "int8") != (packed is None):
        return None
    return Layout(q.format, k, n, groups, packed, q.zero_point is not None)


def weight_operands(q: QArray, layout: Layout) -> list[jax.Array]:
    """codes, scale [G, N] (and zero point [G, N]) as the kernels read them.

    Stored float scales go in as they are (the kernels convert them); E8M0 / E4M3 scales and
    tensor scales are decoded first (`scale_values`, G x N floats: small next to the codes).
    Scales that do not vary along N are broadcast to one per column.
    """
    plain = q.scale_encoding == "float" and q.tensor_scale is None
    scale = q.scale if plain else q.scale_values()
    shape = (layout.groups, layout.n)
    operands = [q.codes, broadcast_blocks(scale, shape)]
    if layout.zero:
        operands.append(broadcast_blocks(q.zero_point, shape))
    return operands


def _nf4_table() -> tuple[float, ...]:
    return tuple(float(v) for v in get_format("nf4").values)


# Exponent bits of a float whose mantissa's low bits hold a small integer m exactly:
# bits(F) | m is the float F + m (F = 2**23 for float32, 2**7 for bfloat16, whose 7 mantissa
# bits hold a nibble). An OR and a subtraction turn a code into its value, instead of an
# integer-to-float conversion (a quarter of the ALU rate on NVIDIA GPUs) and a narrowing:
# on an H200, int4 at M = 1 (8192 x 8192) went from 0.0313 to 0.0282 ms.
_MAGIC = {jnp.dtype(jnp.float32): (0x4B000000, 2.0**23), jnp.dtype(jnp.bfloat16): (0x4300, 128.0)}


def decode_codes(
    codes: jax.Array, kind: str, dtype=jnp.float32, *, exponent_trick: bool = True
) -> jax.Array:
    """4-bit / 8-bit codes (int32, one a value) to their grid values in `dtype`.

    int4 / uint4 nibbles go through the exponent trick above (`_MAGIC`) when
    `exponent_trick`: exact, since the values are small integers; without it (TPU, whose
    vector units convert at full rate), a plain conversion. NF4's 16 levels are a 4-level
    select tree on the code's bits rather than a table lookup: neither Triton nor Mosaic has
    a gather from a small constant table, and selects cost one op a level.
    """
    dtype = jnp.dtype(dtype)
    if kind in ("int4", "uint4") and dtype in _MAGIC and exponent_trick:
        # int4: flipping the sign bit maps the two's complement nibble n to n + 8 (0..15).
        unsigned, offset = (codes ^ 8, 8.0) if kind == "int4" else (codes, 0.0)
        bits, base = _MAGIC[dtype]
        int_type = jnp.int32 if dtype == jnp.float32 else jnp.int16
        floats = jax.lax.bitcast_convert_type((unsigned | bits).astype(int_type), dtype)
        return floats - jnp.asarray(base + offset, dtype)
    if kind in ("int4", "uint4", "int8"):
        values = ((codes ^ 8) - 8) if kind == "int4" else codes
        return values.astype(jnp.float32).astype(dtype)
    levels = [jnp.float32(v) for v in _nf4_table()]
    for bit in range(4):
        take_high = (codes & (1 << bit)) != 0
        levels = [
            jnp.where(take_high, high, low)
            for low, high in zip(levels[0::2], levels[1::2], strict=True)
        ]
    return jnp.broadcast_to(levels[0], codes.shape).astype(dtype)
