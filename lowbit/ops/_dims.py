"""Dimension-number bookkeeping shared by the quantized dot ops.

`lax.dot_general` dimension numbers are `((lhs_contracting, rhs_contracting), (lhs_batch,
rhs_batch))`; its output is laid out as `[batch..., lhs_free..., rhs_free...]` with each group in
operand order. Per-side arrays that must meet the output (scales, zero points, sums of codes) are
moved into that layout by `side_to_output`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

DimensionNumbers = tuple[
    tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]
]


def normalize(
    dimension_numbers, lhs_shape: Sequence[int], rhs_shape: Sequence[int]
) -> DimensionNumbers:
    """Canonical dimension numbers: tuples of non-negative ints.

    Raises:
      ValueError: if the structure is not `((lc, rc), (lb, rb))`, an axis is out of range, or
        paired axes differ in size.
    """
    lhs_ndim, rhs_ndim = len(lhs_shape), len(rhs_shape)
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(a) for a in axes) for axes in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
            f"rhs_batch)), got {dimension_numbers!r}"
        ) from None
    for axes, ndim, what in (
        (lc, lhs_ndim, "lhs"),
        (lb, lhs_ndim, "lhs"),
        (rc, rhs_ndim, "rhs"),
        (rb, rhs_ndim, "rhs"),
    ):
        if any(not -ndim <= a < ndim for a in axes):
            raise ValueError(
                f"dimension_numbers {dimension_numbers!r}: {what} axis out of range for ndim {ndim}"
            )
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            f"dimension_numbers {dimension_numbers!r}: lhs and rhs lists differ in length"
        )
    lc, lb = tuple(a % lhs_ndim for a in lc), tuple(a % lhs_ndim for a in lb)
    rc, rb = tuple(a % rhs_ndim for a in rc), tuple(a % rhs_ndim for a in rb)
    for la, ra in zip(lc + lb, rc + rb, strict=True):
        if lhs_shape[la] != rhs_shape[ra]:
            raise ValueError(
                f"dimension_numbers {dimension_numbers!r} pair lhs axis {la} (size "
                f"{lhs_shape[la]}) with rhs axis {ra} (size {rhs_shape[ra]}); shapes "
                f"{tuple(lhs_shape)} and {tuple(rhs_shape)}"
            )
    return (lc, rc), (lb, rb)


def free_axes(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    """Axes that are neither contracted nor batched, in order."""
    used = set(contracting) | set(batch)
    return tuple(a for a in range(ndim) if a not in used)


def swap(dimension_numbers: DimensionNumbers) -> DimensionNumbers:
    """Dimension numbers with the operands exchanged."""
    (lc, rc), (lb, rb) = dimension_numbers
    return (rc, lc), (rb, lb)


def expand_axis(a: jax.Array, axis: int, size: int) -> jax.Array:
    """Repeats blocks along `axis` so it has `size` entries (kept at 1 if it is 1)."""
    n = a.shape[axis]
    if n in (1, size):
        return a
    return jnp.repeat(a, size // n, axis=axis)


def split_axes(a: jax.Array, groups: dict[int, int]) -> jax.Array:
    """Splits each `axis: G` of `groups`: [..., K, ...] → [..., G, K // G, ...]."""
    shape = []
    for ax, n in enumerate(a.shape):
        shape += [groups[ax], n // groups[ax]] if ax in groups else [n]
    return a.reshape(shape)


def grouped_dimension_numbers(
    dimension_numbers: DimensionNumbers, groups: dict[int, int]
) -> DimensionNumbers:
    """Dimension numbers after `split_axes` of the contracting pairs in `groups` (pair index →
    number of groups) on both operands.

    The group parts become the leading batch dimensions, in pair order (so they lead the
    output), and the within-group parts stay contracted.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    pairs = sorted(groups)

    def side(contracting, batch):
        split = {contracting[p] for p in pairs}
        new = lambda a: a + sum(1 for s in split if s < a)
        inner = lambda a: new(a) + 1 if a in split else new(a)
        return (
            tuple(inner(a) for a in contracting),
            tuple(new(contracting[p]) for p in pairs) + tuple(new(a) for a in batch),
        )

    (new_lc, new_lb), (new_rc, new_rb) = side(lc, lb), side(rc, rb)
    return (new_lc, new_rc), (new_lb, new_rb)


def side_to_output(
    a: jax.Array,
    shape: Sequence[int],
    contracting: Sequence[int],
    batch: Sequence[int],
    groups: dict[int, int],
    other_free: int,
    is_lhs: bool,
) -> jax.Array:
    """Moves a per-block array of one operand into the (grouped) dot output layout.

    Args:
      a: [s_0, ..., s_{n-1}] per-block values of an operand of `shape` (scale, zero point, or a
        sum of codes); size 1 along every contracting axis not in `groups`.
      shape: the operand's logical shape.
      contracting, batch: the operand's axes in the dot.
      groups: {contracting axis of this operand: number of groups}, in pair order; empty when
        the dot is not grouped.
      other_free: number of free axes of the other operand.
      is_lhs: whether the operand is the lhs (its free axes come first in the output).
    Returns:
      [G..., batch..., lhs_free or 1s..., rhs_free or 1s...], broadcastable against the output
      of the grouped dot.
    """
    free = free_axes(len(shape), contracting, batch)
    for ax in (*batch, *free):
        a = expand_axis(a, ax, shape[ax])
    for ax, count in groups.items():
        a = expand_axis(a, ax, count)
    order = list(groups) + list(batch) + list(free)
    dropped = [ax for ax in contracting if ax not in groups]
    a = jnp.transpose(a, order + dropped)
    a = a.reshape(a.shape[: len(order)])
    ones = (1,) * other_free
    lead = a.shape[: len(order) - len(free)]
    own = a.shape[len(order) - len(free) :]
    return a.reshape(lead + own + ones if is_lhs else lead + ones + own)


def contracted_size(shape: Sequence[int], contracting: Sequence[int]) -> int:
    return int(np.prod([shape[a] for a in contracting], dtype=np.int64))
