"""Rules for the primitives that compute with quantized operands: they call `lowbit.ops`.

Each rule takes `(ctx, eqn, invals)` (the interpreter's context, the equation, its operand
values) and returns the output values, recording in `ctx.report` the implementation path the op
took (e.g. ``"int8_int32"``, or ``"reference"`` when it dequantized).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowbit import ops
from lowbit.engine import _compat
from lowbit.engine._values import (
    NoRule,
    is_fp8_weight,
    is_lora_weight,
    is_nm_sparse,
    is_qat_weight,
    is_quantized,
    logical,
)


def _match_aval(eqn: Any, out: Any) -> Any:
    dtype = _compat.aval_of(eqn.outvars[0]).dtype
    return out if out.dtype == dtype else out.astype(dtype)


def dot_general(relaid: Callable[..., None], ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
    """`relaid(ctx, eqn, value)` counts a weight the op re-lays out on every call."""
    lhs, rhs = invals
    params = eqn.params
    dimension_numbers = params["dimension_numbers"]
    kwargs = {
        "precision": params.get("precision"),
        "preferred_element_type": params.get("preferred_element_type"),
        "out_sharding": params.get("out_sharding"),
    }
    if is_nm_sparse(lhs) or is_nm_sparse(rhs):
        raise NoRule("is N:M sparse and no sparse matmul kernel exists here: runs dense")
    with _compat.eqn_context(eqn):
        if is_lora_weight(lhs) or is_lora_weight(rhs):
            try:
                out = ops.lora_dot_general(lhs, rhs, dimension_numbers, **kwargs)
            except ops.LoraLayoutError as err:
                raise NoRule(str(err)) from None
            path = ops.lora_dot_general_path(lhs, rhs, dimension_numbers)
        elif is_fp8_weight(lhs) or is_fp8_weight(rhs):
            try:
                out = ops.fp8_dot_general(lhs, rhs, dimension_numbers)
            except ops.Fp8LayoutError as err:
                raise NoRule(str(err)) from None
            path = "fp8_scaled"
        elif is_qat_weight(lhs) or is_qat_weight(rhs):
            out = ops.qat_dot_general(lhs, rhs, dimension_numbers, **kwargs)
            path = "qat"
        else:
            path = ops.dot_general_path(lhs, rhs, dimension_numbers)
            relaid_value = ops.per_call_layout(
                lhs, rhs, dimension_numbers, out_sharding=kwargs["out_sharding"]
            )
            if relaid_value is not None:
                relaid(ctx, eqn, relaid_value)
            out = ops.dot_general(lhs, rhs, dimension_numbers, **kwargs)
    ctx.report.record_op("dot_general", path)
    return [_match_aval(eqn, out)]


def _only_qarrays_and_qat(values: list[Any], primitive: str) -> None:
    for v in values:
        if is_lora_weight(v) or is_fp8_weight(v) or is_nm_sparse(v):
            raise NoRule(f"has no {primitive} rule for {type(v).__name__}: runs dense")


def conv_general_dilated(ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
    lhs, rhs = invals = [logical(v) for v in invals]
    _only_qarrays_and_qat(invals, "conv")
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
    lhs, rhs, group_sizes = invals = [logical(v) for v in invals]
    _only_qarrays_and_qat(invals, "ragged_dot")
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
