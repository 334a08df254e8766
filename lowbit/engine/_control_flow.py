"""Control flow with quantized values: `scan`, `while` and `cond` / `switch`.

Each rule rebuilds the loop or branch with the public `jax.lax.scan` / `while_loop` / `switch` and
Python closures that interpret the body jaxpr, so quantized values pass through as the pytrees
they are (consts are closed over; carries are carried leaf by leaf). This survives changes of
the primitives' parameters better than re-binding them.

A loop carry (or a branch output) must keep one type: when the body turns a quantized carry into
a float one (a fallback inside the body), or branches disagree, that slot is dequantized before
the loop (counted), found by a shape-only probe of the body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.engine import _compat
from lowbit.engine._values import (
    is_lora_weight,
    is_qat_weight,
    is_quantized,
    logical,
    value_signature,
)
from lowbit.qarray import QArray

EvalFn = Callable[[Any, Any, Any], list[Any]]
DequantizeFn = Callable[[Any, Any, Any, str], Any]


def _settle_carry(ctx, eqn, dequantize_counted, carry: list[Any], probe) -> list[Any]:
    """Dequantizes carry slots whose type the body changes, until the carry types are stable."""
    for _ in range(len(carry) + 1):
        if not any(is_quantized(c) for c in carry):
            return carry
        out = probe(carry)
        changed = [
            i
            for i, (before, after) in enumerate(zip(carry, out, strict=True))
            if is_quantized(before) and value_signature(before) != value_signature(after)
        ]
        if not changed:
            return carry
        for i in changed:
            carry[i] = dequantize_counted(ctx, eqn, carry[i], "changes type inside the loop body")
    return carry


def _abstract(values: list[Any]) -> list[Any]:
    """Shape/dtype stand-ins that keep quantized pytrees' static metadata."""
    return [jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), v) for v in values]


# --- scan ---
def _stack_parts(x: Any, length: int) -> tuple[Any, Callable[[Any], Any]]:
    """Splits a scanned-over value into (per-step leaves with leading axis `length`, rebuild)."""
    x = logical(x)
    if is_qat_weight(x):
        parts, rebuild_q = _stack_parts(x.qarray, length)
        return (x.value, parts), lambda p: dataclasses.replace(
            x, value=p[0], qarray=rebuild_q(p[1])
        )
    if hasattr(x, "meta") and hasattr(x, "values"):  # N:M sparse: runs dense
        raise ValueError("is N:M sparse (compressed)")
    if is_lora_weight(x):
        if 0 not in x.batch_axes:
            raise ValueError("is a LoRA-adapted weight whose adapter spans the scanned axis")
        base_parts, rebuild_base = _stack_parts(x.base, length)
        shift = lambda axes: tuple(i - 1 for i in axes)
        return (base_parts, x.a, x.b), lambda p: dataclasses.replace(
            x,
            base=rebuild_base(p[0]),
            a=p[1],
            b=p[2],
            in_axes=shift(x.in_axes),
            out_axes=shift(x.out_axes),
        )
    if not isinstance(x, QArray):
        return x, lambda p: p
    if x.packed_axis == 0:
        raise ValueError("packed along the scanned axis")
    # One scale entry per step: repeat block scales that span several steps (scales are small).
    repeat = length // x.scale.shape[0]
    per_step = lambda a: None if a is None else jnp.repeat(a, repeat, axis=0)
    parts = {"codes": x.codes, "scale": per_step(x.scale), "zero_point": per_step(x.zero_point)}
    tensor_scale = (
        None if x.tensor_scale is None else x.tensor_scale.reshape(x.tensor_scale.shape[1:])
    )

    def rebuild(p):
        return dataclasses.replace(
            x,
            codes=p["codes"],
            scale=p["scale"],
            zero_point=p["zero_point"],
            tensor_scale=tensor_scale,
            shape=x.shape[1:],
            packed_axis=None if x.packed_axis is None else x.packed_axis - 1,
        )

    return parts, rebuild


