"""`interpret`: run an unmodified JAX function with quantized values in place of float arrays.

The function is traced to a jaxpr with float stand-ins for every quantized leaf, then the jaxpr
is evaluated with the real values. Equations whose operands are all ordinary arrays are bound as
they are; an equation that meets a `QArray` / `QatWeight` goes to its rule (quantized matmul,
layout op on packed values, recursion into a sub-jaxpr), or, without one, dequantizes that
operand — counted in the `EngineReport`, or raised in strict mode.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp  # noqa: F401 - used by the doctest of `probe`
import numpy as np

from lowbit.engine import (
    _compat,
    _control_flow,
    _gather,
    _layout_rules,
    _op_rules,
    _probe,
    _shard_map,
)
from lowbit.engine._report import EngineFallbackError, EngineReport, describe
from lowbit.engine._values import (
    NoRule,
    dequantize,
    is_prepared,
    is_quantized,
    logical,
    map_layout,
    trace_leaves,
)
from lowbit.engine._walker import sub_jaxpr_rules


@dataclasses.dataclass(frozen=True, kw_only=True)
class Context:
    """Per-trace state of one interpretation: where to count, and whether to raise."""

    report: EngineReport
    strict: bool
    # Source location of the innermost enclosing equation that has one: equations inside
    # library functions (jnp.cumsum is itself a jit) point at the user's call through this.
    where: str = "unknown"
    # Set when probing parameters (`probe`): equations reading a `Probe` go to its rules, and
    # report each use to this visitor.
    probe: _probe.Visitor | None = None
    # How loops step and which branch runs (`_control_flow`): as JAX runs them, or step by
    # step on concrete values when probing.
    stepping: _control_flow.Stepping = _control_flow.LAX
    # Key paths of the quantized arguments by `id`, to name a weight in reports and errors.
    names: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def muted(self) -> Context:
        """A context for throwaway shape probes: counts go nowhere, fallbacks never raise."""
        return Context(
            report=EngineReport(),
            strict=False,
            where=self.where,
            names=self.names,
        )

    def entering(self, eqn: Any) -> Context:
        """The context for the sub-jaxprs of `eqn`."""
        return dataclasses.replace(self, where=self.location(eqn))

    def location(self, eqn: Any) -> str:
        return _compat.source_location(eqn) or self.where


# --- evaluation ---
def eval_jaxpr(ctx: Context, closed_jaxpr: Any, args: Sequence[Any]) -> list[Any]:
    """Evaluates a closed jaxpr on values that may be quantized; returns its outputs."""
    jaxpr, consts = _compat.parts(closed_jaxpr)
    env: dict[Any, Any] = {}

    def read(atom):
        return _compat.literal_value(atom) if _compat.is_literal(atom) else env[atom]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    # A probing walk evaluates eagerly: drop each value after its last reader.
    dead = _probe.last_uses(jaxpr) if ctx.probe is not None else None
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(atom) for atom in eqn.invars]
        if dead is not None and any(_probe.is_tagged(v) for v in invals):
            outvals = _probe.apply(_PROBE_SUB_JAXPRS, ctx, eqn, invals)
        elif any(is_quantized(v) for v in invals):
            outvals = apply_rule(ctx, eqn, invals)
        else:
            outvals = _compat.bind_eqn(eqn, invals)
        for var, value in zip(eqn.outvars, outvals, strict=True):
            if not _compat.is_drop_var(var):
                env[var] = value
        if dead is not None:
            for var in dead[i]:
                env.pop(var, None)
    return [read(atom) for atom in jaxpr.outvars]


def apply_rule(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
    """Runs the rule for an equation with quantized operands, or falls back."""
    name = _compat.rule_name(_compat.primitive_name(eqn))
    rule = _RULES.get(name)
    if rule is None:
        return fallback(ctx, eqn, invals, "has no quantized rule")
    try:
        return rule(ctx.entering(eqn), eqn, invals)
    except NoRule as err:
        # Rules raise these before returning outputs: the fallback's outputs are the only ones used.
        return fallback(ctx, eqn, invals, str(err))


def fallback(ctx: Context, eqn: Any, invals: list[Any], reason: str) -> list[Any]:
    """Dequantizes every quantized operand and binds the float equation (strict: raises)."""
    primitive = _compat.primitive_name(eqn)
    location = ctx.location(eqn)
    quantized = [v for v in invals if is_quantized(v)]
    if ctx.strict:
        raise EngineFallbackError(primitive, describe(quantized[0]), location, reason)
    for value in quantized:
        ctx.report.record_fallback(primitive, describe(value), location, reason)
    return _compat.bind_eqn(eqn, [dequantize(v) if is_quantized(v) else v for v in invals])


def relaid_counted(ctx: Context, eqn: Any, value: Any) -> None:
    """Counts a weight that an op re-lays out on every call as a fallback (strict: raises).

    The op still computes on packed values (nothing is dequantized), but repeats per call a
    pass over the weight's codes that preparing it once for this use would save.
    """
    primitive = _compat.primitive_name(eqn)
    location = ctx.location(eqn)
    name = ctx.names.get(id(value))
    what = describe(value) + (f" at {name}" if name else "")
    if is_prepared(value):
        reason = (
            f"was laid out for contraction over axis {value.axis} but is used otherwise here, "
            "so its codes are recovered on every call; lay it out for this use with "
            "lowbit.prepare(params, fn, *example_args)"
        )
    else:
        reason = (
            "is a logical QArray that the CPU kernel lays out on every call; quantize with "
            "lowbit.quantize (kernel_layouts=True, the default) or lay it out once with "
            "lowbit.prepare(params, fn, *example_args)"
        )
    if ctx.strict:
        fix = "in strict mode the engine does not re-lay weights out per call"
        raise EngineFallbackError(primitive, what, location, reason, fix=fix)
    ctx.report.record_fallback(primitive, what, location, reason, materialized=False)


def dequantize_counted(ctx: Context, eqn: Any, value: Any, reason: str) -> Any:
    """One quantized value → float, counted as a fallback of `eqn` (strict: raises)."""
    primitive = _compat.primitive_name(eqn)
    location = ctx.location(eqn)
    if ctx.strict:
        raise EngineFallbackError(primitive, describe(value), location, reason)
    ctx.report.record_fallback(primitive, describe(value), location, reason)
    return dequantize(value)


# --- rules: layout ops ---
def _layout(
    qarray_fn: Callable[..., Any],
    params_fn: Callable[[Any], dict[str, Any]],
    keeps_weight: Callable[[Any, dict[str, Any]], bool] | None = None,
):
    """A rule applying a QArray layout function to the first operand (the other operands, if
    any, are ordinary arrays such as dynamic-slice starts or gather indices).

    `keeps_weight(operand, kwargs)`: the op leaves a 2-D weight the same weight (a transpose,
    cast or copy), so a `PreparedQArray` keeps its kernel layout through it; any other layout
    op makes it logical first (counted in the report as ``"<op>:from_kernel_layout"``).
    """

    def rule(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
        operand, *rest = invals
        if not is_quantized(operand) or any(is_quantized(v) for v in rest):
            raise NoRule("has a quantized value in a non-operand position")
        kwargs = params_fn(eqn)
        name = _compat.primitive_name(eqn)
        same = keeps_weight is not None and operand.ndim == 2 and keeps_weight(operand, kwargs)
        if is_prepared(operand) and not same:
            operand = logical(operand)
            name += ":from_kernel_layout"
        out = map_layout(
            operand,
            lambda q: qarray_fn(q, *rest, **kwargs),
            lambda value: _compat.bind_eqn(eqn, [value, *rest])[0],
        )
        ctx.report.record_layout(name)
        return [out]

    return rule


def _out_shape(eqn: Any) -> tuple[int, ...]:
    return tuple(_compat.aval_of(eqn.outvars[0]).shape)


def _identity(q: Any) -> Any:
    return q


def _always(q: Any, kwargs: dict[str, Any]) -> bool:
    return True


def _float_cast(q: Any, kwargs: dict[str, Any]) -> bool:
    return bool(jax.numpy.issubdtype(kwargs["dtype"], jax.numpy.floating))


def _dynamic_slice(q: Any, *starts: Any, slice_sizes: tuple[int, ...]) -> Any:
    return _layout_rules.dynamic_slice(q, starts[: q.ndim], slice_sizes)


_gather_packed = _layout(
    _gather.gather, lambda e: {"out_shape": _out_shape(e), **_compat.gather_params(e)}
)


def _gather_rows(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
    """Embedding lookup: gathers packed rows and their scales, then dequantizes those rows only.

    A gathered row is an activation (token embeddings), not a weight: returning it packed would
    only move the dequantization to its first consumer, counted there as a fallback.
    """
    table, *rest = invals
    if is_prepared(table) and not any(is_quantized(v) for v in rest):
        rows = _prepared_rows(table, rest[0], eqn)
        if rows is not None:
            ctx.report.record_layout("gather")
            return [rows]
    (rows,) = _gather_packed(ctx, eqn, invals)
    return [dequantize(rows)]


def _prepared_rows(table: Any, indices: Any, eqn: Any) -> Any:
    """`jnp.take(table, ids, axis=a)` on a 2-D `PreparedQArray` along its non-contracted axis,
    read from the kernel panels (a tied embedding's lookup), or None for other gathers."""
    params = _compat.gather_params(eqn)
    dn, sizes = params["dimension_numbers"], params["slice_sizes"]
    row_axis = 1 - table.axis
    if (
        not table.gathers_rows
        or tuple(dn.start_index_map) != (row_axis,)
        or tuple(dn.collapsed_slice_dims) != (row_axis,)
        or tuple(getattr(dn, "operand_batching_dims", ()))
        or sizes[row_axis] != 1
        or sizes[table.axis] != table.shape[table.axis]
        or indices.shape[-1:] != (1,)
    ):
        return None
    n = table.shape[row_axis]
    ids = indices.reshape(-1).astype(jax.numpy.int32)
    valid = (ids >= 0) & (ids < n)
    rows = table.rows(jax.numpy.clip(ids, 0, n - 1)).dequantize()  # [M, K]
    if _compat.is_fill_mode(params["mode"]):
        fill = params["fill_value"] if params["fill_value"] is not None else float("nan")
        rows = jax.numpy.where(valid[:, None], rows, jax.numpy.asarray(fill, rows.dtype))
    out_shape = _out_shape(eqn)
    offset = tuple(dn.offset_dims)
    if offset != (len(out_shape) - 1,):
        return None
    return rows.reshape(out_shape)


_RULES: dict[str, Callable[[Context, Any, list[Any]], list[Any]]] = {
    "dot_general": functools.partial(_op_rules.dot_general, relaid_counted),
    "conv_general_dilated": _op_rules.conv_general_dilated,
    "ragged_dot_general": _op_rules.ragged_dot_general,
    "transpose": _layout(
        _layout_rules.transpose, lambda e: {"permutation": e.params["permutation"]}, _always
    ),
    "reshape": _layout(_layout_rules.reshape, lambda e: {"new_shape": _out_shape(e)}),
    "squeeze": _layout(_layout_rules.reshape, lambda e: {"new_shape": _out_shape(e)}),
    "expand_dims": _layout(_layout_rules.reshape, lambda e: {"new_shape": _out_shape(e)}),
    "broadcast_in_dim": _layout(
        _layout_rules.broadcast_in_dim,
        lambda e: {
            "shape": _out_shape(e),
            "broadcast_dimensions": e.params["broadcast_dimensions"],
        },
    ),
    "slice": _layout(
        _layout_rules.slice_,
        lambda e: {
            "start_indices": e.params["start_indices"],
            "limit_indices": e.params["limit_indices"],
            "strides": e.params.get("strides"),
        },
    ),
    "dynamic_slice": _layout(
        _dynamic_slice, lambda e: {"slice_sizes": _compat.dynamic_slice_sizes(e)}
    ),
    "gather": _gather_rows,
    "convert_element_type": _layout(
        _layout_rules.astype,
        lambda e: {"dtype": _compat.aval_of(e.outvars[0]).dtype},
        _float_cast,
    ),
    "copy": _layout(_identity, lambda e: {}, _always),
}


# --- rules: sub-jaxprs ---
def _named(ctx: Context, outer: Sequence[Any], inner: Sequence[Any]) -> Context:
    """`ctx` also naming the values a `jit` / `remat` body receives after their outer ones."""
    names = {
        id(i): ctx.names[id(o)] for o, i in zip(outer, inner, strict=True) if id(o) in ctx.names
    }
    return dataclasses.replace(ctx, names={**ctx.names, **names}) if names else ctx


def _call(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
    """A body that runs once as written: jit, remat, custom derivatives (their primal)."""
    body = _compat.call_body(eqn)
    run = lambda *args: eval_jaxpr(_named(ctx, invals, args), body, args)
    return ctx.stepping.call(eqn, run, invals)


# One rule per kind of sub-jaxpr (`_walker.SUB_JAXPR_KINDS`), whatever the values: the probe's
# tagged values step through the same rules (`Context.stepping`).
_SUB_JAXPR_RULES = {
    "call": _call,
    "scan": functools.partial(_control_flow.scan_rule, eval_jaxpr, dequantize_counted),
    "while": functools.partial(_control_flow.while_rule, eval_jaxpr, dequantize_counted),
    "cond": functools.partial(_control_flow.cond_rule, eval_jaxpr, dequantize_counted),
    "shard_map": functools.partial(_shard_map.shard_map_rule, eval_jaxpr, dequantize_counted),
}
_RULES.update(sub_jaxpr_rules(_SUB_JAXPR_RULES))
# No shard_map for the probe: a probe meeting one is an "other" use there, its tag dropped (a
# per-device block is not the parameter).
_PROBE_SUB_JAXPRS = sub_jaxpr_rules({k: r for k, r in _SUB_JAXPR_RULES.items() if k != "shard_map"})


# --- public entry points ---
def _is_dynamic(leaf: Any) -> bool:
    return is_quantized(leaf) or isinstance(leaf, jax.Array | np.ndarray | np.generic)


def interpret(
    fn: Callable[..., Any],
    *,
    strict: bool = False,
    report: EngineReport | None = None,
) -> Callable[..., Any]:
    """Wraps `fn` so that it runs with `QArray` / `QatWeight` values in its arguments.

    Args:
      fn: any JAX-traceable function (a Flax NNX module call, a Linen `apply`, a plain function).
      strict: raise `EngineFallbackError` instead of dequantizing a quantized value that meets a
        primitive without a rule.
      report: an `EngineReport` to fill at trace time (reset at the start of each trace).
    Returns:
      A function with the signature of `fn`. Any leaf of its argument pytrees may be a `QArray` or
      a `QatWeight` where `fn` expects a float array of the same shape and dtype. Array leaves are
      traced; other leaves (Python numbers, strings, None) are passed to `fn` as constants. It is
      jit-able and differentiable with respect to float arguments and `QatWeight` values.
      Outputs are what `fn` returns; an output that is a quantized weight passed through
      unchanged by layout ops stays quantized.
    Raises:
      EngineFallbackError: in strict mode, naming the primitive, the value and the source line.

    Example:
      >>> q = lowbit.qarray.quantize(w, "int8", granularity=PerChannel((-1,)))
      >>> y = jax.jit(interpret(lambda w, x: x @ w))(q, x)
    """
    if not callable(fn):
        raise TypeError(f"interpret expects a callable, got {type(fn).__name__}")

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_quantized)
        dynamic = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]

        closed_jaxpr, out_shape = trace_leaves(fn, leaves, treedef, dynamic)
        target = report if report is not None else EngineReport()
        target.reset()
        named = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_quantized)[0]
        # Paths as the user wrote them: past the (args, kwargs) pair and the argument index.
        names = {
            id(leaf): jax.tree_util.keystr(keys[2:]) for keys, leaf in named if is_quantized(leaf)
        }
        ctx = Context(report=target, strict=strict, names=names)
        outs = eval_jaxpr(ctx, closed_jaxpr, [leaves[i] for i in dynamic])
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


