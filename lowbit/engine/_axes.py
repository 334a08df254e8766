"""Which axis the traced linear layers contract each 2-D quantized weight over.

Serving prepares a weight for the CPU kernels once, for one contraction axis (`[K, N]` or
`[N, K]`), and that axis is a fact about how the model *uses* the weight, not about its scales:
an `nnx.Embed` table is gathered by rows and, tied, multiplied as ``x @ E.T``. `kernel_axes`
finds it by running the engine on the function abstractly (no compute) while following each
quantized argument through the ops that keep it the same weight (2-D transposes, casts, copies)
to the `dot_general`s that read it as a linear layer's weight.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax

from lowbit.engine._values import is_quantized


class AxisProbe:
    """Per-trace record: quantized argument index -> contraction axes seen (in its own frame)."""

    def __init__(self) -> None:
        self._roots: dict[int, tuple[int, bool]] = {}
        self._alive: list[Any] = []  # keeps ids unique while the trace runs
        self.axes: dict[int, set[int]] = defaultdict(set)

    def mark(self, value: Any, index: int) -> None:
        self._roots[id(value)] = (index, False)
        self._alive.append(value)

    def derive(self, out: Any, operand: Any, *, flipped: bool) -> None:
        """`out` is `operand` (transposed when `flipped`): the same weight."""
        root = self._roots.get(id(operand))
        if root is not None:
            self._roots[id(out)] = (root[0], root[1] ^ flipped)
            self._alive.append(out)

    def record_dot(self, lhs: Any, rhs: Any, dimension_numbers: Any) -> None:
        from lowbit.ops import linear_contraction_axis

        root = self._roots.get(id(rhs))
        if root is None or is_quantized(lhs):
            return
        axis = linear_contraction_axis(lhs, rhs, dimension_numbers)
        if axis is not None:
            self.axes[root[0]].add(axis ^ int(root[1]))


def kernel_axes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[tuple, int]:
    """The contraction axis of every 2-D quantized argument leaf `fn` uses as a linear weight.

    Traced abstractly (`jax.eval_shape`): nothing is computed. Uses inside `scan`, `while`,
    `cond` and `shard_map` bodies are not followed; a weight contracted over both axes (or
    never) is left out.

    Args:
      fn: as for `lowbit.engine.interpret`.
      *args, **kwargs: its arguments, with `QArray` (or `PreparedQArray`) leaves; arrays may be
        `jax.ShapeDtypeStruct`s.
    Returns:
      {key path into ``(args, kwargs)`` (quantized values as leaves): axis 0 or 1}.
    """
    from lowbit.engine._interpreter import interpret

    probe = AxisProbe()
    flat, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_quantized)
    leaves = [leaf for _, leaf in flat]
    # Only arrays (and stand-ins) are traced; flags such as ``deterministic=True`` stay Python.
    dynamic = [i for i, x in enumerate(leaves) if is_quantized(x) or hasattr(x, "shape")]

    def call(*values):
        full = list(leaves)
        for i, v in zip(dynamic, values, strict=True):
            full[i] = v
        call_args, call_kwargs = jax.tree.unflatten(treedef, full)
        return fn(*call_args, **call_kwargs)

    jax.eval_shape(interpret(call, axis_probe=probe), *[leaves[i] for i in dynamic])
    paths = [tuple(keys) for keys, _ in flat]
    return {paths[dynamic[i]]: next(iter(a)) for i, a in probe.axes.items() if len(a) == 1}
