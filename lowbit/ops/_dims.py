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

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


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
    for axes, ndim, what in ((lc, lhs_ndim, "lhs"), (lb, lhs_ndim, "lhs"), (rc, rhs_ndim, "rhs"),
                             (rb, rhs_ndim, "rhs")):
        if any(not -ndim <= a < ndim for a in axes):
            raise ValueError(f"dimension_numbers {dimension_numbers!r}: {what} axis out of range "
                             f"for ndim {ndim}")
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"dimension_numbers {dimension_numbers!r}: lhs and rhs lists differ in length")
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


def split_axis(a: jax.Array, axis: int, groups: int) -> jax.Array:
    """[..., K, ...] → [..., groups, K // groups, ...] at `axis`."""
    shape = a.shape[:axis] + (groups, a.shape[axis] // groups) + a.shape[axis + 1 :]
    return a.reshape(shape)


def grouped_dimension_numbers(
    dimension_numbers: DimensionNumbers, pair: int
) -> DimensionNumbers:
    """Dimension numbers after `split_axis` of the `pair`-th contracting axes of both operands.

    The group part becomes the leading batch dimension (so it leads the output) and the
    within-group part stays contracted.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    la, ra = lc[pair], rc[pair]
    shift_l = lambda a: a + 1 if a > la else a
    shift_r = lambda a: a + 1 if a > ra else a
    new_lc = tuple(la + 1 if a == la else shift_l(a) for a in lc)
    new_rc = tuple(ra + 1 if a == ra else shift_r(a) for a in rc)
    new_lb = (la,) + tuple(shift_l(a) for a in lb)
    new_rb = (ra,) + tuple(shift_r(a) for a in rb)
    return (new_lc, new_rc), (new_lb, new_rb)


def side_to_output(
    a: jax.Array,
    shape: Sequence[int],
    contracting: Sequence[int],
    batch: Sequence[int],
    group_axis: int | None,
    groups: int,
    other_free: int,
    is_lhs: bool,
) -> jax.Array:
    """Moves a per-block array of one operand into the (grouped) dot output layout.

    Args:
      a: [s_0, ..., s_{n-1}] per-block values of an operand of `shape` (scale, zero point, or a
        sum of codes); size 1 along every contracting axis except `group_axis`.
      shape: the operand's logical shape.
      contracting, batch: the operand's axes in the dot.
      group_axis: the contracting axis split into groups, or None when the dot is not grouped.
      groups: number of groups (ignored when `group_axis` is None).
      other_free: number of free axes of the other operand.
      is_lhs: whether the operand is the lhs (its free axes come first in the output).
    Returns:
      [G?, batch..., lhs_free or 1s..., rhs_free or 1s...], broadcastable against the output of
      the grouped dot (G present only when `group_axis` is not None).
    """
    free = free_axes(len(shape), contracting, batch)
    for ax in (*batch, *free):
        a = expand_axis(a, ax, shape[ax])
    order = list(batch) + list(free)
    if group_axis is not None:
        a = expand_axis(a, group_axis, groups)
        order = [group_axis] + order
    dropped = [ax for ax in contracting if ax != group_axis]
    a = jnp.transpose(a, order + dropped)
    a = a.reshape(a.shape[: len(order)])
    ones = (1,) * other_free
    lead = a.shape[: len(order) - len(free)]
    own = a.shape[len(order) - len(free) :]
    return a.reshape(lead + own + ones if is_lhs else lead + ones + own)


def varying_axes(block_array_shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """Which of `axes` a per-block array varies along (size > 1)."""
    return tuple(a for a in axes if block_array_shape[a] != 1)


def contracted_size(shape: Sequence[int], contracting: Sequence[int]) -> int:
    return int(np.prod([shape[a] for a in contracting], dtype=np.int64))
