"""`HadamardInput`: a weight stored rotated, whose matmul rotates its input online.

For a linear layer ``y = x W`` (``W [K, N]``, K contracted), QuaRot's online rotation stores
``W' = Hᵀ W`` (rotated along K, then quantized) and computes ``y = (x H) W'``: the activation
``x H`` has no outlier channels left, so it quantizes (w4a8, w4a4) and ``W'`` rounds better.
The model's source is not edited: the engine meets this value where it met ``W`` and its
`dot_general` applies `hadamard_transform` to the activation's contracted axis, then runs the
inner weight's product (a `QArray`'s quantized kernel, or a float matmul).

It stands for ``W = H W'`` (what `dequantize` gives), so a fallback computes the same thing.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.ops._dot_general import dot_general, plan_dot_general
from lowbit.ops._hadamard import hadamard_transform
from lowbit.qarray import ArrayBacked, EngineValue, NoRule


def _rotate_axis(x: jax.Array, axis: int, *, inverse: bool = False) -> jax.Array:
    """`hadamard_transform` along `axis` of `x`."""
    moved = jnp.moveaxis(x, axis, -1)
    return jnp.moveaxis(hadamard_transform(moved, inverse=inverse), -1, axis)


def rotate_weight_input(w: jax.Array, axis: int = 0) -> jax.Array:
    """``Hᵀ W`` along `axis` of a float weight (what `HadamardInput` stores before
    quantizing): ``[..., K, ...]`` -> the same shape."""
    return _rotate_axis(w, axis)


@typing.final
@dataclasses.dataclass(frozen=True, eq=False)
class HadamardInput(ArrayBacked):
    """A weight ``W = H W'`` held as ``W'`` (float, `QArray` or `PreparedQArray`).

    Attributes:
      inner: ``W'`` of the logical weight's shape, rotated along `axis`.
      axis: the input (contracted) axis of the weight that the rotation runs along.
    """

    inner: Any
    axis: int = 0

    backing = "inner"
    engine_priority = 2

    def dequantize(self) -> jax.Array:
        inner = self.inner.dequantize() if isinstance(self.inner, EngineValue) else self.inner
        return _rotate_axis(inner, self.axis, inverse=True)

    def logical(self) -> HadamardInput:
        inner = self.inner.logical() if isinstance(self.inner, EngineValue) else self.inner
        return dataclasses.replace(self, inner=inner)

    def map_layout(self, qarray_fn: Any, float_fn: Any) -> HadamardInput:
        """Layout ops that leave the shape alone (copies, casts) keep the rotation; others
        dequantize ``H W'`` (counted)."""
        return self.map_backing(qarray_fn, float_fn, "a weight with an online Hadamard input")

    def describe(self) -> str:
        return f"HadamardInput({self.describe_backing()}, axis={self.axis})"

    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, **kwargs: Any):
        (lc, rc), (lb, rb) = dimension_numbers
        weight_rhs = rhs is self
        x = lhs if weight_rhs else rhs
        wc, xc = (rc, lc) if weight_rhs else (lc, rc)
        if isinstance(x, EngineValue):
            raise NoRule("both operands are engine values")
        if lb or rb or tuple(wc) != (self.axis,):
            raise NoRule(
                f"contracts axes {tuple(wc)} of the weight, not its rotated input axis {self.axis}"
            )
        x = _rotate_axis(x, xc[0]).astype(x.dtype)
        pair = (x, self.inner) if weight_rhs else (self.inner, x)
        if not isinstance(self.inner, EngineValue):
            return lax.dot_general(*pair, dimension_numbers, **kwargs), "hadamard+float"
        result = self.inner.dot_general(*pair, dimension_numbers, **kwargs)
        if result is NotImplemented:  # packed codes: lowbit.ops' own quantized matmul
            plan = plan_dot_general(
                *pair, dimension_numbers, out_sharding=kwargs.get("out_sharding")
            )
            result = dot_general(*pair, dimension_numbers, plan=plan, **kwargs), plan.path
        out, path = result
        return out, f"hadamard+{path}"

    def scan_parts(self, qarray_parts: Any) -> Any:
        raise NoRule("is a weight with an online Hadamard input inside a scan")

    def shard_parts(self, spec: Any, qarray_parts: Any) -> Any:
        raise NoRule("is a weight with an online Hadamard input entering shard_map")


jax.tree_util.register_dataclass(HadamardInput, data_fields=["inner"], meta_fields=["axis"])
