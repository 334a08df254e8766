"""Rounding onto a QArray's fixed grid: the scales of a round-to-nearest quantization, per element.

The algorithms choose codes, never scales' layout: they start from the RTN `QArray` of the
recipe's config (scales, zero points, packing) and replace its codes (GPTQ) or its zero points
(HQQ). `encode` repeats `lowbit.qarray.quantize`'s element math exactly, so a weight whose
codes the algorithm does not change gets RTN's codes bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowbit.formats import Format
from lowbit.qarray import QArray, broadcast_blocks


@dataclasses.dataclass(frozen=True)
class Grid:
    """Per-element scale and zero point of a QArray, in its logical shape (float32)."""

    scale: jax.Array
    zero_point: jax.Array | None
    symmetric: bool


def grid_of(q: QArray) -> Grid:
    scale = broadcast_blocks(q.scale_values(), q.shape)
    scale = jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 1.0)
    zp = (
        None
        if q.zero_point is None
        else broadcast_blocks(q.zero_point.astype(jnp.float32), q.shape)
    )
    return Grid(scale, zp, q.zero_point is None)


def encode(
    fmt: Format,
    x: jax.Array,
    scale: jax.Array,
    zero_point,
    symmetric: bool,
    *,
    full_range: bool = False,
) -> jax.Array:
    """Codes of `x` on the grid (as `quantize` computes them).

    With `full_range`, a symmetric grid also reaches the format's levels below
    ``-max_value`` (int4's -8), which `quantize` leaves unused.
    """
    y = x / scale
    if zero_point is not None:
        y = y + zero_point
    y = jnp.where(jnp.isnan(y), 0.0, y)
    if symmetric:
        y = jnp.clip(y, lowest(fmt, full_range), fmt.max_value)
    return fmt.encode(y)


def lowest(fmt: Format, full_range: bool) -> float:
    """The lowest level a symmetric grid rounds to."""
    return float(fmt.levels().min()) if full_range else -fmt.max_value


def decode(fmt: Format, codes: jax.Array, scale: jax.Array, zero_point) -> jax.Array:
    values = fmt.decode(codes)
    if zero_point is not None:
        values = values - zero_point
    return values * scale


def with_codes(q: QArray, codes: jax.Array) -> QArray:
    """`q` with new unpacked codes ([*q.shape], the format's code dtype), packed like `q`'s."""
    codes = codes.astype(q.codes.dtype) if q.packed_axis is None else codes
    if q.packed_axis is not None:
        codes = q.fmt.pack(codes, q.packed_axis)
    return dataclasses.replace(q, codes=codes)
