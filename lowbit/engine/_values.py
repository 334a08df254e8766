"""The quantized value types the interpreter carries, and how to look inside them.

Three types flow through the engine besides ordinary arrays: `QArray` (packed PTQ weights),
`lowbit.ops.QatWeight` (a float weight with its QAT recipe; leaves `value` and `qarray`) and
`lowbit.ops.LoraWeight` (a frozen base weight with a low-rank adapter). Layout rules are written
once for `QArray`; on a `QatWeight` they apply to `qarray` while the float op applies to `value`,
so both stay consistent. A `LoraWeight` keeps only layout ops that leave its shape alone (copy,
dtype casts of the base); others dequantize it (the merged weight, counted). So does an
`lowbit.ops.Fp8Weight` (a float weight with fp8 amax histories). An N:M sparse weight
(`lowbit.qarray.NMSparse`) has no kernel yet: every op dequantizes it to dense, counted.
A `lowbit.ops.PreparedQArray` (a served weight held in the CPU kernels' layout instead of its
codes) keeps its layout through transposes and casts and becomes its logical `QArray` for any
other layout op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.ops import Fp8Weight, LoraWeight, PreparedQArray, QatWeight
from lowbit.qarray import NMSparse, QArray


class NoRule(Exception):
    """Raised by a rule that cannot handle these operands; the interpreter then falls back
    (dequantizes, counted) or, in strict mode, raises `EngineFallbackError` with this reason."""


def is_qat_weight(x: Any) -> bool:
    return isinstance(x, QatWeight)


def is_lora_weight(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def is_fp8_weight(x: Any) -> bool:
    return isinstance(x, Fp8Weight)


def is_quantized(x: Any) -> bool:
    """True for the values the engine treats specially: `QArray`, `PreparedQArray`,
    `QatWeight`, `LoraWeight`, `Fp8Weight`."""
    return isinstance(x, QArray | PreparedQArray | QatWeight | LoraWeight | Fp8Weight | NMSparse)


def is_nm_sparse(x: Any) -> bool:
    return isinstance(x, NMSparse)


def is_prepared(x: Any) -> bool:
    return isinstance(x, PreparedQArray)


def logical(x: Any) -> Any:
    """A `PreparedQArray` as its logical `QArray` (a pass over its layout); others as they are."""
    return x.logical() if isinstance(x, PreparedQArray) else x


def logical_struct(x: Any) -> jax.ShapeDtypeStruct:
    """The float array a quantized value stands for, as a shape/dtype stand-in for tracing."""
    if is_qat_weight(x):
        return jax.ShapeDtypeStruct(x.value.shape, x.value.dtype)
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def dequantize(x: Any) -> jax.Array:
    """The float array a quantized value stands for in the forward pass.

    A `QatWeight` becomes its fake-quantized value with a straight-through gradient to `value`:
    forward numerics of the quantized weight, gradients of the float one.
    """
    return x.dequantize()


def map_layout(x: Any, qarray_fn, float_fn) -> Any:
    """Applies a layout op to a quantized value.

    Args:
      x: a `QArray`, `PreparedQArray` or `QatWeight`. A `PreparedQArray` goes to `qarray_fn`
        as it is: only ops that leave the weight the same weight (transpose, float cast, copy)
        reach here with one, and it implements those without leaving its kernel layout (the
        caller makes it logical for any other op).
      qarray_fn: QArray → QArray (may raise `LayoutUnsupported`).
      float_fn: float array → float array, the same op on ordinary values.
    Returns:
      a value of the same kind as `x`.
    """
    if isinstance(x, QArray | PreparedQArray):
        return qarray_fn(x)
    if is_nm_sparse(x):
        raise NoRule("is N:M sparse (compressed); it runs dense")
    if is_lora_weight(x):
        base = x.base
        new_base = qarray_fn(base) if isinstance(base, QArray) else float_fn(base)
        if tuple(new_base.shape) != tuple(base.shape):
            raise NoRule("changes the shape of a LoRA-adapted weight")
        return dataclasses.replace(x, base=new_base)
    if is_fp8_weight(x):
        value = float_fn(x.value)
        if tuple(value.shape) != tuple(x.value.shape):
            raise NoRule("changes the shape of an fp8-scaled weight")
        return dataclasses.replace(x, value=value)
    return dataclasses.replace(x, value=float_fn(x.value), qarray=qarray_fn(x.qarray))


def value_signature(x: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]:
    """(treedef, leaf shapes and dtypes): equal signatures can share a loop carry slot."""
    leaves, treedef = jax.tree.flatten(x)
    return treedef, tuple((tuple(jnp.shape(a)), getattr(a, "dtype", type(a))) for a in leaves)
