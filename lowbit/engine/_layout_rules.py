"""Layout ops on packed values: the same op applied to codes, scales and zero points.

A `QArray`'s scale has one entry per block along every axis (`block = shape // scale.shape`), so
a layout op stays exact on packed values when it moves whole blocks: transposes always do, reshapes
when blocks stay contiguous runs of the merged or split axes, slices when they start and end on
block boundaries. Along the packed axis an op must also keep whole byte groups (e.g. 2 int4 codes a
byte). Each function here either returns the new `QArray` or raises `LayoutUnsupported` with the
reason, and the interpreter then dequantizes (counted) or, in strict mode, raises.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.engine import _compat
from lowbit.engine._values import NoRule
from lowbit.qarray import QArray


class LayoutUnsupported(NoRule):
    """A layout op that cannot move whole blocks / byte groups of this QArray."""


def _byte_group(q: QArray) -> tuple[int, int]:
    """(codes, bytes) of the smallest run of codes that fills whole bytes along the packed axis.

    Read off the format's `packed_length`, so formats with their own storage (not dense bit
    packing) are handled alike.
    """
    if q.packed_axis is None:
        return 1, 1
    fmt = q.fmt
    first = fmt.packed_length(1)
    per_group = 1
    while per_group < 64 and fmt.packed_length(per_group + 1) == first:
        per_group += 1
    return per_group, first


def codes_per_group(q: QArray) -> int:
    return _byte_group(q)[0]


def _bytes_per_group(q: QArray) -> int:
    return _byte_group(q)[1]


def _map_scales(q: QArray, fn) -> dict[str, Any]:
    """Applies `fn` to scale and zero point; the tensor scale is only re-shaped by callers."""
    zero_point = None if q.zero_point is None else fn(q.zero_point)
    return {"scale": fn(q.scale), "zero_point": zero_point}


def _tensor_scale(q: QArray, ndim: int) -> jax.Array | None:
    return None if q.tensor_scale is None else q.tensor_scale.reshape((1,) * ndim)


# --- input_scale: each axis 1 or the full axis (QArray's invariant), kept so by every op ---
def _reshaped_input_scale(q: QArray, new_shape: tuple[int, ...]) -> jax.Array | None:
    """The input scale for `q` reshaped to `new_shape`: a group of merged or split axes (see
    `_groups`) keeps 1s when the scale is constant over all of it, else is spelled out in full
    over the group (the same values, each new axis full)."""
    s = q.input_scale
    if s is None:
        return None
    old_core = [n for n in q.shape if n != 1]
    s = jnp.squeeze(s, axis=tuple(i for i, n in enumerate(q.shape) if n == 1))
    target = [n for n in new_shape if n != 1]
    full_shape, core_shape = [], []
    for olds, news in _groups(old_core, target):
        varies = any(s.shape[i] != 1 for i in olds)
        full_shape += [old_core[i] if varies else 1 for i in olds]
        core_shape += [target[j] if varies else 1 for j in news]
    core = jnp.broadcast_to(s, full_shape).reshape(core_shape)
    out_shape, axes = [1] * len(new_shape), iter(core_shape)
    for i, n in enumerate(new_shape):
        if n != 1:
            out_shape[i] = next(axes)
    return core.reshape(out_shape)


def _window_input_scale(q: QArray, starts: Sequence[Any], sizes: Sequence[int]):
    """The input scale of a window: cut along the axes it varies on, kept (1) elsewhere."""
    s = q.input_scale
    if s is None:
        return None
    full = [s.shape[a] != 1 for a in range(q.ndim)]
    return jax.lax.dynamic_slice(
        s,
        [jnp.asarray(st if f else 0, jnp.int32) for st, f in zip(starts, full, strict=True)],
        [sz if f else 1 for sz, f in zip(sizes, full, strict=True)],
    )


def transpose(q: QArray, permutation: Sequence[int]) -> QArray:
    return q.transpose(tuple(permutation))


def astype(q: QArray, dtype: Any) -> QArray:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise LayoutUnsupported(f"converts to non-float dtype {np.dtype(dtype).name}")
    return q.astype(dtype)


# --- reshape ---
def _groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[range, range]]:
    """Pairs of old/new axis ranges with equal products (no size-1 axes in either shape)."""
    groups, i, j = [], 0, 0
    while i < len(old):
        a, b, pa, pb = i, j, old[i], new[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= old[i]
                i += 1
            else:
                pb *= new[j]
                j += 1
        groups.append((range(a, i), range(b, j)))
    return groups


def _merged_scale_count(dims: list[int], counts: list[int]) -> int:
    """Scale entries of the merged axis, or raise when blocks are not contiguous runs."""
    blocks = [d // s for d, s in zip(dims, counts, strict=True)]
    k = next((i for i, t in enumerate(blocks) if t != 1), len(dims) - 1)
    if any(s != 1 for s in counts[k + 1 :]):
        raise LayoutUnsupported(f"merges axes {dims} whose blocks {blocks} are not contiguous")
    return math.prod(counts[: k + 1])


def _split_scale_counts(size: int, count: int, dims: list[int]) -> list[int]:
    """Scale entries of each axis `size` (with `count` blocks) is split into, or raise."""
    block, inner, out = size // count, 1, [0] * len(dims)
    idx = len(dims) - 1
    while idx >= 0 and block % (inner * dims[idx]) == 0:
        inner *= dims[idx]
        out[idx] = 1
        idx -= 1
    if idx >= 0:
        rest = block // inner
        if dims[idx] % rest:
            raise LayoutUnsupported(f"splits blocks of {block} across axes {dims}")
        out[idx] = dims[idx] // rest
        for i in range(idx):
            out[i] = dims[i]
    return out


def _reshape_nonunit(q: QArray, target: tuple[int, ...]) -> QArray:
    old, counts = list(q.shape), list(q.scale.shape)
    scale_shape, codes_shape, packed_axis = [], [], None
    for olds, news in _groups(old, list(target)):
        dims = [target[j] for j in news]
        if len(olds) == 1 and len(news) == 1:
            scale_shape.append(counts[olds[0]])
            codes_shape.append(q.codes.shape[olds[0]])
            if q.packed_axis == olds[0]:
                packed_axis = news[0]
            continue
        merged = _merged_scale_count([old[i] for i in olds], [counts[i] for i in olds])
        scale_shape += _split_scale_counts(math.prod(dims), merged, dims)
        group_codes = list(dims)
        if q.packed_axis in olds:
            per_group = codes_per_group(q)
            if q.packed_axis != olds[-1] or old[olds[-1]] % per_group or dims[-1] % per_group:
                raise LayoutUnsupported("reshapes the packed axis across byte groups")
            group_codes[-1] = q.fmt.packed_length(dims[-1])
            packed_axis = news[-1]
        codes_shape += group_codes
    return dataclasses.replace(
        q,
        codes=q.codes.reshape(codes_shape),
        **_map_scales(q, lambda a: a.reshape(scale_shape)),
        tensor_scale=_tensor_scale(q, len(target)),
        shape=target,
        packed_axis=packed_axis,
    )


def reshape(q: QArray, new_shape: Sequence[int]) -> QArray:
    """Reshape (also squeeze / expand_dims): drop size-1 axes, regroup, insert size-1 axes."""
    new_shape = tuple(int(n) for n in new_shape)
    if new_shape == q.shape:
        return q
    if math.prod(new_shape) != q.size:
        raise LayoutUnsupported(f"cannot reshape {q.shape} to {new_shape}")
    ones = [i for i, n in enumerate(q.shape) if n == 1]
    if q.packed_axis in ones:
        raise LayoutUnsupported("squeezes the packed axis")
    kept = [i for i in range(q.ndim) if i not in ones]
    core_shape = tuple(q.shape[i] for i in kept)
    input_scale = _reshaped_input_scale(q, new_shape)
    squeezed = dataclasses.replace(
        q,
        input_scale=None,  # reshaped in one step above
        codes=jnp.squeeze(q.codes, axis=tuple(ones)),
        **_map_scales(q, lambda a: jnp.squeeze(a, axis=tuple(ones))),
        tensor_scale=_tensor_scale(q, len(kept)),
        shape=core_shape,
        packed_axis=None if q.packed_axis is None else kept.index(q.packed_axis),
    )
    target = tuple(n for n in new_shape if n != 1)
    core = _reshape_nonunit(squeezed, target) if target != core_shape else squeezed
    positions = [i for i, n in enumerate(new_shape) if n != 1]
    codes_shape = [1] * len(new_shape)
    scale_shape = [1] * len(new_shape)
    for axis, position in enumerate(positions):
        codes_shape[position] = core.codes.shape[axis]
        scale_shape[position] = core.scale.shape[axis]
    return dataclasses.replace(
        core,
        codes=core.codes.reshape(codes_shape),
        **_map_scales(core, lambda a: a.reshape(scale_shape)),
        tensor_scale=_tensor_scale(core, len(new_shape)),
        input_scale=input_scale,
        shape=new_shape,
        packed_axis=None if core.packed_axis is None else positions[core.packed_axis],
    )


def broadcast_in_dim(
    q: QArray, shape: Sequence[int], broadcast_dimensions: Sequence[int]
) -> QArray:
    """Adds axes (and broadcasts size-1 axes) to codes and scales; new axes get one scale."""
    shape = tuple(int(n) for n in shape)
    codes_shape, scale_shape = list(shape), [1] * len(shape)
    input_scale_shape = [1] * len(shape)
    for axis, out_axis in enumerate(broadcast_dimensions):
        if q.shape[axis] == shape[out_axis]:
            codes_shape[out_axis] = q.codes.shape[axis]
            scale_shape[out_axis] = q.scale.shape[axis]
            if q.input_scale is not None:
                input_scale_shape[out_axis] = q.input_scale.shape[axis]
        elif axis == q.packed_axis:
            raise LayoutUnsupported("broadcasts the packed axis")
    dims = tuple(broadcast_dimensions)
    return dataclasses.replace(
        q,
        codes=jax.lax.broadcast_in_dim(q.codes, codes_shape, dims),
        **_map_scales(q, lambda a: jax.lax.broadcast_in_dim(a, scale_shape, dims)),
        tensor_scale=_tensor_scale(q, len(shape)),
        input_scale=None
        if q.input_scale is None
        else jax.lax.broadcast_in_dim(q.input_scale, input_scale_shape, dims),
        shape=shape,
        packed_axis=None if q.packed_axis is None else dims[q.packed_axis],
    )


# --- slicing ---
def _inside_one_block(start: int, size: int, block: int) -> bool:
    return start // block == (start + size - 1) // block


def _check_window(q: QArray, axis: int, start: int, size: int) -> None:
    n, block = q.shape[axis], q.block_shape[axis]
    if (start, size) == (0, n):
        return
    # Whole blocks keep their scales; a window inside one block keeps that block's scale.
    if (start % block or size % block) and not _inside_one_block(start, size, block):
        raise LayoutUnsupported(
            f"slices [{start}:{start + size}] of axis {axis}, not on its {block}-element blocks"
        )
    if axis == q.packed_axis:
        per_group = codes_per_group(q)
        if start % per_group or (size % per_group and start + size != n):
            raise LayoutUnsupported(
                f"slices [{start}:{start + size}] of the packed axis, not on byte groups of "
                f"{per_group} codes"
            )


def _codes_window(q: QArray, axis: int, start: Any, size: int) -> tuple[Any, int]:
    if axis != q.packed_axis:
        return start, size
    return start // codes_per_group(q) * _bytes_per_group(q), q.fmt.packed_length(size)


def slice_(
    q: QArray,
    start_indices: Sequence[int],
    limit_indices: Sequence[int],
    strides: Sequence[int] | None,
) -> QArray:
    """`lax.slice` on whole blocks and byte groups."""
    if strides is not None and any(s != 1 for s in strides):
        raise LayoutUnsupported(f"slices with strides {tuple(strides)}")
    starts = [int(s) for s in start_indices]
    sizes = [int(hi) - int(lo) for lo, hi in zip(start_indices, limit_indices, strict=True)]
    for axis, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        _check_window(q, axis, start, size)
    return _window(q, starts, sizes)


def _window(q: QArray, starts: list[Any], sizes: list[int]) -> QArray:
    """Codes and scales of a window whose starts are ints (checked) or aligned tracers."""
    code_starts, code_sizes, scale_starts, scale_sizes = [], [], [], []
    for axis, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        block = q.block_shape[axis]
        code_start, code_size = _codes_window(q, axis, start, size)
        code_starts.append(code_start)
        code_sizes.append(code_size)
        scale_starts.append(start // block)
        # A window that is not whole blocks lies inside one block (checked): one scale entry.
        whole = size % block == 0 and (
            block == 1 or (isinstance(start, int) and start % block == 0)
        )
        scale_sizes.append(size // block if whole else 1)
    cut = lambda a, st, sz: jax.lax.dynamic_slice(a, [jnp.asarray(s, jnp.int32) for s in st], sz)
    return dataclasses.replace(
        q,
        codes=cut(q.codes, code_starts, code_sizes),
        **_map_scales(q, lambda a: cut(a, scale_starts, scale_sizes)),
        input_scale=_window_input_scale(q, starts, sizes),
        shape=tuple(sizes),
    )


def dynamic_slice(q: QArray, start_indices: Sequence[Any], slice_sizes: Sequence[int]) -> QArray:
    """`lax.dynamic_slice` on whole blocks: traced starts only on per-index axes (block 1)."""
    starts: list[Any] = []
    for axis, (start, size) in enumerate(zip(start_indices, slice_sizes, strict=True)):
        n = q.shape[axis]
        if size == n:
            starts.append(0)
        elif _compat.is_concrete(start):
            # Reproduce dynamic_slice's clamping so the alignment check sees the real start.
            clamped = min(max(int(start), 0), n - size)
            _check_window(q, axis, clamped, size)
            starts.append(clamped)
        elif axis != q.packed_axis and (q.block_shape[axis] == 1 or q.scale.shape[axis] == 1):
            # Per-index scales clamp exactly like the codes; a single block needs no offset.
            starts.append(start)
        else:
            raise LayoutUnsupported(
                f"slices axis {axis} (blocks of {q.block_shape[axis]}"
                f"{', packed' if axis == q.packed_axis else ''}) at a traced offset"
            )
    return _window(q, starts, [int(s) for s in slice_sizes])
