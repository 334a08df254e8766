"""Rules for the primitives that compute with quantized operands: they call `lowbit.ops`.

Each rule takes `(ctx, eqn, invals)` (the interpreter's context, the equation, its operand
values) and returns the output values, recording in `ctx.report` the implementation path the op
took (e.g. ``"int8_int32"``, or ``"reference"`` when it dequantized).
"""

from __future__ import annotations

from typing import Any

from lowbit import ops
from lowbit.engine import _compat
from lowbit.engine._values import NoRule, is_qat_weight, is_quantized


def _match_aval(eqn: Any, out: Any) -> Any:
    dtype = _compat.aval_of(eqn.outvars[0]).dtype
    return out if out.dtype == dtype else out.astype(dtype)


def dot_general(ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
    lhs, rhs = invals
    params = eqn.params
    dimension_numbers = params["dimension_numbers"]
    kwargs = {
        "precision": params.get("precision"),
        "preferred_element_type": params.get("preferred_element_type"),
        "out_sharding": params.get("out_sharding"),
    }
    with _compat.eqn_context(eqn):
        if is_qat_weight(lhs) or is_qat_weight(rhs):
            out = ops.qat_dot_general(lhs, rhs, dimension_numbers, **kwargs)
            path = "qat"
        else:
            path = ops.dot_general_path(lhs, rhs, dimension_numbers)
            out = ops.dot_general(lhs, rhs, dimension_numbers, **kwargs)
    ctx.report.record_op("dot_general", path)
    return [_match_aval(eqn, out)]


def conv_general_dilated(ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
    lhs, rhs = invals
    with _compat.eqn_context(eqn):
        if is_qat_weight(lhs) or is_qat_weight(rhs):
            out = ops.qat_conv_general_dilated(lhs, rhs, **eqn.params)
            path = "qat"
        else:
            path = ops.conv_general_dilated_path(lhs, rhs, **eqn.params)
            out = ops.conv_general_dilated(lhs, rhs, **eqn.params)
    ctx.report.record_op("conv_general_dilated", path)
    return [_match_aval(eqn, out)]


def ragged_dot_general(ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
    lhs, rhs, group_sizes = invals
    if is_quantized(group_sizes):
        raise NoRule("received quantized group sizes")
    with _compat.eqn_context(eqn):
        if is_qat_weight(lhs) or is_qat_weight(rhs):
            out = ops.qat_ragged_dot_general(lhs, rhs, group_sizes, **eqn.params)
            path = "qat"
        else:
            path = ops.ragged_dot_general_path(lhs, rhs, group_sizes, **eqn.params)
            out = ops.ragged_dot_general(lhs, rhs, group_sizes, **eqn.params)
    ctx.report.record_op("ragged_dot_general", path)
    return [_match_aval(eqn, out)]
