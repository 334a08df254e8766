"""Which axis the traced linear layers contract each 2-D quantized weight over.

Serving prepares a weight for the CPU kernels once, for one contraction axis (`[K, N]` or
`[N, K]`), and that axis is a fact about how the model *uses* the weight, not about its scales:
an `nnx.Embed` table is gathered by rows and, tied, multiplied as ``x @ E.T``. It is a reduction
over the engine's walk (`lowbit.engine._walker`): the `dot_general`s that read a 2-D weight as
a linear layer's rhs, through the ops that keep it the same weight (2-D transposes, float
casts, copies), at the top level or inside `jit`, `scan`, `while` and `cond` bodies. A use
inside `shard_map` does not count: each device sees a block, and a kernel layout of the whole
weight is not split by the specs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import jax.numpy as jnp

from lowbit.engine._values import is_quantized
from lowbit.engine._walker import Record, Step, trace
from lowbit.ops import linear_contraction_axis


def _flipped(steps: tuple[Step, ...]) -> bool | None:
    """Whether `steps` transpose a 2-D weight (None: they make it another weight)."""
    flipped = False
    for step in steps:
        if len(step.in_shape) != 2 or len(step.out_shape) != 2:
            return None
        if step.primitive == "transpose":
            flipped ^= tuple(step.params["permutation"]) == (1, 0)
        elif step.primitive == "convert_element_type":
            if not jnp.issubdtype(step.out_dtype, jnp.floating):
                return None
        elif step.primitive not in ("copy", "copy_p"):
            return None
    return flipped


def contraction_axes(record: Record, quantized: Collection[int]) -> dict[int, int]:
    """{leaf: the axis its linear uses contract} for the 2-D leaves in `quantized`.

    A use counts when the leaf (through `_flipped` steps) is the rhs of a `dot_general` whose
    lhs is not itself a leaf of `quantized`, and `lowbit.ops.linear_contraction_axis` accepts
    it. A leaf contracted over both axes (or never) is left out.

    Args:
      record: a walk of the traced function (`lowbit.engine._walker.walk`).
      quantized: indices of the leaves that are (or will be) quantized weights.
    Returns:
      {leaf index: 0 or 1}.
    """
    quantized = set(quantized)
    found: dict[int, set[int]] = {}
    for site in record.sites:
        if site.primitive != "dot_general" or site.operand != 1 or site.leaf not in quantized:
            continue
        if len(record.leaves[site.leaf].shape) != 2:
            continue
        lhs = site.partners[0]
        if lhs is not None and lhs.leaf in quantized:
            continue
        flipped = _flipped(site.steps)
        if flipped is None or any(w == "shard_map" for w in site.where):
            continue
        axis = linear_contraction_axis(*site.operands[:2], site.params["dimension_numbers"])
        if axis is not None:
            found.setdefault(site.leaf, set()).add(axis ^ int(flipped))
    return {leaf: next(iter(a)) for leaf, a in found.items() if len(a) == 1}


def kernel_axes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[tuple, int]:
    """The contraction axis of every 2-D quantized argument leaf `fn` uses as a linear weight.

    Traced abstractly (`jax.make_jaxpr`): nothing is computed. Uses inside `jit`, `remat`,
    `scan`, `while` and `cond` bodies count; uses inside `shard_map` do not (see module
    docstring); a weight contracted over both axes (or never) is left out.

    Args:
      fn: as for `lowbit.engine.interpret`.
      *args, **kwargs: its arguments, with `QArray` (or `PreparedQArray`) leaves; arrays may be
        `jax.ShapeDtypeStruct`s.
    Returns:
      {key path into ``(args, kwargs)`` (quantized values as leaves): axis 0 or 1}.
    """
    traced = trace(fn, args, kwargs, lambda _, leaf: is_quantized(leaf))
    quantized = [i for i, leaf in enumerate(traced.leaves) if is_quantized(leaf)]
    axes = contraction_axes(traced.record, quantized)
    return {traced.paths[i]: axis for i, axis in axes.items()}