def trace_report(
    fn: Callable[..., Any], *args: Any, strict: bool = False, **kwargs: Any
) -> EngineReport:
    """What `interpret(fn)(*args, **kwargs)` would do, found by tracing it without running it.

    Args:
      fn: as for `interpret`.
      *args, **kwargs: the arguments (arrays, `QArray`s, `QatWeight`s or shape stand-ins).
      strict: as for `interpret`.
    Returns:
      The `EngineReport` of that trace.
    Raises:
      EngineFallbackError: in strict mode, for the first fallback.
    """
    report = EngineReport()
    jax.eval_shape(interpret(fn, strict=strict, report=report), *args, **kwargs)
    return report


def probe(
    fn: Callable[..., Any],
    params: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    visit: _probe.Visitor,
    *,
    name: Callable[[Any], str],
) -> Any:
    """Runs ``fn(params, *args, **kwargs)`` with every leaf of `params` probed (see `_probe`).

    Evaluates eagerly (or while traced by `jax.jit`) with the real values, one equation at a
    time: loops step by step, only the taken branch runs (`_control_flow.Stepwise`). Which ops
    a parameter feeds needs no values: ask the walker (`_walker.trace`, `ops_fed`).

    Args:
      fn: any JAX-traceable function taking the params pytree first.
      params: pytree of float arrays.
      args, kwargs: the other arguments.
      visit: called with a `Use` for every op that reads a parameter (or a re-layout of one).
      name: key path of a params leaf → its path string (the tag).
    Returns:
      fn's outputs.

    Example:
      >>> seen = []
      >>> _ = probe(lambda p, x: x @ p["w"], {"w": jnp.ones((3, 2))}, (jnp.ones((1, 3)),), {},
      ...           seen.append, name=jax.tree_util.keystr)
      >>> seen[0].op, sorted(seen[0].paths)
      ('dot_general', ["['w']"])
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    tags = [frozenset({name(keys)}) for keys, _ in flat]
    call_args = (params, tuple(args), dict(kwargs))
    leaves, treedef = jax.tree.flatten(call_args)

    def flat_fn(*values):
        p, a, k = jax.tree.unflatten(treedef, values)
        return fn(p, *a, **k)

    stand_ins = list(jax.eval_shape(lambda *a: a, *leaves))
    closed_jaxpr, out_shape = _compat.make_jaxpr(flat_fn, stand_ins)
    ctx = Context(report=EngineReport(), strict=False, probe=visit, stepping=_probe.STEPWISE)
    values = [
        _probe.Probe(v, tags[i], (), tuple(np.shape(v))) if i < len(tags) else v
        for i, v in enumerate(map(jax.numpy.asarray, leaves))
    ]
    outs = [_probe.raw(v) for v in eval_jaxpr(ctx, closed_jaxpr, values)]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
