"""Control flow with engine values: calls, `scan`, `while` and `cond` / `switch`, each one rule.

A rule is written once per kind of sub-jaxpr (the kinds of `_walker.SUB_JAXPR_KINDS`) and runs
its body through a `Stepping`, which says how a loop steps and which branch runs:

  * `Lax` (the interpreter): the loop or branch is rebuilt with the public `jax.lax.scan` /
    `while_loop` / `switch` (and a call with `jax.jit` / `jax.checkpoint`) around Python
    closures that interpret the body, so quantized values pass through as the pytrees they are
    (consts are closed over; carries are carried leaf by leaf). This survives changes of the
    primitives' parameters better than re-binding them.
  * `Stepwise` (the probe): each step runs in Python on the values of that step (a scan is
    unrolled, so each step over stacked weights sees its own layer index), a `while` steps while
    its predicate is known, a `cond` runs only the taken branch; a predicate or index unknown
    under `jax.jit` runs the equation as it is, unobserved. Tags never leave a loop or branch.

A loop carry (or a branch output) must keep one type: when the body turns a quantized carry into
a float one (a fallback inside the body), or branches disagree, that slot is dequantized before
the loop (counted), found by a shape-only probe of the body.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.engine import _compat
from lowbit.engine._values import NoRule, is_quantized, logical, value_signature
from lowbit.qarray import QArray

EvalFn = Callable[[Any, Any, Any], list[Any]]
DequantizeFn = Callable[[Any, Any, Any, str], Any]


# --- how bodies step ---
@dataclasses.dataclass(frozen=True)
class Lax:
    """Bodies traced once inside the JAX primitive of their kind (what the interpreter runs)."""

    def call(self, eqn: Any, run: Callable[..., list[Any]], invals: list[Any]) -> list[Any]:
        kind = _compat.rule_name(_compat.primitive_name(eqn))
        if kind == "jit" and not _compat.jit_options(eqn)["inline"]:
            # A fresh closure per trace, so the counts of the inner trace land in this trace's
            # report.
            return list(jax.jit(run)(*invals))
        if kind == "remat":
            return list(jax.checkpoint(run, **_compat.remat_options(eqn))(*invals))
        # Custom derivatives: the primal function (their derivative rule was written for float
        # operands and is not used here).
        return run(*invals)

    def scan(self, step, carry, xs, *, length: int, reverse: bool, unroll: Any):
        return jax.lax.scan(step, carry, xs, length=length, reverse=reverse, unroll=unroll)

    def while_loop(self, eqn, invals, cond, body, carry: list[Any]) -> list[Any]:
        return list(jax.lax.while_loop(cond, body, carry))

    def switch(self, eqn, invals, index, fns, operands: Sequence[Any]) -> list[Any]:
        return list(jax.lax.switch(index, fns, *operands))


@dataclasses.dataclass(frozen=True)
class Stepwise:
    """Bodies evaluated step by step in Python, on the values of each step (the probe).

    Attributes:
      untag: a value → the plain value that leaves a loop or branch (carries and outputs are
        whatever the body made of them, not the values that went in).
      step_of: ``(scanned operand, i)`` → its step `i` (a tagged operand records the index).
    """

    untag: Callable[[Any], Any]
    step_of: Callable[[Any, int], Any]

    def _as_is(self, eqn: Any, invals: list[Any]) -> list[Any]:
        """The equation bound as it is: its body runs unobserved."""
        return _compat.bind_eqn(eqn, [self.untag(v) for v in invals])

    def call(self, eqn: Any, run: Callable[..., list[Any]], invals: list[Any]) -> list[Any]:
        return run(*invals)  # once, as written: no jit or checkpoint around it

    def scan(self, step, carry, xs, *, length: int, reverse: bool, unroll: Any):
        carry = [self.untag(c) for c in carry]
        ys: dict[int, list[Any]] = {}
        for i in range(length - 1, -1, -1) if reverse else range(length):
            carry, y = step(carry, [self.step_of(x, i) for x in xs])
            carry, ys[i] = [self.untag(c) for c in carry], [self.untag(v) for v in y]
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *(ys[i] for i in range(length)))
        return carry, stacked

    def while_loop(self, eqn, invals, cond, body, carry: list[Any]) -> list[Any]:
        carry = [self.untag(c) for c in carry]
        if not _compat.is_concrete(self.untag(cond(carry))):
            return self._as_is(eqn, invals)  # a traced trip count (under jit)
        while bool(self.untag(cond(carry))):
            carry = [self.untag(v) for v in body(carry)]
        return carry

    def switch(self, eqn, invals, index, fns, operands: Sequence[Any]) -> list[Any]:
        index = self.untag(index)
        if not _compat.is_concrete(index):
            return self._as_is(eqn, invals)  # a traced branch index (under jit)
        chosen = fns[int(np.clip(int(index), 0, len(fns) - 1))]
        return [self.untag(v) for v in chosen(*operands)]


Stepping = Lax | Stepwise
LAX = Lax()


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
    final, ys = ctx.stepping.scan(
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
    return ctx.stepping.while_loop(
        eqn,
        invals,
        lambda c: eval_jaxpr(ctx, p["cond"], [*cond_consts, *c])[0],
        lambda c: body(ctx, c),
        carry,
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

    # Branch outputs must agree in type; quantized outputs that do not are dequantized (only
    # quantized operands can make a quantized output).
    to_float: set[int] = set()
    if any(is_quantized(v) for v in operands):
        abstract_ops = _abstract(operands)
        signatures = [
            [
                value_signature(v)
                for v in jax.eval_shape(branch_fn(b, ctx.muted(), set()), *abstract_ops)
            ]
            for b in branches
        ]
        columns = enumerate(zip(*signatures, strict=True))
        to_float = {i for i, column in columns if len(set(column)) > 1}
    fns = [branch_fn(b, ctx, to_float) for b in branches]
    return ctx.stepping.switch(eqn, invals, index, fns, operands)
