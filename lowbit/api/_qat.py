"""Quantization-aware training: float params in, QAT values inside the loss, PTQ params out.

The float params stay the training state (optax sees ordinary arrays of the usual shapes). Inside
the loss, `qat.wrapper(recipe)` wraps every weight the recipe selects as a `QatWeight` holding the
float `value` and `qarray = quantize(value)`; the model runs through `lowbit.api.run`, whose
quantized ops use `qarray` in the forward pass and send straight-through gradients to `value`, so
`jax.grad` of the loss returns gradients in the float params' pytree shape:

    wrap = lowbit.qat.wrapper(recipe)

    def loss(params, x, y):
        logits = lowbit.run(apply)(wrap(params), x)
        return cross_entropy(logits, y)

    grads = jax.grad(loss)(params, x, y)        # same pytree as params
    params = optax.apply_updates(params, opt.update(grads, state, params)[0])

`convert(params, recipe)` then quantizes the trained float params with the same compiled quantizer
and attaches the same activation quantizers, so the served model's forward pass is bit-identical
to the QAT forward pass.

A rule whose weight format is a GGUF block format (``q4_k``, ``q6_k``, ``iq4_nl``, ...) can also
learn its blocks' scales and minimums (`lowbit.api._qat_grid`): ``grids = qat.grid_init(params,
recipe)`` gives llama.cpp's parameters per such weight, ``wrap(params, grids)`` trains on the
grid they give (differentiate with respect to both), and ``convert(params, recipe, grids=grids)``
packs exactly those blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from lowbit.api import _qat_grid
from lowbit.api._quantize import as_recipe, check_decisions, quantize_params, quantize_weight
from lowbit.ops import QatWeight
from lowbit.recipes import Recipe, map_params


def wrapper(
    recipe: Recipe | str, *, uses: Mapping[str, frozenset[str]] | None = None
) -> Callable[[Any], Any]:
    """A function mapping float params to QAT params (call it inside the loss).

    Args:
      recipe: a `Recipe` or preset name.
      uses: ops each parameter feeds, for rules with an `ops` filter (`param_uses`).
    Returns:
      ``(params, grids=None) -> params`` with a `QatWeight` for each selected weight; traceable
      (decisions depend only on paths, shapes and dtypes), so it runs under `jit` and `grad`.
      With `grids` (`grid_init`), the weights it names train on their GGUF grid with those
      parameters (gradients reach both).
    """
    recipe = as_recipe(recipe)

    def apply(params: Any, grids: Mapping[str, Any] | None = None) -> Any:
        decisions = check_decisions(recipe, params, uses)
        _check_grids(grids, decisions)

        def one(path: str, leaf: Any) -> Any:
            decision = decisions[path]
            if not decision.quantized:
                return leaf
            rule = recipe.rules[decision.rule_index]
            if grids is not None and path in grids:
                return _qat_grid.grid_qat_weight(leaf, grids[path], decision.config, rule)
            # The quantized copy carries no gradient: the QAT ops route it to `value` (STE).
            qarray = quantize_weight(jax.lax.stop_gradient(leaf), decision.config, rule)
            return QatWeight(
                value=leaf, qarray=qarray, activation=rule.activation, gradient=rule.gradient
            )

        return map_params(one, params)

    return apply


def qat(params: Any, recipe: Recipe | str, **options: Any) -> Any:
    """`lowbit.qat`: wraps the weights a recipe selects as `QatWeight`s.

    The same as ``wrapper(recipe)(params)``.

    Call it inside the loss (or use `qat.wrapper`) so gradients flow to the float params.

    Args:
      params: float params pytree.
      recipe: a `Recipe` or preset name.
      **options: as for `wrapper`.
    Returns:
      The params with `QatWeight` leaves.
    """
    return wrapper(recipe, **options)(params)


def grid_init(
    params: Any, recipe: Recipe | str, *, uses: Mapping[str, frozenset[str]] | None = None
) -> dict[str, Any]:
    """`lowbit.qat.grid_init`: llama.cpp's block parameters for every weight the recipe puts in
    a GGUF block format with a trainable grid (`lowbit.api._qat_grid`), by path.

    Args:
      params: concrete float params (call it once, outside `jit`).
      recipe, uses: as for `wrapper`.
    Returns:
      ``{path: {"d": ..., "dmin": ..., "scale": ..., "min": ...}}`` float32 arrays (the keys
      the type stores), to train beside the params.
    """
    recipe = as_recipe(recipe)
    return _qat_grid.grid_init(params, recipe, check_decisions(recipe, params, uses))


def _check_grids(grids: Mapping[str, Any] | None, decisions: Mapping[str, Any]) -> None:
    if grids is None:
        return
    for path in grids:
        decision = decisions.get(path)
        if decision is None or not decision.quantized:
            raise ValueError(
                f"grids names {path!r}, which the recipe does not quantize; build grids with "
                "lowbit.qat.grid_init(params, recipe)"
            )
        if _qat_grid.grid_type(decision.config) is None:
            raise ValueError(
                f"grids names {path!r}, whose format {decision.config.format!r} has no GGUF grid"
            )


qat.wrapper = wrapper  # type: ignore[attr-defined]
qat.grid_init = grid_init  # type: ignore[attr-defined]
qat.grid_type = _qat_grid.grid_type  # type: ignore[attr-defined]


def convert(
    params: Any, recipe: Recipe | str, *, grids: Mapping[str, Any] | None = None, **options: Any
) -> Any:
    """`lowbit.convert`: trained float params (or QAT params) to served PTQ params.

    Args:
      params: the float params the QAT loop trained (`QatWeight` leaves are unwrapped).
      recipe: the recipe used for QAT.
      grids: the trained GGUF grid parameters (`grid_init`), if QAT learned them: those
        weights become the blocks they give, byte for byte.
      **options: as for `quantize_params`.
    Returns:
      Params with packed `QArray`s whose forward pass equals the QAT forward pass bit for bit.
    """
    floats = jax.tree_util.tree_map(
        lambda x: x.value if isinstance(x, QatWeight) else x,
        params,
        is_leaf=lambda x: isinstance(x, QatWeight),
    )
    if not grids:
        return quantize_params(floats, recipe, **options)
    recipe = as_recipe(recipe)
    decisions = check_decisions(recipe, floats, options.get("uses"))
    _check_grids(grids, decisions)
    quantized = quantize_params(floats, recipe, skip=tuple(grids), **options)

    def one(path: str, leaf: Any) -> Any:
        if path not in grids:
            return leaf
        decision = decisions[path]
        rule = recipe.rules[decision.rule_index]
        return _qat_grid.grid_qarray(leaf, grids[path], decision.config, rule)

    return map_params(one, quantized)
