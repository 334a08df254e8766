"""Embedding lookup on packed tables: gather packed rows and their scale rows.

`jnp.take(table, ids, axis=0)` (and `nnx.Embed`) lowers to a `gather` that indexes the row axis
with size-1 collapsed slices and takes every other axis whole. On a `QArray` the same gather
runs on the codes and, with indices divided by the block size, on the scales, so the table is
never dequantized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.engine import _compat
from lowbit.engine._layout_rules import LayoutUnsupported
from lowbit.qarray import QArray


def gather(q: QArray, indices: jax.Array, out_shape: Sequence[int], **params: Any) -> QArray:
    """Gathers whole rows: every operand axis is either indexed with a size-1 collapsed slice or
    taken whole. Codes and zero points are gathered with clamped indices; scales with the op's
    own mode, so an out-of-range row gets the op's fill value (NaN for `jnp.take`) through its
    scale, as the float gather would return.
    """
    dn = params["dimension_numbers"]
    slice_sizes = params["slice_sizes"]
    if tuple(getattr(dn, "operand_batching_dims", ())):
        raise LayoutUnsupported("gathers with batching dimensions")
    indexed = tuple(dn.start_index_map)
    if q.input_scale is not None and any(q.input_scale.shape[a] != 1 for a in indexed):
        raise LayoutUnsupported("gathers along an axis its input_scale varies on")
    for axis in range(q.ndim):
        if axis in indexed:
            if slice_sizes[axis] != 1 or axis not in dn.collapsed_slice_dims:
                raise LayoutUnsupported(f"gathers windows of {slice_sizes[axis]} along axis {axis}")
            if axis == q.packed_axis:
                raise LayoutUnsupported("gathers along the packed axis")
        elif slice_sizes[axis] != q.shape[axis]:
            raise LayoutUnsupported(f"gathers part of axis {axis}")
    blocks = jnp.asarray([q.block_shape[a] for a in indexed], indices.dtype)
    scale_indices = jnp.floor_divide(indices, blocks)
    fill = _compat.is_fill_mode(params["mode"])
    scale, encoding, tensor_scale = q.scale, q.scale_encoding, q.tensor_scale
    if fill:
        # Fill values must be representable: gather decoded float32 scales (tensor scale folded).
        scale, encoding, tensor_scale = q.scale_values(), "float", None

    def take(array, idx, sizes, mode, fill_value=None):
        return jax.lax.gather(
            array,
            idx,
            dn,
            tuple(sizes),
            indices_are_sorted=params["indices_are_sorted"],
            unique_indices=params["unique_indices"],
            mode=mode,
            fill_value=fill_value,
        )

    code_sizes = list(slice_sizes)
    if q.packed_axis is not None:
        code_sizes[q.packed_axis] = q.codes.shape[q.packed_axis]
    scale_sizes = [1 if a in indexed else q.scale.shape[a] for a in range(q.ndim)]
    safe_mode = jax.lax.GatherScatterMode.CLIP if fill else params["mode"]
    fill_value = params["fill_value"] if params["fill_value"] is not None else float("nan")
    offset_axes = [a for a in range(q.ndim) if a not in dn.collapsed_slice_dims]
    packed_axis = None
    if q.packed_axis is not None:
        packed_axis = dn.offset_dims[offset_axes.index(q.packed_axis)]
    zero_point = q.zero_point
    if zero_point is not None:
        zero_point = take(zero_point, scale_indices, scale_sizes, safe_mode)
    return dataclasses.replace(
        q,
        codes=take(q.codes, indices, code_sizes, safe_mode),
        scale=take(scale, scale_indices, scale_sizes, params["mode"], fill_value if fill else None),
        zero_point=zero_point,
        tensor_scale=_reshaped_tensor_scale(
            dataclasses.replace(q, tensor_scale=tensor_scale), len(out_shape)
        ),
        input_scale=_gathered_input_scale(q, offset_axes, dn.offset_dims, len(out_shape)),
        shape=tuple(int(n) for n in out_shape),
        packed_axis=packed_axis,
        scale_encoding=encoding,
    )


def _gathered_input_scale(
    q: QArray, offset_axes: Sequence[int], offset_dims: Sequence[int], ndim: int
) -> jax.Array | None:
    """The input scale of the gathered rows: 1 along the indexed axes (checked), so it keeps
    its entries along the axes taken whole, now at their output positions (in order)."""
    if q.input_scale is None:
        return None
    shape = [1] * ndim
    for axis, out_axis in zip(offset_axes, offset_dims, strict=True):
        shape[out_axis] = q.input_scale.shape[axis]
    return q.input_scale.reshape(shape)


def _reshaped_tensor_scale(q: QArray, ndim: int) -> jax.Array | None:
    return None if q.tensor_scale is None else q.tensor_scale.reshape((1,) * ndim)
