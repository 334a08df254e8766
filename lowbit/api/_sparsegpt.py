"""SparseGPT over a model: capture statistics, prune each weight a `SparseRule` selects.

The math (`lowbit.algorithms.sparsegpt_matrix`) sits below; this is its plumbing, beside the
masks it starts from (`nm_masks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.algorithms import capture, prune_one
from lowbit.api._sparsity import SparseRule, nm_masks
from lowbit.recipes import map_params, param_leaves


def sparsegpt_params(
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
    rule: SparseRule,
    *,
    damp: float = 0.01,
    passes: int = 1,
    row_mask: Callable[..., Any] | None = None,
) -> tuple[Any, dict[str, jax.Array], list[str]]:
    """`lowbit.api.sparsegpt_params`: prune every weight `rule` selects with SparseGPT.

    Statistics come from captures of the model on `batches` (``fn(params, *batch)``). With
    ``passes > 1`` the weights are pruned in that many groups, in the order the model reads them,
    and each group is calibrated on the model with the earlier groups already pruned (the
    sequential mode of the paper: later layers learn to absorb the earlier layers' error).
    Compress the result with `nm_sparsify_params(pruned, rule, masks)`, or train on with the
    masks (`apply_masks`).

    Args:
      fn: the model, ``fn(params, *batch)``.
      params: float params.
      batches: calibration batches (one shape, so the capture compiles once).
      rule: the `SparseRule` (pattern and axis; `rule.values` applies at compression).
      damp: dampening of the Hessian, a fraction of its mean diagonal.
      passes: number of sequential groups (1: one capture of the float model).
      row_mask: ``row_mask(*batch)``, the positions that count (e.g. a padded encoder batch's
        attention mask), as for `lowbit.algorithms.capture`.
    Returns:
      (pruned float params, {path: bool keep mask}, notes: weights that fell back to magnitude
      pruning — no statistics, inputs not along the rule's axis, or a singular Hessian).
    Raises:
      ValueError: as `nm_masks` (the rule selects nothing, `m` does not divide an axis), or
        `passes` < 1.
    """
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"sparsegpt_params: passes={passes!r}; accepted: an int >= 1")
    masks = nm_masks(params, rule)
    batches = list(batches)
    statistics = capture(fn, params, batches, paths=list(masks), row_mask=row_mask)
    seen = statistics.read_order()
    order = [p for p in seen if p in masks] + [p for p in masks if p not in seen]
    size = -(-len(order) // passes)
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    current, notes = params, []
    for i, group in enumerate(groups):
        if i:
            statistics = capture(fn, current, batches, paths=group, row_mask=row_mask)
        leaves = dict(param_leaves(current))
        pruned = {}
        for path in group:
            w = jnp.asarray(leaves[path], jnp.float32)
            stats = statistics.for_path(path)
            new = prune_one(path, w, stats, rule, damp, notes, magnitude=masks[path])
            if new is None:
                pruned[path] = jnp.where(masks[path], leaves[path], 0)
            else:
                pruned[path] = new[0].astype(leaves[path].dtype)
                masks[path] = new[1]
        current = map_params(lambda p, leaf, pruned=pruned: pruned.get(p, leaf), current)
    return current, masks, notes
