"""N:M structured sparsity: magnitude pruning and compressed storage.

`nm_mask` keeps the `n` largest-magnitude entries of every run of `m` consecutive entries
along an axis (the contracted axis of a matmul weight, as sparse tensor cores read it).
`NMSparse` stores such a weight compressed: the kept values (a float array, or a `QArray` for
sparse int8 / fp8) with the axis shrunk to ``size * n / m``, plus index metadata: which `n`
of the `m` positions each group keeps, as one combination code per group (``C(m, n)`` codes:
3 bits for 2:4, bit-packed; two 2-bit indices would take 4). `nbytes` counts both.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import pack, unpack
from lowbit.qarray._qarray import QArray
from lowbit.qarray._value import EngineValue, NoRule


def _check(shape: tuple[int, ...], n: int, m: int, axis: int) -> int:
    for field, value in (("n", n), ("m", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"N:M sparsity: {field}={value!r}; accepted: an int >= 1")
    if n >= m:
        raise ValueError(f"N:M sparsity: n={n} must be below m={m} (e.g. 2:4)")
    if not -len(shape) <= axis < len(shape):
        raise ValueError(
            f"N:M sparsity: axis={axis} is out of range for shape {shape}; accepted: "
            f"[-{len(shape)}, {len(shape)})"
        )
    axis %= len(shape)
    if shape[axis] % m:
        divisors = [d for d in range(2, min(shape[axis], 16) + 1) if shape[axis] % d == 0]
        raise ValueError(
            f"N:M sparsity: m={m} does not divide axis {axis} of shape {shape} "
            f"(size {shape[axis]}); accepted: m dividing {shape[axis]}, e.g. {divisors[:6]}"
        )
    return axis


@functools.cache
def _combinations(n: int, m: int) -> np.ndarray:
    """[C(m, n), m] bool: row c marks the positions combination c keeps."""
    rows = [np.isin(np.arange(m), c) for c in itertools.combinations(range(m), n)]
    return np.stack(rows)


def meta_bits(n: int, m: int) -> int:
    """Bits per group of the index metadata: ceil(log2(C(m, n)))."""
    return max(1, math.ceil(math.log2(math.comb(m, n))))


def _groups(x: jax.Array, m: int, axis: int) -> jax.Array:
    """[..., size/m, m, ...] -> moved so groups are the last two axes: [rest..., G, m]."""
    moved = jnp.moveaxis(x, axis, -1)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // m, m)


def nm_mask(x: jax.Array, n: int = 2, m: int = 4, axis: int = 0) -> jax.Array:
    """Keeps the `n` largest |x| of each `m` consecutive entries along `axis` (ties: lower index).

    Args:
      x: [*shape] float.
      n, m: keep n of every m.
      axis: the axis the groups run along (a matmul weight's contracted axis).
    Returns:
      [*shape] bool mask with exactly n True per group.
    Raises:
      ValueError: if `m` does not divide the axis (naming it and the accepted values).
    """
    axis = _check(tuple(x.shape), n, m, axis)
    groups = _groups(jnp.abs(x.astype(jnp.float32)), m, axis)
    # Rank within the group: stable argsort of -|x| so ties keep the lower index.
    order = jnp.argsort(-groups, axis=-1, stable=True)
    ranks = jnp.argsort(order, axis=-1, stable=True)
    keep = ranks < n
    keep = keep.reshape(*keep.shape[:-2], -1)
    return jnp.moveaxis(keep, -1, axis)


@typing.final
@dataclasses.dataclass(frozen=True, eq=False)
class NMSparse(EngineValue):
    """An N:M sparse array in compressed form.

    Attributes:
      values: the kept entries, ``shape`` with ``shape[axis] * n / m`` along `axis`, in order;
        a float array or a `QArray` (sparse int8 / fp8).
      meta: uint8, the combination code of each group, `meta_bits(n, m)`-bit packed along
        `axis` (``packed_length(shape[axis] / m, bits)`` bytes there).
      shape: logical (dense) shape.
      dtype: logical dtype.
      axis, n, m: the sparsity pattern.
    """

    values: Any
    meta: jax.Array
    shape: tuple[int, ...]
    dtype: Any
    axis: int = 0
    n: int = 2
    m: int = 4

    # No sparse kernel exists here: every op dequantizes it to dense, counted, before anything
    # else sees it.
    engine_priority = 4

    def map_layout(self, qarray_fn: Any, float_fn: Any) -> Any:
        raise NoRule("is N:M sparse (compressed); it runs dense")

    def describe(self) -> str:
        return f"NMSparse({self.n}:{self.m}, shape={tuple(self.shape)})"

    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, **kwargs: Any) -> Any:
        raise NoRule("is N:M sparse and no sparse matmul kernel exists here: runs dense")

    def scan_parts(self, qarray_parts: Any) -> Any:
        raise NoRule("is N:M sparse (compressed)")

    @property
    def nbytes(self) -> int:
        """Stored bytes: values (codes and scales if quantized) plus index metadata."""
        values = self.values
        value_bytes = values.nbytes if isinstance(values, QArray) else int(values.nbytes)
        return int(value_bytes) + int(self.meta.size) * self.meta.dtype.itemsize

    def mask(self) -> jax.Array:
        """[*shape] bool: where the kept entries are."""
        bits = meta_bits(self.n, self.m)
        groups = self.shape[self.axis] // self.m
        codes = unpack(self.meta, bits, groups, axis=self.axis)
        table = jnp.asarray(_combinations(self.n, self.m))
        keep = table[jnp.moveaxis(codes, self.axis, -1).astype(jnp.int32)]  # [rest..., G, m]
        keep = keep.reshape(*keep.shape[:-2], -1)
        return jnp.moveaxis(keep, -1, self.axis)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The dense array (zeros where pruned)."""
        dtype = self.dtype if dtype is None else dtype
        values = self.values.dequantize() if isinstance(self.values, QArray) else self.values
        mask = self.mask()
        moved_mask = jnp.moveaxis(mask, self.axis, -1)
        kept = jnp.moveaxis(values, self.axis, -1)
        # Scatter the kept values back: position of each kept entry along the axis.
        positions = jnp.cumsum(moved_mask, axis=-1) - 1
        dense = jnp.take_along_axis(kept, jnp.clip(positions, 0, kept.shape[-1] - 1), axis=-1)
        dense = jnp.where(moved_mask, dense, jnp.zeros((), dense.dtype))
        return jnp.moveaxis(dense, -1, self.axis).astype(dtype)


jax.tree_util.register_dataclass(
    NMSparse, data_fields=["values", "meta"], meta_fields=["shape", "dtype", "axis", "n", "m"]
)


def nm_sparsify(
    x: jax.Array,
    n: int = 2,
    m: int = 4,
    axis: int = 0,
    *,
    quantize_values: Any = None,
    mask: jax.Array | None = None,
) -> NMSparse:
    """`lowbit.nm_sparsify`: prunes `x` to N:M along `axis` and compresses it.

    Args:
      x: [*shape] float (e.g. a kernel ``[in, out]``, pruned along ``in``).
      n, m: keep n of every m.
      axis: the contracted axis.
      quantize_values: optional function ``values -> QArray`` (e.g.
        ``lambda v: quantize(v, "int8", granularity=PerChannel((-1,)))``) for sparse int8 / fp8.
      mask: optional [*shape] bool keep mask with `n` of every `m` (e.g. chosen by SparseGPT or
        kept from sparse-aware training); default: the magnitude mask `nm_mask`.
    Returns:
      An `NMSparse`.
    Raises:
      ValueError: if `m` does not divide the axis, or `mask` is not an N:M mask of `x`.
    """
    axis = _check(tuple(x.shape), n, m, axis)
    if mask is None:
        keep = nm_mask(x, n, m, axis)
    else:
        keep = jnp.asarray(mask, bool)
        if keep.shape != x.shape:
            raise ValueError(f"mask shape {keep.shape} differs from the array's {x.shape}")
        counts = _groups(keep.astype(jnp.int32), m, axis).sum(-1)
        # Under a trace the count cannot be checked; a concrete mask always is.
        if not isinstance(counts, jax.core.Tracer) and not bool(jnp.all(counts == n)):
            raise ValueError(
                f"mask keeps other than n={n} of some group of m={m} along axis {axis}"
            )
    moved = jnp.moveaxis(x, axis, -1)
    moved_keep = jnp.moveaxis(keep, axis, -1)
    size = moved.shape[-1]
    # The kept entries in order: a stable sort of "pruned" flags moves them to the front.
    order = jnp.argsort(~moved_keep, axis=-1, stable=True)[..., : size * n // m]
    order = jnp.sort(order, axis=-1)
    values = jnp.moveaxis(jnp.take_along_axis(moved, order, axis=-1), -1, axis)
    # Combination code per group: index of the group's keep pattern in the table.
    table = jnp.asarray(_combinations(n, m))
    groups = moved_keep.reshape(*moved_keep.shape[:-1], size // m, m)
    codes = jnp.argmax(jnp.all(groups[..., None, :] == table, axis=-1), axis=-1)
    codes = jnp.moveaxis(codes.astype(jnp.uint8), -1, axis)
    meta = pack(codes, meta_bits(n, m), axis=axis)
    if quantize_values is not None:
        values = quantize_values(values)
    return NMSparse(
        values=values, meta=meta, shape=tuple(x.shape), dtype=x.dtype, axis=axis, n=n, m=m
    )
