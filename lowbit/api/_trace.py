"""Which ops each parameter feeds, and the axis its linear uses contract.

Both are reductions over one abstract walk of ``fn(params, *args)`` (`trace_params`, the
engine's walker): traced once, it serves every question (`ops_by_path`, `layout_axes`). The
activations that meet a parameter (calibration) need values: they come from the engine's probe
through the one calibration walk, `lowbit.algorithms.walk_batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.engine import Traced, contraction_axes, is_quantized, ops_fed, trace
from lowbit.recipes import path_string


def _in_params(path: tuple, leaf: Any) -> bool:
    """A leaf of ``fn(params, *args)``'s first argument (`path` into ``((params, *args),
    kwargs)``)."""
    return len(path) >= 2 and path[0].idx == 0 and path[1].idx == 0


def trace_params(fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> Traced:
    """``fn(params, *args, **kwargs)`` traced once (abstractly) and walked, `params`' leaves
    followed. Reduce it with `ops_by_path` and `layout_axes`.

    Args:
      fn: the function; `params` is its first argument.
      params: a pytree of arrays, shape/dtype structs or engine values (`QArray`, ...).
      *args, **kwargs: example inputs (arrays or shape/dtype structs).
    Returns:
      The engine's `Traced` walk.
    """
    return trace(lambda p, *a, **k: fn(p, *a, **k), (params, *args), kwargs, _in_params)


def _params_leaves(traced: Traced) -> dict[int, tuple]:
    """{input index: key path inside params} for the traced leaves of params."""
    return {i: path[2:] for i, path in enumerate(traced.paths) if _in_params(path, None)}


def ops_by_path(traced: Traced) -> dict[str, frozenset[str]]:
    """`param_uses` of a `trace_params` walk: {parameter path: op names it feeds}."""
    keys = _params_leaves(traced)
    return {path_string(keys[i]): ops for i, ops in ops_fed(traced.record).items() if i in keys}


def _laid_out(leaf: Any) -> bool:
    """A leaf whose kernel axis is asked for: an engine value, or a 2-D float array (a weight
    not quantized yet, traced as the 2-D weight it will be)."""
    if is_quantized(leaf):
        return True
    dtype = getattr(leaf, "dtype", None)
    return np.ndim(leaf) == 2 and dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def layout_axes(traced: Traced, params: Any = None) -> dict[tuple, int]:
    """`kernel_axes_of` of a `trace_params` walk: {key path in params: contraction axis}.

    Args:
      traced: from `trace_params(fn, float_or_quantized_params, ...)`.
      params: the params to ask about (default: those traced), e.g. the quantized tree of the
        float params traced; key paths with engine values (`QArray`, ...) as leaves.
    Returns:
      {key path: 0 or 1} for the 2-D leaves (`_laid_out`) that `fn`'s linear layers contract
      over one axis (`lowbit.engine.kernel_axes`).
    """
    keys = _params_leaves(traced)
    if params is None:
        leaves = {keys[i]: traced.leaves[i] for i in keys}
    else:
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]
        leaves = {tuple(k): leaf for k, leaf in flat}
    quantized = [i for i, k in keys.items() if k in leaves and _laid_out(leaves[k])]
    return {keys[i]: axis for i, axis in contraction_axes(traced.record, quantized).items()}


def param_uses(
    fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any
) -> dict[str, frozenset[str]]:
    """The ops (names from `lowbit.recipes.OPS`) each parameter of `fn` feeds.

    Traced once, abstractly (`trace_params`); uses inside `jit`, `remat`, custom derivatives,
    `scan`, `while`, `cond` and `shard_map` bodies count.

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
    return ops_by_path(trace_params(fn, params, *args, **kwargs))
