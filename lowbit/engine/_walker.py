"""One walk over a jaxpr: every op that reads a parameter (or a re-layout of one), recorded once.

"How is this weight used?" is one question with several readers: the ops each parameter feeds
(rules with an ``ops`` filter), the axis a linear layer contracts each weight over (the kernel
layouts), ... Each is a *reduction* over the `Record` that `walk` builds here, so a model is
traced once (one `jax.make_jaxpr`) and walked once, whatever is asked of it.

`walk` follows values abstractly (no compute). An input leaf is an *origin*; a value that is a
re-layout of one (transpose, reshape, cast, slice, ..., see `LAYOUT_PRIMITIVES`) keeps the
origin and appends the `Step`. Any other op reading a traced value is a use, recorded as a
`Site` (the probe's `lowbit.engine.Use` is the same event seen with values). Sub-jaxprs
(``jit``, ``remat``, custom derivatives, ``scan``, ``while``, ``cond``, ``shard_map``) are
followed through ONE table, `SUB_JAXPRS`: each rule maps the inner jaxpr's inputs to the outer
values (with the step a boundary applies, e.g. the per-iteration slice of a scanned operand)
and says whether the outputs pass back out. A site records the control-flow path it sits
under (``("scan",)``, ``("cond", "branch 1")``, ...), so a reduction can tell a use inside a
loop from one at the top level.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from lowbit.engine import _compat
from lowbit.engine._values import is_quantized, trace_leaves

# Primitives whose output is a re-layout of their first operand: a parameter passing through
# them is still the same parameter.
LAYOUT_PRIMITIVES = frozenset(
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
# Primitive name -> the op name a use reports (the names of `lowbit.recipes.OPS`).
USE_OPS = {
    "dot_general": "dot_general",
    "conv_general_dilated": "conv",
    "ragged_dot": "ragged_dot",
    "ragged_dot_general": "ragged_dot",
    "gather": "gather",
}


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One re-layout between a parameter and the value an op reads.

    Attributes:
      primitive: the layout primitive, or a boundary: ``"scan_slice"`` (one iteration's slice
        of a scanned operand along axis 0), ``"shard_map"`` (the per-device block).
      in_shape, out_shape: shapes before and after.
      in_dtype, out_dtype: dtypes before and after.
      params: the equation's parameters (``permutation``, ...; the specs for ``shard_map``).
    """

    primitive: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_dtype: Any
    out_dtype: Any
    params: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Origin:
    """A traced value: input leaf `leaf` after `steps`."""

    leaf: int
    steps: tuple[Step, ...] = ()

    def then(self, step: Step) -> Origin:
        return Origin(self.leaf, (*self.steps, step))


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """One op reading a traced value: a use site (the probe's `lowbit.engine.Use` is its
    concrete counterpart, with the activation).

    Attributes:
      leaf: index of the input leaf (the parameter).
      primitive: the primitive name (``"dot_general"``, ``"gather"``, ``"add"``, ...).
      op: its name in `lowbit.recipes.OPS` (``"dot_general"``, ``"conv"``, ``"ragged_dot"``,
        ``"gather"``) or ``"other"``.
      operand: the operand index the parameter takes (0 = lhs, 1 = rhs for a dot).
      steps: the re-layouts between the parameter and that operand.
      operands: the avals (shape/dtype) of all the op's operands.
      partners: the origin of each operand (None for one that is no parameter).
      params: the equation's parameters (``dimension_numbers``, ...).
      where: the control-flow path of the op: ``()`` at the top level, e.g.
        ``("scan",)``, ``("while", "body")``, ``("cond", "branch 0")``, ``("shard_map",)``;
        ``jit``/``remat``/custom-derivative bodies add nothing (they run once, as written).
    """

    leaf: int
    primitive: str
    op: str
    operand: int
    steps: tuple[Step, ...]
    operands: tuple[Any, ...]
    partners: tuple[Origin | None, ...]
    params: Mapping[str, Any]
    where: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Record:
    """What `walk` saw.

    Attributes:
      leaves: the avals of the input leaves, in order (`Site.leaf` indexes them).
      sites: every use site, in program order.
    """

    leaves: tuple[Any, ...]
    sites: tuple[Site, ...]


@dataclasses.dataclass(frozen=True)
class Sub:
    """One sub-jaxpr of an equation: the jaxpr, its inputs' origins, the path it adds."""

    jaxpr: Any
    inputs: list[Origin | None]
    where: tuple[str, ...]


