"""Static activation calibration: run sample batches, record what meets each weight, freeze it.

For every weight whose rule has an activation quantizer, `calibrate` evaluates the float model on
sample batches, records the range of the operand that meets the weight in each matmul / conv
(found by following the weight through the jaxpr: the calibration walk
`lowbit.algorithms.walk_batch`, which `capture` shares), and stores the result as the
QArray's ``activation_bounds = [lo, hi]``; the quantized ops then use these fixed bounds instead of
computing a scale per call.

Methods (per weight; a weight used several times per batch, e.g. in every step of a scan over
stacked layers or by a tied embedding, pools all its uses):

  * ``"max"``            — the running min / max over all batches;
  * ``"moving_average"`` — an exponential moving average of each batch's min / max
    (``momentum`` weights the history), less sensitive to one outlier batch;
  * ``"percentile"``     — each batch's (100 - q, q) percentiles, averaged over batches.

An activation whose calibration is `Fixed` keeps its constant bounds (MaxText's static
``"fixed,lo,hi"`` ranges) and is not measured. The statistics come from the float model, the
usual choice for post-training calibration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit.algorithms import activation_rows, batch_args, kept_rows, walk_batch
from lowbit.api._model import QuantizedModel
from lowbit.api._quantize import as_recipe, quantize_params
from lowbit.engine import Use
from lowbit.qarray import Fixed, QArray
from lowbit.recipes import Recipe, map_params

METHODS = ("max", "moving_average", "percentile")


def _batch_bounds(values: jax.Array, method: str, q: float) -> tuple[float, float]:
    x = np.asarray(values, np.float32).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        return 0.0, 0.0
    if method == "percentile":
        return float(np.percentile(x, 100.0 - q)), float(np.percentile(x, q))
    return float(x.min()), float(x.max())


def activation_ranges(
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
    recipe: Recipe,
    *,
    method: str = "max",
    momentum: float = 0.9,
    q: float = 99.99,
    row_mask: Callable[..., Any] | None = None,
) -> dict[str, tuple[float, float]]:
    """Measured (lo, hi) activation range per calibrated weight path (see module docstring).

    Args:
      fn: ``fn(params, *batch)`` (a batch that is not a tuple is one argument).
      params: float params.
      batches: iterable of batches.
      recipe: the recipe (only weights it quantizes with an activation quantizer are measured).
      method: one of METHODS.
      momentum: history weight of ``"moving_average"``.
      q: percentile of ``"percentile"``.
      row_mask: ``row_mask(*batch)``: the positions of a batch that count (e.g.
        ``lambda tokens, mask: mask`` for padded batches); a matmul input whose rows (its
        non-contracted axes) have the mask's shape is measured only where the mask is set.
        The same walk as `lowbit.algorithms.capture`'s.
    Returns:
      {weight path: (lo, hi)}.
    Raises:
      ValueError: for an unknown method, no batches, or a weight whose rule asks for static
        bounds that was not seen feeding any op.
    """
    if method not in METHODS:
        raise ValueError(f"calibrate: method={method!r}; accepted: {METHODS}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"calibrate: momentum={momentum!r}; accepted: 0 <= momentum < 1")
    report = recipe.report(params)
    wanted = set()
    for d in report.quantized:
        activation = recipe.rules[d.rule_index].activation
        if activation is not None and not isinstance(activation.calibration, Fixed):
            wanted.add(d.path)
    history: dict[str, list[tuple[float, float]]] = {}
    observed: set[str] = set()
    count = 0
    for batch in batches:
        count += 1
        seen: dict[str, tuple[float, float]] = {}

        def visit(use: Use, mask: Any, seen=seen) -> None:
            if use.op == "other":
                return
            observed.update(use.paths)
            activation = use.activation
            if activation is None or not use.paths & wanted:
                return
            if mask is not None and use.op == "dot_general":
                rows, row_shape = activation_rows(use)
                keep = kept_rows(mask, row_shape)
                if keep is not None:  # padded positions run through the model but do not count
                    activation = np.asarray(rows)[np.asarray(keep)]
            for path in use.paths & wanted:
                lo, hi = _batch_bounds(activation, method, q)
                old = seen.get(path, (lo, hi))
                seen[path] = (min(old[0], lo), max(old[1], hi))

        walk_batch(fn, params, batch_args(batch), visit, row_mask=row_mask)
        for path, bounds in seen.items():
            history.setdefault(path, []).append(bounds)
    if count == 0:
        raise ValueError("calibrate: batches is empty; give at least one sample batch")
    missed = sorted(
        d.path
        for d in report.quantized
        if d.path in wanted
        and recipe.rules[d.rule_index].static_activation
        and d.path not in observed
    )
    if missed:
        # A static rule whose weight was never followed into an op would silently stay dynamic.
        raise ValueError(
            f"calibrate: weights {missed} ask for static activation bounds but were not seen "
            "feeding any matmul, conv or gather of fn (params must be fn's first argument, "
            "and ops inside shard_map or custom kernels are not followed)"
        )
    ranges = {}
    for path, seq in history.items():
        lo, hi = np.array([b[0] for b in seq]), np.array([b[1] for b in seq])
        if method == "max":
            ranges[path] = (float(lo.min()), float(hi.max()))
        elif method == "percentile":
            ranges[path] = (float(lo.mean()), float(hi.mean()))
        else:
            avg_lo, avg_hi = lo[0], hi[0]
            for b_lo, b_hi in zip(lo[1:], hi[1:], strict=True):
                avg_lo = momentum * avg_lo + (1 - momentum) * b_lo
                avg_hi = momentum * avg_hi + (1 - momentum) * b_hi
            ranges[path] = (float(avg_lo), float(avg_hi))
    return ranges


def with_activation_bounds(qparams: Any, ranges: dict[str, tuple[float, float]]) -> Any:
    """Sets `activation_bounds` of the QArrays at the paths in `ranges`."""

    def one(path: str, leaf: Any) -> Any:
        if path not in ranges or not isinstance(leaf, QArray):
            return leaf
        lo, hi = ranges[path]
        bounds = jnp.asarray([lo, hi], jnp.float32)
        return dataclasses.replace(leaf, activation_bounds=bounds)

    return map_params(one, qparams)


def calibrate(
    fn: Callable[..., Any] | nnx.Module,
    params: Any,
    batches: Iterable[Any],
    recipe: Recipe | str,
    *,
    method: str = "max",
    momentum: float = 0.9,
    q: float = 99.99,
    row_mask: Callable[..., Any] | None = None,
) -> Any:
    """`lowbit.calibrate`: PTQ with static activation bounds measured on sample batches.

    Args:
      fn: ``fn(params, *batch)``, or an NNX module (then `params` must be None and the module is
        called as ``module(*batch)``).
      params: float params pytree (None for an NNX module).
      batches: iterable of sample batches (a tuple is unpacked into arguments).
      recipe: a `Recipe` or preset name; weights whose rule has an activation quantizer get
        calibrated bounds.
      method: ``"max"``, ``"moving_average"`` or ``"percentile"`` (see module docstring).
      momentum: history weight for ``"moving_average"``.
      q: percentile for ``"percentile"``.
      row_mask: ``row_mask(*batch)``, the positions of a batch that count (see
        `activation_ranges`), e.g. ``lambda tokens, mask: mask``.
    Returns:
      Quantized params with `activation_bounds` set (a `QuantizedModel` for an NNX module).
    Raises:
      ValueError: for an unknown method, empty batches, or `params` given with an NNX module.
    """
    recipe = as_recipe(recipe)
    if isinstance(fn, nnx.Module):
        if params is not None:
            raise ValueError("calibrate: pass params=None with an NNX module (it holds its state)")
        graphdef, params = nnx.split(fn)

        def call(state, *args):
            return nnx.merge(graphdef, state)(*args)

        ranges = activation_ranges(
            call, params, batches, recipe, method=method, momentum=momentum, q=q, row_mask=row_mask
        )
        state = with_activation_bounds(quantize_params(params, recipe, uncalibrated=True), ranges)
        return QuantizedModel(nnx.merge(graphdef, state))
    ranges = activation_ranges(
        fn, params, batches, recipe, method=method, momentum=momentum, q=q, row_mask=row_mask
    )
    return with_activation_bounds(quantize_params(params, recipe, uncalibrated=True), ranges)
