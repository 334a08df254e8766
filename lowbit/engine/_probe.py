"""Probes: follow parameters through a function with the interpreter, and see what meets them.

A `Probe` is the third value type the interpreter carries (besides `QArray` and `QatWeight`): a
float parameter tagged with its path(s). Layout ops (transpose, reshape, slice, cast, the
implicit per-step slice of a `scan` over stacked weights, ...) keep the tag and record the step,
so the layout of the value the op sees can be mapped back to the parameter's axes. A
`dot_general`, conv, `ragged_dot` or `gather` that reads a probe is a *use*, reported to the
probe's visitor with the other operand (the activation), the equation's parameters and, for a
`ragged_dot`, its group sizes (rows ``offset_e .. offset_e + size_e`` of the activation meet
group `e` of the weight: one expert); its output is an ordinary value. Every other op drops the
tag.

A `Scaled` activation (a per-channel factor along its last axis that a parameter can absorb)
keeps its tag through layout ops that keep every element in its last-axis channel: casts, a
reshape or broadcast of the leading axes, a gather of whole rows (``flat[token]``, how routed
experts read their tokens). Anything else reading it is an ``"other"`` use.

The probe evaluates one equation at a time with the actual values, eagerly or while being traced
by `jax.jit` (then the visitor's computations are part of the compiled step): the visitor sees
the real activations, for calibration statistics. Sub-jaxprs run through the interpreter's own
rules (one per kind, `_control_flow`), stepped by `STEPWISE`: a `scan` is unrolled so each
step of a scan over stacked weights reports its layer index, and `while` / `cond` run step by
step / only the taken branch when their predicate is known (under jit a traced predicate runs
the loop or branch as it is, without reporting inside). Questions that need no values (which
ops a parameter feeds) are answered by the walker (`_walker`), not here.

Dead intermediate values are dropped as soon as their last reader has run, so a walk holds
about as much as an eager forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.engine import _compat, _control_flow

# One home for the primitive tables: the walker's (a re-layout keeps the parameter; a use is
# one of `USE_OPS`).
from lowbit.engine._walker import LAYOUT_PRIMITIVES as LAYOUT_PRIMITIVES
from lowbit.engine._walker import USE_OPS as USE_OPS

# Layout primitives that do not move elements: the index map passes through unchanged.
_VALUE_ONLY = frozenset({"convert_element_type", "reduce_precision", "sharding_constraint"})


@dataclasses.dataclass(frozen=True, eq=False)
class Probe:
    """A parameter (or a re-layout of one) tagged with its path(s).

    Attributes:
      value: the array.
      paths: the parameter paths this value is a re-layout of.
      steps: the layout steps from the parameter to this value, as ``(key, fn)`` pairs; `fn`
        applies the same step to an index array (see `Use.weight_indices`).
    """

    value: Any
    paths: frozenset[str]
    steps: tuple[tuple[Any, Callable[[Any], Any]], ...] = ()
    root_shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Scaled:
    """An activation with a per-channel factor along its last axis that a parameter can absorb:
    a per-channel scale of its matmul consumers can be folded into one of `sources`.

    A source ``(path, axis)`` is either a 1-D parameter `p` of ``a * p`` (the output of a
    norm's scale; axis 0), or a 2-D weight `W` of ``x @ W`` whose output axis `axis` is the
    activation's last axis (a linear layer feeding another). Elementwise products keep the
    factor, so the product of two `Scaled` values (a gated MLP's ``act(x @ G) * (x @ U)``) can
    fold into either's sources.

    Attributes:
      value: the array.
      sources: ``frozenset({(path, axis), ...})``.
    """

    value: Any
    sources: frozenset[tuple[str, int]]


@dataclasses.dataclass(frozen=True, eq=False)
class Use:
    """One op reading a probed parameter.

    Attributes:
      op: ``"dot_general"``, ``"conv"``, ``"ragged_dot"`` or ``"gather"``.
      paths: the parameter paths of the weight operand.
      weight: the weight operand as the op sees it (a `Probe`).
      weight_operand: its operand index (0 = lhs, 1 = rhs).
      activation: the other operand (None for a gather).
      params: the equation's parameters (dimension numbers, ...).
      location: ``file:line (function)`` of the user code, or ``"unknown"``.
      activation_scale: the `Scaled.sources` of the activation when the op contracts its last
        axis, or None.
      group_sizes: for a `ragged_dot`, its ``[groups]`` int operand (None for other ops):
        the activation's rows come grouped contiguously, group `e` being rows
        ``sum(group_sizes[:e]) .. sum(group_sizes[:e + 1])``.

    ``op == "other"`` reports a parameter (`paths`) or a `Scaled` activation read by any other
    op: for a 1-D scale parameter it means a fold into it would change more than the matmuls.
    """

    op: str
    paths: frozenset[str]
    weight: Probe | None
    weight_operand: int
    activation: Any
    params: dict[str, Any]
    location: str
    activation_scale: frozenset[tuple[str, int]] | None = None
    group_sizes: Any = None

    @property
    def layout_key(self) -> tuple[Any, ...]:
        """Equal keys mean the same chain of layout steps (for caching `weight_indices`)."""
        return tuple(key for key, _ in self.weight.steps)

    def weight_indices(self, param_shape: Sequence[int]) -> jax.Array:
        """For each element of the weight operand, its flat index in the parameter.

        Args:
          param_shape: shape of the parameter (`paths`' leaf).
        Returns:
          [*weight.value.shape] int32: ``indices[i] = ravel_multi_index(parameter position)``.
        """
        # Concrete even while the probe itself is being traced (a jitted calibration step).
        with jax.ensure_compile_time_eval():
            ids = jnp.arange(int(np.prod(param_shape)), dtype=jnp.int32).reshape(param_shape)
            for _, fn in self.weight.steps:
                ids = fn(ids)
            return ids


Visitor = Callable[[Use], None]


def is_probe(x: Any) -> bool:
    return isinstance(x, Probe)


def is_tagged(x: Any) -> bool:
    """A value the probe rules handle: a `Probe` or a `Scaled` activation."""
    return isinstance(x, Probe | Scaled)


def raw(x: Any) -> Any:
    return x.value if isinstance(x, Probe | Scaled) else x


def _step_key(eqn: Any, rest: list[Any]) -> tuple[Any, ...]:
    keys = []
    for value in rest:
        try:
            keys.append(int(value))
        except (TypeError, jax.errors.ConcretizationTypeError):
            keys.append(None)
    return (id(eqn), tuple(keys))


def _layout(ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
    operand, *rest = invals
    name = _compat.primitive_name(eqn)
    outs = _compat.bind_eqn(eqn, [raw(v) for v in invals])
    if isinstance(operand, Scaled):
        if name in _VALUE_ONLY or name in ("copy", "copy_p") or _keeps_channels(eqn, invals):
            return [Scaled(outs[0], operand.sources), *outs[1:]]
        _other(ctx, eqn, invals)
        return outs
    if not is_probe(operand) or any(is_probe(v) for v in rest):
        if name == "optimization_barrier":
            # Each output is its own operand: keep every tag.
            return [
                Probe(o, v.paths, v.steps, v.root_shape) if is_probe(v) else o
                for o, v in zip(outs, invals, strict=True)
            ]
        return outs
    if name == "optimization_barrier":
        return [Probe(outs[0], operand.paths, operand.steps, operand.root_shape), *outs[1:]]
    if name in _VALUE_ONLY:
        step = ((name,), lambda ids: ids)
    else:
        step = (
            _step_key(eqn, rest),
            lambda ids, eqn=eqn, rest=tuple(rest): _compat.bind_eqn(eqn, [ids, *rest])[0],
        )
    return [Probe(outs[0], operand.paths, (*operand.steps, step), operand.root_shape), *outs[1:]]


# Layout ops that can keep every element of a `Scaled` value in its last-axis channel (checked
# per equation by `_keeps_channels`); one data operand each, the rest are indices.
_CHANNEL_LAYOUT = frozenset(
    {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "rev"}
    | {"gather", "dynamic_slice"}
)


def _keeps_channels(eqn: Any, invals: list[Any]) -> bool:
    """Whether the op sends every element of its `Scaled` operand (operand 0) to an element of
    the same last-axis channel, so the output carries the same per-channel factor.

    Checked by running the op on channel ids. Index operands unknown at trace time (a jitted
    walk) are taken as zeros: an op whose output keeps the last axis whole reads it at offset
    0 whatever the index (gathers and dynamic slices clamp), so the ids answer for any index.
    """
    operand, *rest = invals
    shape = np.shape(raw(operand))
    if _compat.primitive_name(eqn) not in _CHANNEL_LAYOUT or not shape:
        return False
    n = shape[-1]
    with jax.ensure_compile_time_eval():
        ids = np.broadcast_to(np.arange(n, dtype=np.int32), shape)
        rest = [
            raw(v) if _compat.is_concrete(raw(v)) else np.zeros(np.shape(raw(v)), raw(v).dtype)
            for v in rest
        ]
        out = np.asarray(_compat.bind_eqn(eqn, [jnp.asarray(ids), *rest])[0])
    return out.shape[-1:] == (n,) and np.array_equal(out, np.broadcast_to(np.arange(n), out.shape))


def _dot_dims(params: dict[str, Any]) -> Any:
    """``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` of a dot_general or a
    ragged_dot (None for a conv)."""
    if "ragged_dot_dimension_numbers" in params:
        return params["ragged_dot_dimension_numbers"].dot_dimension_numbers
    return params.get("dimension_numbers")


def _use(ctx: Any, eqn: Any, invals: list[Any], op: str) -> None:
    visit: Visitor = ctx.probe
    location = ctx.location(eqn)
    if op == "gather":
        if is_probe(invals[0]):
            visit(Use(op, invals[0].paths, invals[0], 0, None, dict(eqn.params), location))
        return
    for weight_index, activation_index in ((1, 0), (0, 1)):
        weight, activation = invals[weight_index], invals[activation_index]
        if is_probe(weight) and not is_probe(activation):
            scale = None
            if isinstance(activation, Scaled):
                dims = _dot_dims(eqn.params) if op != "conv" else None
                contract = None if dims is None else tuple(dims[0][activation_index])
                if contract == (np.ndim(activation.value) - 1,):
                    scale = activation.sources
                else:
                    _other(ctx, eqn, [activation])
            sizes = raw(invals[2]) if op == "ragged_dot" else None
            visit(
                Use(
                    op,
                    weight.paths,
                    weight,
                    weight_index,
                    raw(activation),
                    dict(eqn.params),
                    location,
                    scale,
                    sizes,
                )
            )
        elif isinstance(activation, Scaled) and not is_probe(weight):
            _other(ctx, eqn, [activation])


def _other(ctx: Any, eqn: Any, invals: list[Any]) -> None:
    """Reports parameters and scaled activations read by an op without a probe rule (the
    parameters read themselves with ``params={"direct": True}``, the sources of scaled
    activations without)."""
    direct, sources = set(), set()
    for v in invals:
        if is_probe(v):
            direct |= v.paths
        elif isinstance(v, Scaled):
            sources |= {path for path, _ in v.sources}
    for paths, params in ((direct, {"direct": True}), (sources, {})):
        if paths:
            ctx.probe(Use("other", frozenset(paths), None, -1, None, params, ctx.location(eqn)))


def _channel_scale(ctx: Any, eqn: Any, invals: list[Any]) -> list[Any] | None:
    """``a * p`` with `p` a 1-D parameter broadcast along the last axis, ``a * s`` with `s`
    already `Scaled`, or the product of two `Scaled` values → a `Scaled` output."""
    if len(invals) != 2 or not any(is_tagged(v) for v in invals):
        return None
    out = _compat.bind_eqn(eqn, [raw(v) for v in invals])[0]
    if not np.shape(out):
        return None
    if all(isinstance(v, Scaled) for v in invals):
        if any(np.shape(v.value)[-1:] != np.shape(out)[-1:] for v in invals):
            return None
        return [Scaled(out, invals[0].sources | invals[1].sources)]
    if sum(is_tagged(v) for v in invals) != 1:
        return None
    tagged = invals[0] if is_tagged(invals[0]) else invals[1]
    if np.shape(tagged.value)[-1:] != np.shape(out)[-1:]:
        return None
    if isinstance(tagged, Scaled):
        return [Scaled(out, tagged.sources)]
    p = tagged
    if len(p.paths) != 1 or len(p.root_shape) != 1:
        return None
    n = p.root_shape[0]
    ids = np.asarray(Use("mul", p.paths, p, 0, None, {}, "").weight_indices(p.root_shape))
    if ids.shape[-1] != n or not np.array_equal(
        ids.reshape(-1, n), np.broadcast_to(np.arange(n), (ids.size // n, n))
    ):
        return None
    return [Scaled(out, frozenset({(next(iter(p.paths)), 0)}))]


def _linear_output(eqn: Any, invals: list[Any], out: Any) -> Any:
    """``x @ W`` with `W` a 2-D parameter used as it is (rhs, one free axis, no batch axes), or
    ``ragged_dot(x, W, sizes)`` with `W` a ``[groups, in, out]`` parameter used as it is
    → a `Scaled` output (its last axis is W's output axis, the same channel for every group);
    anything else → `out`."""
    weight = invals[1]
    if not is_probe(weight) or is_probe(invals[0]) or len(weight.paths) != 1:
        return out
    ndim = 2
    if "ragged_dot_dimension_numbers" in eqn.params:
        ragged = eqn.params["ragged_dot_dimension_numbers"]
        if tuple(ragged.rhs_group_dimensions) != (0,) or tuple(ragged.lhs_ragged_dimensions) != (
            0,
        ):
            return out
        ndim = 3
    (lc, rc), (_, rb) = _dot_dims(eqn.params)
    if rb or len(weight.root_shape) != ndim or np.ndim(weight.value) != ndim or len(rc) != 1:
        return out
    if ndim == 3 and (tuple(rc) != (1,) or tuple(lc) != (np.ndim(raw(invals[0])) - 1,)):
        return out
    if any(len(key) != 1 for key, _ in weight.steps):  # only value-only steps (casts)
        return out
    axis = 2 if ndim == 3 else 1 - int(rc[0])
    return Scaled(out, frozenset({(next(iter(weight.paths)), axis)}))


# --- sub-jaxprs ---
def _scan_step(x: Any, i: int) -> Any:
    """Step `i` of a scanned operand; a probe keeps its tag, the step recording the index."""
    if not is_probe(x):
        return jax.tree.map(lambda a: a[i], raw(x))
    step = (("scan_step", i), lambda ids, i=i: ids[i])
    return Probe(x.value[i], x.paths, (*x.steps, step), x.root_shape)


# How the interpreter's sub-jaxpr rules step while probing: on concrete values, step by step.
STEPWISE = _control_flow.Stepwise(untag=raw, step_of=_scan_step)

Rule = Callable[[Any, Any, list[Any]], list[Any]]


def apply(sub_jaxprs: Mapping[str, Rule], ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
    """Evaluates one equation that has a probe among its operands (see the module docstring).

    `sub_jaxprs`: the interpreter's rules for the sub-jaxprs the probe follows, by primitive
    (called as ``rule(ctx, eqn, invals)``; `ctx.stepping` is `STEPWISE`).
    """
    name = _compat.primitive_name(eqn)
    if name in ("dot_general", "ragged_dot_general"):
        _use(ctx, eqn, invals, USE_OPS[name])
        out = _compat.bind_eqn(eqn, [raw(v) for v in invals])[0]
        return [_linear_output(eqn, invals, out)]
    if name == "gather" and isinstance(invals[0], Scaled):
        return _layout(ctx, eqn, invals)
    if name in USE_OPS:
        _use(ctx, eqn, invals, USE_OPS[name])
    elif name in LAYOUT_PRIMITIVES:
        return _layout(ctx, eqn, invals)
    elif name == "mul":
        scaled = _channel_scale(ctx, eqn, invals)
        if scaled is not None:
            return scaled
    rule = sub_jaxprs.get(_compat.rule_name(name) or "")
    if rule is not None:
        return rule(ctx.entering(eqn), eqn, invals)
    if name not in USE_OPS:
        _other(ctx, eqn, invals)
    return _compat.bind_eqn(eqn, [raw(v) for v in invals])


def last_uses(jaxpr: Any) -> list[list[Any]]:
    """For each equation of an open jaxpr, the variables read for the last time there."""
    last: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for atom in eqn.invars:
            if not _compat.is_literal(atom):
                last[atom] = i
    for atom in jaxpr.outvars:
        if not _compat.is_literal(atom):
            last.pop(atom, None)
    dead: list[list[Any]] = [[] for _ in jaxpr.eqns]
    for var, i in last.items():
        dead[i].append(var)
    return dead