# --- the table of sub-jaxpr rules ---
# Each rule: (eqn, origins of its operands) -> (sub-jaxprs, whether the outputs of the (single)
# sub-jaxpr are the equation's outputs). Loop carries start untagged: after one iteration a
# carry is whatever the body made of it, not the parameter.
def _call(eqn: Any, origins: list[Origin | None]) -> tuple[list[Sub], bool]:
    return [Sub(_compat.call_body(eqn), list(origins), ())], True


def _scan_slice(origin: Origin | None, var: Any) -> Origin | None:
    if origin is None:
        return None
    aval = _compat.aval_of(var)
    shape = tuple(aval.shape)
    step = Step("scan_slice", shape, shape[1:], aval.dtype, aval.dtype, {"axis": 0})
    return origin.then(step)


def _scan(eqn: Any, origins: list[Origin | None]) -> tuple[list[Sub], bool]:
    p = _compat.scan_params(eqn)
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    start = n_consts + n_carry
    xs = [_scan_slice(o, v) for o, v in zip(origins[start:], eqn.invars[start:], strict=True)]
    inputs = [*origins[:n_consts], *[None] * n_carry, *xs]
    return [Sub(p["body"], inputs, ("scan",))], False


def _while(eqn: Any, origins: list[Origin | None]) -> tuple[list[Sub], bool]:
    p = _compat.while_params(eqn)
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    n_carry = len(origins) - nc - nb
    return [
        Sub(p["cond"], [*origins[:nc], *[None] * n_carry], ("while", "cond")),
        Sub(p["body"], [*origins[nc : nc + nb], *[None] * n_carry], ("while", "body")),
    ], False


def _cond(eqn: Any, origins: list[Origin | None]) -> tuple[list[Sub], bool]:
    operands = origins[1:]
    return [
        Sub(branch, list(operands), ("cond", f"branch {i}"))
        for i, branch in enumerate(_compat.cond_branches(eqn))
    ], False


def _shard_map(eqn: Any, origins: list[Origin | None]) -> tuple[list[Sub], bool]:
    p = _compat.shard_map_params(eqn)
    body = p["body"]
    inputs = []
    for origin, outer, inner, spec in zip(
        origins, eqn.invars, body.jaxpr.invars, p["in_specs"], strict=True
    ):
        if origin is None:
            inputs.append(None)
            continue
        a, b = _compat.aval_of(outer), _compat.aval_of(inner)
        step = Step(
            "shard_map", tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, {"in_spec": spec}
        )
        inputs.append(origin.then(step))
    return [Sub(body, inputs, ("shard_map",))], False


# The primitives that carry sub-jaxprs, by how their bodies run: once as written (``"call"``:
# jit, remat, custom derivatives), per iteration (``"scan"``, ``"while"``), one branch
# (``"cond"``), per device (``"shard_map"``). Every walk over jaxprs (this one; the
# interpreter's, which the probe steps through) builds its table of rules from this one.
SUB_JAXPR_KINDS: dict[str, str] = {
    "jit": "call",
    "call": "call",
    "remat": "call",
    "custom_jvp_call": "call",
    "custom_vjp_call": "call",
    "scan": "scan",
    "while": "while",
    "cond": "cond",
    "shard_map": "shard_map",
}


