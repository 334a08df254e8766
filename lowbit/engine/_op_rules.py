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
from lowbit.engine._values import NoRule, is_quantized, logical, rule_owner


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
    with _compat.eqn_context(eqn):
        result = rule_owner(invals).dot_general(lhs, rhs, dimension_numbers, **kwargs)
        if result is NotImplemented:  # packed operands: lowbit.ops' own quantized matmul
            # Planned here, once: the path reported, the fallback counted and the product run
            # are the same decision.
            plan = ops.plan_dot_general(
                lhs, rhs, dimension_numbers, out_sharding=kwargs["out_sharding"]
            )
            if plan.relaid is not None:
                relaid(ctx, eqn, invals[plan.relaid])
            for platform, reason in plan.declined:
                ctx.report.record_declined(platform, reason)
            result = ops.dot_general(lhs, rhs, dimension_numbers, plan=plan, **kwargs), plan.path
    out, path = result
    ctx.report.record_op("dot_general", path)
    return [_match_aval(eqn, out)]


def conv_general_dilated(ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
    lhs, rhs = invals = [logical(v) for v in invals]
    with _compat.eqn_context(eqn):
        result = rule_owner(invals).conv_general_dilated(lhs, rhs, **eqn.params)
        if result is NotImplemented:
            path = ops.conv_general_dilated_path(lhs, rhs, **eqn.params)
            result = ops.conv_general_dilated(lhs, rhs, **eqn.params), path
    out, path = result
    ctx.report.record_op("conv_general_dilated", path)
    return [_match_aval(eqn, out)]


def ragged_dot_general(ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
    lhs, rhs, group_sizes = [logical(v) for v in invals]
    if is_quantized(group_sizes):
        raise NoRule("received quantized group sizes")
    with _compat.eqn_context(eqn):
        result = rule_owner([lhs, rhs]).ragged_dot_general(lhs, rhs, group_sizes, **eqn.params)
        if result is NotImplemented:
            path = ops.ragged_dot_general_path(lhs, rhs, group_sizes, **eqn.params)
            result = ops.ragged_dot_general(lhs, rhs, group_sizes, **eqn.params), path
    out, path = result
    ctx.report.record_op("ragged_dot_general", path)
    return [_match_aval(eqn, out)]
