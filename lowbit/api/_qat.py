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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

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
      ``params -> params`` with a `QatWeight` for each selected weight; traceable (decisions
      depend only on paths, shapes and dtypes), so it runs under `jit` and `grad`.
    """
    recipe = as_recipe(recipe)

    def apply(params: Any) -> Any:
        decisions = check_decisions(recipe, params, uses)

        def one(path: str, leaf: Any) -> Any:
            decision = decisions[path]
            if not decision.quantized:
                return leaf
            rule = recipe.rules[decision.rule_index]
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


qat.wrapper = wrapper  # type: ignore[attr-defined]


def convert(params: Any, recipe: Recipe | str, **options: Any) -> Any:
    """`lowbit.convert`: trained float params (or QAT params) to served PTQ params.

    Args:
      params: the float params the QAT loop trained (`QatWeight` leaves are unwrapped).
      recipe: the recipe used for QAT.
      **options: as for `quantize_params`.
    Returns:
      Params with packed `QArray`s whose forward pass equals the QAT forward pass bit for bit.
    """
    floats = jax.tree_util.tree_map(
        lambda x: x.value if isinstance(x, QatWeight) else x,
        params,
        is_leaf=lambda x: isinstance(x, QatWeight),
    )
    return quantize_params(floats, recipe, **options)
