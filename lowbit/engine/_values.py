"""The values the interpreter carries in place of arrays, seen through one protocol.

Every such value (`QArray`, `lowbit.ops.PreparedQArray`, `QatWeight`, `LoraWeight`,
`Fp8Weight`, `lowbit.qarray.NMSparse`) is a `lowbit.qarray.EngineValue`: it says its shape and
dtype, how it dequantizes, how layout ops map over it, how it takes part in a matmul and how it
reads in the report. The engine asks it, and never asks which kind it is, so a new kind of
weight is one class in its own module. Layout rules are written once for `QArray`; each value's
`map_layout` applies them to its packed parts (and the float op to its float parts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.engine import _compat
from lowbit.ops import PreparedQArray
from lowbit.qarray import EngineValue
from lowbit.qarray import NoRule as NoRule  # re-exported: the engine rules raise it


def is_quantized(x: Any) -> bool:
    """True for the values the engine treats specially: every `EngineValue`."""
    return isinstance(x, EngineValue)


def is_prepared(x: Any) -> bool:
    """A weight held in a kernel's layout (it keeps that layout through transposes and casts,
    and reads embedding rows from it)."""
    return isinstance(x, PreparedQArray)


def logical(x: Any) -> Any:
    """An engine value in its logical form (`EngineValue.logical`); others as they are."""
    return x.logical() if isinstance(x, EngineValue) else x


def logical_struct(x: EngineValue) -> jax.ShapeDtypeStruct:
    """The float array a quantized value stands for, as a shape/dtype stand-in for tracing."""
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def stand_in(leaf: Any) -> jax.ShapeDtypeStruct:
    """The shape/dtype stand-in a traced leaf is traced as (an engine value: its logical array)."""
    if is_quantized(leaf):
        return logical_struct(leaf)
    return jax.ShapeDtypeStruct(
        np.shape(leaf), leaf.dtype, weak_type=bool(getattr(leaf, "weak_type", False))
    )


def trace_leaves(
    fn: Callable[..., Any], leaves: Sequence[Any], treedef: Any, dynamic: Sequence[int]
) -> tuple[Any, Any]:
    """Traces ``fn(*args, **kwargs)`` with the leaves at `dynamic` as its traced inputs.

    Args:
      fn: the function.
      leaves, treedef: the flattened ``(args, kwargs)`` pair (engine values are leaves).
      dynamic: indices of the leaves traced (as their `stand_in`); the others are constants.
    Returns:
      ``(closed_jaxpr, out_shape)`` as `jax.make_jaxpr(..., return_shape=True)` gives them.
    """

    def call(*values):
        full = list(leaves)
        for i, value in zip(dynamic, values, strict=True):
            full[i] = value
        call_args, call_kwargs = jax.tree.unflatten(treedef, full)
        return fn(*call_args, **call_kwargs)

    return _compat.make_jaxpr(call, [stand_in(leaves[i]) for i in dynamic])


def dequantize(x: EngineValue) -> jax.Array:
    """The float array a quantized value stands for in the forward pass (`EngineValue`)."""
    return x.dequantize()


def map_layout(x: EngineValue, qarray_fn, float_fn) -> Any:
    """Applies a layout op to a quantized value (`EngineValue.map_layout`).

    Args:
      x: the value. A `PreparedQArray` reaches here only for ops that leave the weight the
        same weight (transpose, float cast, copy); the caller makes it logical for others.
      qarray_fn: QArray → QArray (may raise `LayoutUnsupported`).
      float_fn: float array → float array, the same op on ordinary values.
    Returns:
      a value of the same kind as `x`.
    Raises:
      NoRule: when the op cannot keep the value's kind.
    """
    return x.map_layout(qarray_fn, float_fn)


def rule_owner(values: list[Any]) -> EngineValue:
    """The engine value among `values` whose op rule runs: the first of highest priority."""
    return max((v for v in values if is_quantized(v)), key=lambda v: v.engine_priority)


def value_signature(x: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]:
    """(treedef, leaf shapes and dtypes): equal signatures can share a loop carry slot."""
    leaves, treedef = jax.tree.flatten(x)
    return treedef, tuple((tuple(jnp.shape(a)), getattr(a, "dtype", type(a))) for a in leaves)
