"""Every use of JAX internals by the engine, behind one small surface.

The interpreter walks jaxprs, which are not a public API: class locations, primitive names and
parameter names move between JAX releases (``pjit`` became ``jit``, ``checkpoint`` is bound as
``remat2``, ``custom_vjp_call_jaxpr`` became ``custom_vjp_call``, ``get_bind_params`` changed its
return type). Everything that depends on such details lives here, so supporting another JAX
version means editing this module only. Tested on the oldest supported release (0.9, `make
test-jax-compat`) and the newest (`make test`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import core as _public_core

try:  # The supported home of the jaxpr classes.
    from jax.extend import core as _ext_core
except ImportError:  # pragma: no cover - very old releases only
    _ext_core = _public_core

from jax._src import source_info_util as _source_info

ClosedJaxpr = _ext_core.ClosedJaxpr
Jaxpr = _ext_core.Jaxpr
JaxprEqn = _ext_core.JaxprEqn
Literal = _ext_core.Literal
Var = _ext_core.Var
DropVar = getattr(_ext_core, "DropVar", None)
Tracer = _public_core.Tracer

JAX_RELEASE = tuple(int(part) for part in re.findall(r"\d+", jax.__version__)[:3])
"""The running JAX's (major, minor, patch)."""

# Meshes with explicit axes: JAX 0.9's sharding rule for reshaping an explicitly sharded
# dimension fails inside JAX (an IndexError in `reshape`), and quantizing such a weight reshapes
# it into groups. 0.9.2 fails and 0.12 works (tests/engine/test_explicit_sharding.py); 0.10
# and 0.11 are taken to work like 0.12 (not tested).
EXPLICIT_AXES_QUANTIZE = JAX_RELEASE >= (0, 10)

# Names under which the primitives the engine has rules for have been bound. Several aliases per
# rule keep older and newer releases working with the same table.
PRIMITIVE_ALIASES: dict[str, tuple[str, ...]] = {
    "dot_general": ("dot_general",),
    "conv_general_dilated": ("conv_general_dilated",),
    "ragged_dot_general": ("ragged_dot_general", "ragged_dot"),
    "transpose": ("transpose",),
    "reshape": ("reshape",),
    "squeeze": ("squeeze",),
    "expand_dims": ("expand_dims",),
    "broadcast_in_dim": ("broadcast_in_dim",),
    "slice": ("slice",),
    "dynamic_slice": ("dynamic_slice",),
    "gather": ("gather",),
    "convert_element_type": ("convert_element_type",),
    "copy": ("copy", "copy_p"),
    "jit": ("jit", "pjit"),
    "call": ("closed_call", "core_call"),
    "remat": ("remat2", "checkpoint", "remat"),
    "custom_jvp_call": ("custom_jvp_call",),
    "custom_vjp_call": ("custom_vjp_call", "custom_vjp_call_jaxpr"),
    "scan": ("scan",),
    "while": ("while",),
    "cond": ("cond",),
    "shard_map": ("shard_map",),
}

# Primitives the engine relies on being present in the installed JAX (checked by the tests).
REQUIRED_PRIMITIVES = (
    "dot_general",
    "transpose",
    "reshape",
    "squeeze",
    "broadcast_in_dim",
    "slice",
    "dynamic_slice",
    "gather",
    "convert_element_type",
    "scan",
    "while",
    "cond",
)


def rule_name(primitive_name: str) -> str | None:
    """The engine's rule name for a primitive name of the installed JAX, or None."""
    return _ALIAS_TO_RULE.get(primitive_name)


_ALIAS_TO_RULE = {alias: rule for rule, aliases in PRIMITIVE_ALIASES.items() for alias in aliases}


