"""Post-training quantization of a params pytree by a recipe."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.formats import FORMATS
from lowbit.ops import attach_kernel_layouts
from lowbit.qarray import Fixed, QArray, QuantConfig, check_values
from lowbit.qarray import quantize as quantize_array
from lowbit.recipes import Recipe, Rule, map_params, preset


@functools.partial(jax.jit, static_argnums=1)
def _quantize_jit(x: jax.Array, config: QuantConfig) -> QArray:
    # One compiled quantizer per (config, shape): PTQ, QAT and convert all call this, so QAT's
    # forward and the converted model see bit-identical codes and scales.
    return quantize_array(x, config)


def fixed_bounds(activation: QuantConfig | None) -> jax.Array | None:
    """[2] float32 static bounds from a `Fixed` activation calibration, else None."""
    if activation is None or not isinstance(activation.calibration, Fixed):
        return None
    return jnp.asarray([activation.calibration.lo, activation.calibration.hi], jnp.float32)


def quantize_weight(x: jax.Array, config: QuantConfig, rule: Rule) -> QArray:
    """Quantizes one weight by a resolved config and attaches the rule's activation quantizer.

    Args:
      x: [*shape] float weight.
      config: the resolved weight config (`Decision.config`).
      rule: the matching rule (its `activation` rides on the QArray).
    Returns:
      A packed `QArray`; `activation_bounds` set when the activation calibration is `Fixed`.
    """
    check_values(x, config)  # concrete weights only: refuse all-NaN and misused uint formats
    q = _quantize_jit(x, config)
    if rule.activation is None:
        return q
    return dataclasses.replace(
        q, activation=rule.activation, activation_bounds=fixed_bounds(rule.activation)
    )


def as_recipe(recipe: Recipe | str) -> Recipe:
    """A `Recipe`, or a preset name turned into one."""
    if isinstance(recipe, str):
        return preset(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe must be a lowbit.recipes.Recipe or a preset name, got "
            f"{type(recipe).__name__}: {recipe!r}"
        )
    return recipe


def check_decisions(recipe: Recipe, params: Any, uses) -> dict[str, Any]:
    """Decisions per path; raises on the ones a rule asked for but cannot apply."""
    report = recipe.report(params, uses)
    if report.errors:
        lines = "\n".join(f"  {d.path} {d.shape}: {d.reason}" for d in report.errors)
        raise ValueError(
            f"recipe {recipe.name!r} cannot quantize these parameters as asked:\n{lines}\n"
            "add a rule before it for them (weight=None keeps them in float, or pick a group "
            "size that divides the axis)"
        )
    return {d.path: d for d in report.decisions}


def quantize_params(
    params: Any,
    recipe: Recipe | str,
    *,
    uses: Mapping[str, frozenset[str]] | None = None,
    uncalibrated: bool = False,
    kernel_layouts: bool = True,
    strict: bool = False,
) -> Any:
    """Quantizes every parameter a recipe selects; the others are returned untouched.

    Weights become packed `QArray`s straight from the float arrays (nothing is re-materialized
    in float). Run the model on the result with `lowbit.api.run`.

    Args:
      params: a params pytree (dicts, lists, NNX `State`, Linen variables) of float arrays.
      recipe: a `Recipe` or a preset name.
      uses: ops each parameter feeds (`param_uses`), needed by rules with an `ops` filter.
      uncalibrated: accept rules with `static_activation=True` (and a calibration other than
        `Fixed`) without bounds; their activations are then quantized dynamically until
        `calibrate` sets the bounds.
      kernel_layouts: also store, on each 2-D weight a CPU kernel will run, the kernel's own
        weight layout (`lowbit.ops.attach_kernel_layout`), so that calls do not rebuild it.
        It roughly doubles the resident size of those weights; False skips it.
      strict: raise instead of warning when the recipe's rules match no parameter at all.
    Returns:
      The same pytree with QArrays in place of the quantized arrays.
    Raises:
      ValueError: if a rule asks for a quantization the parameter's shape cannot take (the
        message names every such parameter), a rule filters on ops and `uses` is missing, or a
        rule asks for static activation bounds (use `calibrate`, or pass `uncalibrated=True`).

    Example:
      >>> import jax.numpy as jnp
      >>> q = quantize_params({"dense": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones(3)}}, "int8w")
      >>> type(q["dense"]["kernel"]).__name__, q["dense"]["bias"].shape
      ('QArray', (3,))
    """
    recipe = as_recipe(recipe)
    decisions = check_decisions(recipe, params, uses)
    if recipe.rules and decisions and not any(d.quantized for d in decisions.values()):
        # A preset's rules match parameters by name (e.g. ".*kernel"): a tree named otherwise
        # would come back all float, which must not pass unnoticed.
        names = ", ".join(repr(p) for p in list(decisions)[:5])
        message = (
            f"recipe {recipe.name!r} quantizes none of the {len(decisions)} parameters "
            f"({names}{', ...' if len(decisions) > 5 else ''}): its rules match by path "
            f"({', '.join(repr(r.path) for r in recipe.rules[:3])}); write a Recipe whose "
            "Rule(path=...) names these parameters"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=3)
    for d in decisions.values():
        rule = recipe.rules[d.rule_index] if d.quantized else None
        if rule is not None and rule.algorithm is not None:
            # Rounding to nearest here would silently drop the algorithm.
            raise ValueError(
                f"rule {d.rule_index} (path={rule.path!r}) of recipe {recipe.name!r} uses "
                f"algorithm {rule.algorithm.name!r} for {d.path!r}: quantize with "
                "lowbit.algorithms.quantize_params(params, recipe, fn=..., calibration=batches) "
                "(or lowbit.algorithms.quantize_model(model, recipe, calibration=batches))"
            )
    if not uncalibrated:
        for d in decisions.values():
            rule = recipe.rules[d.rule_index] if d.quantized else None
            if (
                rule is not None
                and rule.static_activation
                and fixed_bounds(rule.activation) is None
            ):
                raise ValueError(
                    f"rule {d.rule_index} (path={rule.path!r}) asks for static activation bounds "
                    f"for {d.path!r}: measure them with lowbit.calibrate(fn, params, batches, "
                    "recipe), or pass uncalibrated=True to quantize them per call until then"
                )

    def one(path: str, leaf: Any) -> Any:
        decision = decisions[path]
        if not decision.quantized:
            return leaf
        return quantize_weight(leaf, decision.config, recipe.rules[decision.rule_index])

    out = map_params(one, params)
    return attach_kernel_layouts(out) if kernel_layouts else out


_PARAMS_OPTIONS = frozenset(inspect.signature(quantize_params).parameters) - {"params", "recipe"}


def quantize(params: Any, recipe: Recipe | str, **options: Any) -> Any:
    """`lowbit.quantize`: quantizes a params pytree by a recipe (`quantize_params`).

    Options of `quantize_params` (``uses``, ``uncalibrated``, ``kernel_layouts``) are passed to
    it; with a preset name, any other option goes to the preset:
    ``quantize(params, "int4_weight_only", group_size=32)`` is
    ``quantize(params, preset("int4_weight_only", group_size=32))``.
    For a single array with a `QuantConfig` or format name, use `lowbit.qarray.quantize`.

    Raises:
      TypeError: if given a single array with a `QuantConfig` / format instead of a recipe, or
        options other than `quantize_params`' with a `Recipe`.
      ValueError: for options the preset does not take.
    """
    if isinstance(recipe, QuantConfig) or (
        isinstance(params, jax.Array) and isinstance(recipe, str) and recipe in FORMATS
    ):
        raise TypeError(
            "lowbit.quantize quantizes a params pytree by a Recipe or preset name; to quantize "
            "one array with a QuantConfig or format use lowbit.qarray.quantize(x, config)"
        )
    preset_options = {k: v for k, v in options.items() if k not in _PARAMS_OPTIONS}
    if preset_options:
        if not isinstance(recipe, str):
            raise TypeError(
                f"lowbit.quantize got options {sorted(preset_options)}, which only a preset name "
                f"takes (e.g. quantize(params, 'int4_weight_only', group_size=32)); a Recipe "
                f"takes only {sorted(_PARAMS_OPTIONS)}"
            )
        recipe = preset(recipe, **preset_options)
    params_options = {k: v for k, v in options.items() if k in _PARAMS_OPTIONS}
    return quantize_params(params, recipe, **params_options)