def sub_jaxpr_rules(by_kind: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """Primitive name -> rule, from one rule per kind of `SUB_JAXPR_KINDS` (kinds left out of
    `by_kind` are not followed)."""
    return {name: by_kind[kind] for name, kind in SUB_JAXPR_KINDS.items() if kind in by_kind}


SUB_JAXPRS: dict[str, Callable[[Any, list[Origin | None]], tuple[list[Sub], bool]]] = (
    sub_jaxpr_rules(
        {"call": _call, "scan": _scan, "while": _while, "cond": _cond, "shard_map": _shard_map}
    )
)


# --- the walk ---
def _layout_step(eqn: Any) -> Step:
    a, b = _compat.aval_of(eqn.invars[0]), _compat.aval_of(eqn.outvars[0])
    return Step(
        _compat.primitive_name(eqn),
        tuple(a.shape),
        tuple(b.shape),
        a.dtype,
        b.dtype,
        dict(eqn.params),
    )


def _walk(
    jaxpr: Any, inputs: Sequence[Origin | None], where: tuple[str, ...], sites: list[Site]
) -> list[Origin | None]:
    """Walks an open jaxpr whose invars carry `inputs`; returns its outvars' origins."""
    env: dict[Any, Origin] = {v: o for v, o in zip(jaxpr.invars, inputs, strict=True) if o}

    def read(atom: Any) -> Origin | None:
        return None if _compat.is_literal(atom) else env.get(atom)

    for eqn in jaxpr.eqns:
        origins = [read(a) for a in eqn.invars]
        if not any(origins):
            continue
        name = _compat.primitive_name(eqn)
        if name in LAYOUT_PRIMITIVES:
            if name == "optimization_barrier":  # each output is its own operand
                env.update({v: o for v, o in zip(eqn.outvars, origins, strict=True) if o})
            elif origins[0] is not None and not any(origins[1:]):
                env[eqn.outvars[0]] = origins[0].then(_layout_step(eqn))
            continue
        rule = SUB_JAXPRS.get(_compat.rule_name(name) or "")
        if rule is not None:
            subs, passes_out = rule(eqn, origins)
            for sub in subs:
                outs = _walk(sub.jaxpr.jaxpr, sub.inputs, (*where, *sub.where), sites)
                if passes_out:
                    env.update({v: o for v, o in zip(eqn.outvars, outs, strict=True) if o})
            continue
        op = USE_OPS.get(name, "other")
        operands = tuple(_compat.aval_of(a) for a in eqn.invars)
        for i, origin in enumerate(origins):
            if origin is not None:
                kind = "other" if op == "gather" and i != 0 else op
                sites.append(
                    Site(
                        origin.leaf,
                        name,
                        kind,
                        i,
                        origin.steps,
                        operands,
                        tuple(origins),
                        dict(eqn.params),
                        where,
                    )
                )
    return [read(a) for a in jaxpr.outvars]


def walk(closed_jaxpr: Any, leaves: Sequence[int] | None = None) -> Record:
    """Records every op of `closed_jaxpr` that reads one of its inputs (see module docstring).

    Args:
      closed_jaxpr: a `jax.core.ClosedJaxpr` (e.g. from `jax.make_jaxpr`).
      leaves: indices of the inputs to follow (default: all).
    Returns:
      A `Record`; `Site.leaf` is an input index.
    """
    jaxpr = _compat.closed(closed_jaxpr).jaxpr
    n = len(jaxpr.invars)
    follow = set(range(n) if leaves is None else leaves)
    inputs = [Origin(i) if i in follow else None for i in range(n)]
    sites: list[Site] = []
    _walk(jaxpr, inputs, (), sites)
    return Record(tuple(_compat.aval_of(v) for v in jaxpr.invars), tuple(sites))


def ops_fed(record: Record) -> dict[int, frozenset[str]]:
    """{leaf: the ops (`lowbit.recipes.OPS` names) it feeds as a weight}.

    A use counts when the leaf is an operand of a matmul, conv or `ragged_dot` whose other
    operand is no parameter, or the table of a gather. Leaves that feed none are absent.
    """
    found: dict[int, set[str]] = {}
    for site in record.sites:
        if site.op == "other" or site.operand not in (0, 1):
            continue
        if site.op != "gather" and site.partners[1 - site.operand] is not None:
            continue
        found.setdefault(site.leaf, set()).add(site.op)
    return {leaf: frozenset(ops) for leaf, ops in found.items()}


@dataclasses.dataclass(frozen=True)
class Traced:
    """One trace of a function, walked.

    Attributes:
      record: the walk (`Site.leaf` indexes `paths` and `leaves`).
      paths: key path into ``(args, kwargs)`` of each traced input leaf.
      leaves: the arguments' leaves traced, in order (engine values such as a `QArray` are one
        leaf, traced as its logical shape and dtype).
    """

    record: Record
    paths: tuple[tuple, ...]
    leaves: tuple[Any, ...]


def trace(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: Mapping[str, Any],
    follow: Callable[[tuple, Any], bool],
) -> Traced:
    """Traces ``fn(*args, **kwargs)`` once (abstractly: nothing runs) and walks it.

    Args:
      fn: any JAX-traceable function.
      args, kwargs: its arguments. Leaves with a shape (arrays, `jax.ShapeDtypeStruct`s, engine
        values) are traced; the others (flags such as ``deterministic=True``) stay Python.
      follow: ``follow(key path into (args, kwargs), leaf)``: whether the walk follows that
        traced leaf (the parameters; an activation is not followed, or it would hide that a
        matmul's other operand is no parameter).
    Returns:
      The `Traced` walk.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path((args, dict(kwargs)), is_leaf=is_quantized)
    leaves = [leaf for _, leaf in flat]
    dynamic = [i for i, x in enumerate(leaves) if is_quantized(x) or hasattr(x, "shape")]

    closed_jaxpr, _ = trace_leaves(fn, leaves, treedef, dynamic)
    paths = tuple(tuple(flat[i][0]) for i in dynamic)
    traced = tuple(leaves[i] for i in dynamic)
    followed = [i for i, (p, leaf) in enumerate(zip(paths, traced, strict=True)) if follow(p, leaf)]
    return Traced(walk(closed_jaxpr, followed), paths, traced)