def scan_rule(eval_jaxpr: EvalFn, dequantize_counted: DequantizeFn, ctx, eqn, invals) -> list[Any]:
    p = _compat.scan_params(eqn)
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts = invals[:n_consts]
    carry = list(invals[n_consts : n_consts + n_carry])
    xs = list(invals[n_consts + n_carry :])
    stacked, rebuilds = [], []
    for i, x in enumerate(xs):
        try:
            parts, rebuild = _stack_parts(x, length)
        except ValueError as err:
            xs[i] = dequantize_counted(ctx, eqn, x, str(err))
            parts, rebuild = xs[i], lambda part: part
        stacked.append(parts)
        rebuilds.append(rebuild)

    # Per-step quantized outputs (e.g. a module's weights handed back by nnx.scan) leave the
    # loop as their leaves, stacked, and are rebuilt around the per-step value seen in the body.
    y_templates: dict[int, Any] = {}

    def step(step_ctx, carry_in, x_parts):
        x_values = [rebuild(part) for rebuild, part in zip(rebuilds, x_parts, strict=True)]
        out = eval_jaxpr(step_ctx, p["body"], [*consts, *carry_in, *x_values])
        ys = []
        for i, y in enumerate(out[n_carry:]):
            if is_quantized(y) and _stackable(y):
                y_templates[i] = y
                ys.append(_unstack_parts(y))
            elif is_quantized(y):
                ys.append(dequantize_counted(step_ctx, eqn, y, "is a per-step scan output"))
            else:
                ys.append(y)
        return list(out[:n_carry]), ys

    def probe(carry_in):
        x_parts = [
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), s) for s in stacked
        ]
        return jax.eval_shape(lambda c, x: step(ctx.muted(), c, x)[0], _abstract(carry_in), x_parts)

    carry = _settle_carry(ctx, eqn, dequantize_counted, carry, probe)
    final, ys = jax.lax.scan(
        lambda c, x: step(ctx, c, x),
        carry,
        stacked,
        length=length,
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    ys = [_stacked(y_templates[i], y, length) if i in y_templates else y for i, y in enumerate(ys)]
    return [*final, *ys]


def _stackable(y: Any) -> bool:
    if is_lora_weight(y) or not hasattr(y, "qarray") and not isinstance(y, QArray):
        return False
    q = y.qarray if is_qat_weight(y) else y
    return q.tensor_scale is None and q.activation_bounds is None and q.input_scale is None


def _unstack_parts(y: Any) -> Any:
    q = y.qarray if is_qat_weight(y) else y
    parts = {"codes": q.codes, "scale": q.scale, "zero_point": q.zero_point}
    return (y.value, parts) if is_qat_weight(y) else parts


def _stacked(template: Any, parts: Any, length: int) -> Any:
    """The per-step value `template` with a new leading axis of `length` steps."""
    if is_qat_weight(template):
        value, q_parts = parts
        qarray = _stacked(template.qarray, q_parts, length)
        return dataclasses.replace(template, value=value, qarray=qarray)
    packed = template.packed_axis
    return dataclasses.replace(
        template,
        **parts,
        shape=(length, *template.shape),
        packed_axis=None if packed is None else packed + 1,
    )


# --- while ---
def while_rule(eval_jaxpr: EvalFn, dequantize_counted: DequantizeFn, ctx, eqn, invals) -> list[Any]:
    p = _compat.while_params(eqn)
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts = invals[:n_cond]
    body_consts = invals[n_cond : n_cond + n_body]
    carry = list(invals[n_cond + n_body :])

    def body(step_ctx, carry_in):
        return list(eval_jaxpr(step_ctx, p["body"], [*body_consts, *carry_in]))

    probe = lambda c: jax.eval_shape(lambda v: body(ctx.muted(), v), _abstract(c))
    carry = _settle_carry(ctx, eqn, dequantize_counted, carry, probe)
    return list(
        jax.lax.while_loop(
            lambda c: eval_jaxpr(ctx, p["cond"], [*cond_consts, *c])[0],
            lambda c: body(ctx, c),
            carry,
        )
    )


# --- cond / switch ---
def cond_rule(eval_jaxpr: EvalFn, dequantize_counted: DequantizeFn, ctx, eqn, invals) -> list[Any]:
    branches = _compat.cond_branches(eqn)
    index, *operands = invals
    if is_quantized(index):
        raise ValueError("cond index cannot be quantized")

    def branch_fn(branch, branch_ctx, to_float):
        def run(*ops):
            out = eval_jaxpr(branch_ctx, branch, list(ops))
            return [
                dequantize_counted(branch_ctx, eqn, v, "is a branch output of another type")
                if i in to_float and is_quantized(v)
                else v
                for i, v in enumerate(out)
            ]

        return run

    # Branch outputs must agree in type; quantized outputs that do not are dequantized.
    abstract_ops = _abstract(operands)
    signatures = [
        [
            value_signature(v)
            for v in jax.eval_shape(branch_fn(b, ctx.muted(), set()), *abstract_ops)
        ]
        for b in branches
    ]
    to_float = {i for i, column in enumerate(zip(*signatures, strict=True)) if len(set(column)) > 1}
    fns = [branch_fn(b, ctx, to_float) for b in branches]
    return list(jax.lax.switch(index, fns, *operands))
