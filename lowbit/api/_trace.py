"""Which ops each parameter feeds, and the activations that meet it there.

Both come from the engine's probe (`lowbit.engine.probe`): the interpreter runs ``fn(params,
*args)`` with every parameter tagged by its path, follows the tags through layout ops and into
`jit`, `remat`, custom derivatives, `scan`, `while` and `cond`, and reports every
`dot_general`, conv, `ragged_dot` or `gather` that reads one (a *use*) with its other operand
(the *activation*).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lowbit.engine import Use, probe
from lowbit.recipes import path_string

Tags = frozenset[str]
# visit(op, weight paths, activation value or None)
Visitor = Callable[[str, Tags, Any], None]


def walk_uses(
    fn: Callable[..., Any],
    params: Any,
    args: tuple,
    kwargs: Mapping,
    visit: Callable[[Use], None],
    *,
    concrete: bool,
) -> Any:
    """Runs ``fn(params, *args, **kwargs)`` through the engine's probe, calling `visit(use)`.

    Args:
      fn: the function; `params` is its first argument.
      params: a pytree of float arrays (or shape/dtype structs when not `concrete`).
      args, kwargs: the other arguments (example inputs).
      visit: called with a `lowbit.engine.Use` for each op reading a parameter.
      concrete: evaluate eagerly (True: loops step by step, real activations) or only follow
        parameters abstractly (False).
    Returns:
      fn's outputs.
    """
    return probe(fn, params, args, dict(kwargs), visit, name=path_string, concrete=concrete)


def walk(
    fn: Callable[..., Any],
    params: Any,
    args: tuple,
    kwargs: Mapping,
    visit: Visitor,
    *,
    concrete: bool,
) -> None:
    """`walk_uses` with a visitor taking ``(op, weight paths, activation or None)``."""
    walk_uses(
        fn,
        params,
        args,
        kwargs,
        lambda u: None if u.op == "other" else visit(u.op, u.paths, u.activation),
        concrete=concrete,
    )


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
