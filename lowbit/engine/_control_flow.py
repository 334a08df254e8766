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
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.engine import _compat
from lowbit.engine._values import NoRule, is_quantized, logical, value_signature
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
    if not is_quantized(x):
        return x, lambda p: p
    return logical(x).scan_parts(functools.partial(_qarray_step_parts, length=length))


def _qarray_step_parts(x: QArray, length: int) -> tuple[Any, Callable[[Any], Any]]:
    if x.packed_axis == 0:
        raise NoRule("packed along the scanned axis")
    # One scale entry per step: repeat block scales that span several steps (scales are small).
    repeat = length // x.scale.shape[0]
    per_step = lambda a: None if a is None else jnp.repeat(a, repeat, axis=0)
    parts = {"codes": x.codes, "scale": per_step(x.scale), "zero_point": per_step(x.zero_point)}
    drop_axis = lambda a: None if a is None else a.reshape(a.shape[1:])
    tensor_scale = drop_axis(x.tensor_scale)
    # The input scale is full or 1 along the scanned axis: scanned with the codes, or dropped.
    input_scale = x.input_scale
    if input_scale is not None and input_scale.shape[0] != 1:
        parts["input_scale"] = input_scale
        input_scale = None
    input_scale = drop_axis(input_scale)

    def rebuild(p):
        return dataclasses.replace(
            x,
            codes=p["codes"],
            scale=p["scale"],
            zero_point=p["zero_point"],
            tensor_scale=tensor_scale,
            input_scale=p.get("input_scale", input_scale),
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
        except NoRule as err:
            xs[i] = dequantize_counted(ctx, eqn, x, str(err))
            parts, rebuild = xs[i], lambda part: part
        stacked.append(parts)
        rebuilds.append(rebuild)

    # Per-step quantized outputs (e.g. a module's weights handed back by nnx.scan) leave the
    # loop as their leaves, stacked, and are rebuilt around the per-step value seen in the body.
    restacks: dict[int, Callable[[Any, int], Any]] = {}

    def step(step_ctx, carry_in, x_parts):
        x_values = [rebuild(part) for rebuild, part in zip(rebuilds, x_parts, strict=True)]
        out = eval_jaxpr(step_ctx, p["body"], [*consts, *carry_in, *x_values])
        ys = []
        for i, y in enumerate(out[n_carry:]):
            if not is_quantized(y):
                ys.append(y)
                continue
            try:
                parts, restacks[i] = y.scan_output_parts(_qarray_output_parts)
            except NoRule as err:
                parts = dequantize_counted(step_ctx, eqn, y, str(err))
            ys.append(parts)
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
    ys = [restacks[i](y, length) if i in restacks else y for i, y in enumerate(ys)]
    return [*final, *ys]


def _qarray_output_parts(q: QArray) -> tuple[Any, Callable[[Any, int], Any]]:
    """A per-step QArray as (codes, scales, zero points), and the stacked QArray from them."""
    if q.tensor_scale is not None or q.activation_bounds is not None or q.input_scale is not None:
        raise NoRule("is a per-step scan output")
    parts = {"codes": q.codes, "scale": q.scale, "zero_point": q.zero_point}

    def restack(stacked: Any, length: int) -> QArray:
        packed = q.packed_axis
        return dataclasses.replace(
            q,
            **stacked,
            shape=(length, *q.shape),
            packed_axis=None if packed is None else packed + 1,
        )

    return parts, restack


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