def make_jaxpr(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[ClosedJaxpr, Any]:
    """Traces `fn(*args)` (args: arrays or `jax.ShapeDtypeStruct`s) → (closed jaxpr, out shapes)."""
    return jax.make_jaxpr(fn, return_shape=True)(*args)


# --- jaxpr structure ---
def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def literal_value(atom: Any) -> Any:
    return atom.val


def is_drop_var(var: Any) -> bool:
    return DropVar is not None and isinstance(var, DropVar)


def aval_of(var: Any) -> Any:
    return var.aval


def multiple_results(eqn: Any) -> bool:
    return bool(eqn.primitive.multiple_results)


def primitive_name(eqn: Any) -> str:
    return eqn.primitive.name


def closed(jaxpr: Any) -> ClosedJaxpr:
    """An open `Jaxpr` (no consts) or a `ClosedJaxpr`, as a `ClosedJaxpr`."""
    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr
    return ClosedJaxpr(jaxpr, ())


def parts(closed_jaxpr: ClosedJaxpr) -> tuple[Any, list[Any]]:
    """(open jaxpr, consts) of a closed jaxpr."""
    return closed_jaxpr.jaxpr, list(closed_jaxpr.consts)


def source_location(eqn: Any) -> str:
    """`file:line (function)` of the user code that emitted `eqn`, or ``""`` when unknown."""
    try:
        return _source_info.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - a missing location must never hide the real error
        return ""


def is_concrete(x: Any) -> bool:
    """True for values known at trace time (not tracers)."""
    return not isinstance(x, Tracer)


# --- binding ---
def _bind_params(eqn: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    result = eqn.primitive.get_bind_params(eqn.params)
    # Older releases return (subfuns, params); newer ones return params with "subfuns" inside.
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return tuple(result[0]), dict(result[1])
    return (), dict(result)


@contextlib.contextmanager
def eqn_context(eqn: Any):
    """Source location and per-equation context (mesh, compute type) of `eqn` for new binds."""
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    ctx = getattr(eqn, "ctx", None)
    manager = ctx.manager if ctx is not None else contextlib.nullcontext()
    with _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack), manager:
        yield


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Evaluates `eqn` on ordinary values exactly as `jax.core.eval_jaxpr` does; returns a list."""
    subfuns, params = _bind_params(eqn)
    with eqn_context(eqn):
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# --- parameters of the primitives with sub-jaxprs ---
def call_body(eqn: Any) -> ClosedJaxpr:
    """The evaluated body of jit / closed_call / remat / custom_jvp / custom_vjp equations."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            return closed(eqn.params[key])
    raise KeyError(f"no sub-jaxpr among the params of {eqn.primitive.name}: {sorted(eqn.params)}")


def jit_options(eqn: Any) -> dict[str, Any]:
    return {"inline": bool(eqn.params.get("inline", False)), "name": eqn.params.get("name")}


def remat_options(eqn: Any) -> dict[str, Any]:
    return {
        "prevent_cse": bool(eqn.params.get("prevent_cse", True)),
        "policy": eqn.params.get("policy"),
    }


def scan_params(eqn: Any) -> dict[str, Any]:
    """Scan parameters under stable names: body, num_consts, num_carry, length, reverse, unroll."""
    p = eqn.params
    if "num_consts" in p:
        num_consts, num_carry = int(p["num_consts"]), int(p["num_carry"])
    else:
        # JAX 0.12 describes the operands as a flat tree of (consts, carry, xs) groups.
        consts, carry, _ = p["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carry)
    return {
        "body": closed(p["jaxpr"]),
        "num_consts": num_consts,
        "num_carry": num_carry,
        "length": int(p["length"]),
        "reverse": bool(p["reverse"]),
        "unroll": p.get("unroll", 1),
    }


def while_params(eqn: Any) -> dict[str, Any]:
    p = eqn.params
    return {
        "cond": closed(p["cond_jaxpr"]),
        "body": closed(p["body_jaxpr"]),
        "cond_nconsts": int(p["cond_nconsts"]),
        "body_nconsts": int(p["body_nconsts"]),
    }


def cond_branches(eqn: Any) -> list[ClosedJaxpr]:
    return [closed(b) for b in eqn.params["branches"]]


def shard_map_params(eqn: Any) -> dict[str, Any]:
    """shard_map parameters under the names of the public `jax.shard_map`."""
    p = eqn.params
    manual = p.get("newly_manual_axes", p.get("manual_axes", p.get("axis_names")))
    mesh = p["mesh"]
    return {
        "body": closed(p["jaxpr"]),
        "mesh": mesh,
        "in_specs": tuple(p["in_specs"]),
        "out_specs": tuple(p["out_specs"]),
        "check_vma": bool(p.get("check_vma", p.get("check_rep", True))),
        "axis_names": frozenset(manual if manual is not None else mesh.axis_names),
    }


def gather_params(eqn: Any) -> dict[str, Any]:
    p = eqn.params
    return {
        "dimension_numbers": p["dimension_numbers"],
        "slice_sizes": tuple(p["slice_sizes"]),
        "mode": p["mode"],
        "fill_value": p.get("fill_value"),
        "indices_are_sorted": bool(p.get("indices_are_sorted", False)),
        "unique_indices": bool(p.get("unique_indices", False)),
    }


def dynamic_slice_sizes(eqn: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in eqn.params["slice_sizes"])


def is_fill_mode(mode: Any) -> bool:
    """True for the gather mode that returns `fill_value` for out-of-bounds slices."""
    return jax.lax.GatherScatterMode.from_any(mode) == jax.lax.GatherScatterMode.FILL_OR_DROP


def available_primitives() -> set[str]:
    """Names of the JAX primitives this engine looks up, as found in the installed JAX."""
    # Private JAX modules, imported where used: a release that moves them breaks this call
    # only, not `import lowbit`.
    from jax._src.lax import control_flow, lax, slicing

    found = set()
    for module in (lax, slicing, control_flow):
        for value in vars(module).values():
            name = getattr(value, "name", None)
            if isinstance(name, str) and hasattr(value, "bind"):
                found.add(name)
    return found


def distributed_client() -> Any | None:
    """JAX's key-value store client (the one its multi-host utilities and Orbax use), or None
    before `jax.distributed.initialize`. Its reads take deadlines, unlike a collective barrier,
    so a process that died is noticed instead of waited for."""
    from jax._src import distributed  # where used, as in `available_primitives`

    return distributed.global_state.client
