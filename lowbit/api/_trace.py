"""Following parameters through a function's jaxpr: which ops each one feeds, and the values
that meet it there.

Both questions are answered by one walk over the jaxpr of ``fn(params, *args)``. Every value is
tagged with the parameter paths it is a pure re-layout of (transpose, reshape, slice, cast, ...,
and the implicit per-step slice of a `scan` over stacked weights); a `dot_general`, conv,
`ragged_dot` or `gather` that reads a tagged operand is a *use* of those parameters, and its
other operand is the *activation* that the recipe's activation quantizer will see. Sub-jaxprs
(`jit`, `remat`, `custom_jvp`/`custom_vjp`, `scan`, `while`, `cond`) are entered, so weights are
followed into them.

The walk runs in two modes: symbolic (no values, each sub-jaxpr visited once: `param_uses`) and
concrete (eager evaluation, one primitive at a time, loops run step by step: calibration).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core

from lowbit.recipes import path_string

# Primitives whose output is a re-layout of their (first) input: a weight passing through them
# is still the same weight.
_LAYOUT = frozenset(
    {
        "transpose",
        "reshape",
        "convert_element_type",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "copy",
        "copy_p",
        "slice",
        "dynamic_slice",
        "rev",
        "sharding_constraint",
        "reduce_precision",
        "optimization_barrier",
    }
)
# Primitive name -> op name used in rules.
_OPS = {
    "dot_general": "dot_general",
    "conv_general_dilated": "conv",
    "ragged_dot": "ragged_dot",
    "ragged_dot_general": "ragged_dot",
    "gather": "gather",
}

Tags = frozenset[str]
# visit(op, weight paths, activation value or None)
Visitor = Callable[[str, Tags, Any], None]


def _inner(eqn) -> tuple[core.Jaxpr, list[Any]] | None:
    """The single call-like sub-jaxpr of `eqn` taking exactly its operands, if any."""
    for value in eqn.params.values():
        if isinstance(value, core.ClosedJaxpr) and len(value.jaxpr.invars) == len(eqn.invars):
            return value.jaxpr, list(value.consts)
        if isinstance(value, core.Jaxpr) and len(value.invars) == len(eqn.invars):
            return value, []
    return None


class _Walker:
    def __init__(self, visit: Visitor, concrete: bool):
        self.visit = visit
        self.concrete = concrete

    def run(self, jaxpr: core.Jaxpr, consts, args, tags):
        env: dict[Any, tuple[Any, Tags]] = {}

        def read(v):
            if isinstance(v, core.Literal):
                return v.val, frozenset()
            return env[v]

        for var, val in zip(jaxpr.constvars, consts, strict=True):
            env[var] = (val, frozenset())
        for var, val, tag in zip(jaxpr.invars, args, tags, strict=True):
            env[var] = (val, tag)
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            vals = [v for v, _ in ins]
            in_tags = [t for _, t in ins]
            outs, out_tags = self.eqn(eqn, vals, in_tags)
            for var, val, tag in zip(eqn.outvars, outs, out_tags, strict=True):
                env[var] = (val, tag)
        results = [read(v) for v in jaxpr.outvars]
        return [v for v, _ in results], [t for _, t in results]

    def bind(self, eqn, vals):
        if not self.concrete:
            return [None] * len(eqn.outvars)
        out = eqn.primitive.bind(*vals, **eqn.params)
        return list(out) if eqn.primitive.multiple_results else [out]

    def eqn(self, eqn, vals, tags):
        name = eqn.primitive.name
        if name in _OPS and any(tags):
            self.record(name, eqn, vals, tags)
        if name == "scan":
            return self.scan(eqn, vals, tags)
        if name == "while":
            return self.while_loop(eqn, vals, tags)
        if name == "cond":
            return self.cond(eqn, vals, tags)
        inner = _inner(eqn)
        if inner is not None:
            return self.run(inner[0], inner[1], vals, tags)
        outs = self.bind(eqn, vals)
        if name in _LAYOUT and tags and tags[0]:
            return outs, [tags[0]] * len(outs)
        return outs, [frozenset()] * len(outs)

    def record(self, name, eqn, vals, tags):
        op = _OPS[name]
        if op == "gather":
            self.visit(op, tags[0], None)
            return
        # The tagged operand is the weight; the other one (lhs or rhs) is the activation.
        for weight_index, activation_index in ((1, 0), (0, 1)):
            if tags[weight_index] and not tags[activation_index]:
                self.visit(op, tags[weight_index], vals[activation_index])

    def scan(self, eqn, vals, tags):
        p = eqn.params
        body, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
        consts, carry, xs = (
            vals[:n_consts],
            vals[n_consts : n_consts + n_carry],
            vals[n_consts + n_carry :],
        )
        const_tags = tags[:n_consts]
        carry_tags = [frozenset()] * n_carry
        xs_tags = tags[n_consts + n_carry :]
        if not self.concrete:
            self.run(body.jaxpr, body.consts, vals, const_tags + carry_tags + xs_tags)
            return self.bind(eqn, vals), [frozenset()] * len(eqn.outvars)
        length = p["length"]
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        ys: dict[int, list[Any]] = {}
        for i in steps:
            x_i = [x[i] for x in xs]
            outs, _ = self.run(
                body.jaxpr, body.consts, consts + carry + x_i, const_tags + carry_tags + xs_tags
            )
            carry, ys[i] = outs[:n_carry], outs[n_carry:]
        n_ys = len(eqn.outvars) - n_carry
        stacked = [jnp.stack([ys[i][k] for i in range(length)]) for k in range(n_ys)]
        return carry + stacked, [frozenset()] * len(eqn.outvars)

    def while_loop(self, eqn, vals, tags):
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = vals[:nc], vals[nc : nc + nb], vals[nc + nb :]
        body_tags = tags[nc : nc + nb] + [frozenset()] * len(carry)
        body = p["body_jaxpr"]
        if not self.concrete:
            self.run(body.jaxpr, body.consts, body_consts + carry, body_tags)
            return self.bind(eqn, vals), [frozenset()] * len(eqn.outvars)
        cond = p["cond_jaxpr"]
        untagged = [frozenset()] * (nc + len(carry))

        def keep_going(carry):
            (flag,), _ = self.run(cond.jaxpr, cond.consts, cond_consts + carry, untagged)
            return bool(flag)

        while keep_going(carry):
            carry, _ = self.run(body.jaxpr, body.consts, body_consts + carry, body_tags)
        return carry, [frozenset()] * len(carry)

    def cond(self, eqn, vals, tags):
        branches = eqn.params["branches"]
        if not self.concrete:
            for branch in branches:
                self.run(branch.jaxpr, branch.consts, vals[1:], tags[1:])
            return self.bind(eqn, vals), [frozenset()] * len(eqn.outvars)
        index = int(jnp.clip(vals[0], 0, len(branches) - 1))
        branch = branches[index]
        outs, _ = self.run(branch.jaxpr, branch.consts, vals[1:], tags[1:])
        return outs, [frozenset()] * len(outs)


def walk(
    fn: Callable[..., Any],
    params: Any,
    args: tuple,
    kwargs: Mapping,
    visit: Visitor,
    *,
    concrete: bool,
) -> None:
    """Walks ``fn(params, *args, **kwargs)`` calling `visit(op, weight_paths, activation)`.

    Args:
      fn: the function; `params` is its first argument.
      params: a pytree of float arrays (or shape/dtype structs when not `concrete`).
      args, kwargs: the other arguments (example inputs).
      visit: called once per use of a parameter; `activation` is None for gathers and in
        symbolic mode.
      concrete: evaluate (True) or only follow tags (False).
    """
    flat_params, _ = jax.tree_util.tree_flatten_with_path(params)
    closed = jax.make_jaxpr(lambda p, a, k: fn(p, *a, **k))(params, tuple(args), dict(kwargs))
    flat_args = jax.tree_util.tree_leaves((params, tuple(args), dict(kwargs)))
    tags = [frozenset({path_string(keys)}) for keys, _ in flat_params]
    tags += [frozenset()] * (len(flat_args) - len(tags))
    values = flat_args if concrete else [None] * len(flat_args)
    _Walker(visit, concrete).run(closed.jaxpr, closed.consts, values, tags)


def param_uses(
    fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any
) -> dict[str, frozenset[str]]:
    """The ops (names from `lowbit.recipes.OPS`) each parameter of `fn` feeds.

    Args:
      fn: ``fn(params, *args, **kwargs)``.
      params: float params pytree (arrays or `jax.ShapeDtypeStruct`s).
      *args, **kwargs: example inputs (arrays or shape/dtype structs).
    Returns:
      {parameter path: frozenset of op names}; parameters that feed no matmul, conv or gather
      are absent.

    Example:
      >>> import jax.numpy as jnp
      >>> uses = param_uses(lambda p, x: x @ p["w"], {"w": jnp.ones((3, 2))}, jnp.ones((1, 3)))
      >>> sorted(uses["w"])
      ['dot_general']
    """
    uses: dict[str, set[str]] = {}

    def visit(op, paths, _):
        for path in paths:
            uses.setdefault(path, set()).add(op)

    walk(fn, params, args, kwargs, visit, concrete=False)
    return {path: frozenset(ops) for path, ops in uses.items()}
