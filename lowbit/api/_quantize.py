"""Post-training quantization of a params pytree by a recipe."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.algorithms import AlgorithmReport, check_algorithm, spanning_processes
from lowbit.api._algorithms import AlgorithmOptions, check_same_recipe, round_with_algorithms
from lowbit.api._trace import layout_axes, trace_params
from lowbit.engine import EXPLICIT_AXES_QUANTIZE
from lowbit.formats import FORMATS
from lowbit.ops import is_prepared, on_explicit_axes, prepare_weights
from lowbit.qarray import Fixed, QArray, QuantConfig, check_values
from lowbit.qarray import quantize as quantize_array
from lowbit.recipes import Recipe, Rule, map_params, param_leaves, path_string, preset

# How a parameter no rule names is matched once a traced use shows its layout: contracted over
# axis 0 it is an `[in, out]` weight like a Flax `kernel`, over axis 1 an `[out, in]` `weight`.
_LAYOUT_BY_AXIS = {0: "kernel", 1: "weight"}


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
    """A `Recipe`, or a preset name turned into one.

    Raises:
      ValueError: for a recipe that rotates (``rotate``): a params tree cannot be rotated
        here, and quantizing it unrotated would silently drop the rotation.
    """
    if isinstance(recipe, str):
        recipe = preset(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe must be a lowbit.recipes.Recipe or a preset name, got "
            f"{type(recipe).__name__}: {recipe!r}"
        )
    if recipe.rotate is not None:
        raise ValueError(
            f"recipe {recipe.name!r} has rotate={recipe.rotate.to_text()!r}, which rotates a "
            "lowbit.models.Decoder before quantizing; rotate it first "
            "(lowbit.serving.rotated_model, or lowbit.models.rotate_model) and quantize with "
            "dataclasses.replace(recipe, rotate=None), or use the CLI, which does both"
        )
    return recipe


def kernel_axes_of(
    fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any
) -> dict[tuple, int]:
    """{key path in `params` (QArrays as leaves): axis} for `fn(params, *args, **kwargs)`.

    Float 2-D leaves count as the weights they will be once quantized, so the axes of weights
    not yet quantized are found too. Nothing is computed (`trace_params`, `layout_axes`).
    """
    return layout_axes(trace_params(fn, params, *args, **kwargs))


def _use_aliases(params: Any, layout_axes: Mapping[tuple, int] | None) -> dict[str, str]:
    """{path: path the recipe matches it as} for 2-D parameters with a traced layout."""
    if not layout_axes:
        return {}
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QArray))[0]
    out = {}
    for keys, _ in flat:
        axis = layout_axes.get(tuple(keys))
        if axis is not None:
            path = path_string(keys)
            out[path] = f"{path}/{_LAYOUT_BY_AXIS[axis]}"
    return out


def check_decisions(
    recipe: Recipe, params: Any, uses, layout_axes: Mapping[tuple, int] | None = None
) -> dict[str, Any]:
    """Decisions per path; raises on the ones a rule asked for but cannot apply.

    `layout_axes` (traced contraction axes by key path): a 2-D parameter that no rule names is
    decided as the layout its use shows (`_LAYOUT_BY_AXIS`), so presets find weights by use.
    """
    report = recipe.report(params, uses)
    aliases = _use_aliases(params, layout_axes)
    if aliases:
        leaves = dict(_param_items(params))
        decisions = []
        for d in report.decisions:
            if d.rule_index is None and d.path in aliases:
                alias = recipe.decide(aliases[d.path], leaves[d.path], uses)
                d = dataclasses.replace(alias, path=d.path)
            decisions.append(d)
        report = dataclasses.replace(report, decisions=tuple(decisions))
    if report.errors:
        lines = "\n".join(f"  {d.path} {d.shape}: {d.reason}" for d in report.errors)
        raise ValueError(
            f"recipe {recipe.name!r} cannot quantize these parameters as asked:\n{lines}\n"
            "add a rule before it for them (weight=None keeps them in float, or pick a group "
            "size that divides the axis)"
        )
    return {d.path: d for d in report.decisions}


def _param_items(params: Any):
    return param_leaves(params)


def _with_algorithm(recipe: Recipe, decisions: Mapping[str, Any]) -> dict[str, tuple[Any, Rule]]:
    """{path: (decision, rule)} of the quantized weights whose rule has an algorithm (checked
    against the weight's format by `lowbit.algorithms.check_algorithm`)."""
    out = {}
    for path, d in decisions.items():
        rule = recipe.rules[d.rule_index] if d.quantized else None
        if rule is None or rule.algorithm is None:
            continue
        check_algorithm(d.rule_index, rule, d.config)
        out[path] = (d, rule)
    return out


def algorithm_weights(
    recipe: Recipe, params: Any, uses=None, layout_axes: Mapping[tuple, int] | None = None
) -> dict[str, tuple[Any, Rule]]:
    """{path: (decision, rule)} of the weights whose matching rule has an algorithm.

    Raises:
      ValueError: as `check_decisions`, and for an algorithm on a format it cannot serve,
        naming both.
    """
    return _with_algorithm(recipe, check_decisions(recipe, params, uses, layout_axes))


def quantize_params(
    params: Any,
    recipe: Recipe | str,
    *,
    fn: Callable[..., Any] | None = None,
    calibration: Iterable[Any] | None = None,
    algorithm_options: AlgorithmOptions | None = None,
    report: AlgorithmReport | None = None,
    uses: Mapping[str, frozenset[str]] | None = None,
    uncalibrated: bool = False,
    layout_axes: Mapping[tuple, int] | None = None,
    strict: bool = False,
    kernel_layouts: bool = False,
    skip: Collection[str] = (),
) -> Any:
    """Quantizes every parameter a recipe selects; the others are returned untouched.

    Weights become packed `QArray`s straight from the float arrays (nothing is re-materialized
    in float). Run the model on the result with `lowbit.api.run`. A weight whose rule has an
    algorithm (`lowbit.recipes.GPTQ`, `AWQ`, `SmoothQuant`, `HQQ`) is rounded by it; those
    that need data read statistics of ``fn(params, *batch)`` over the `calibration` batches.

    Args:
      params: a params pytree (dicts, lists, NNX `State`, Linen variables) of float arrays.
      recipe: a `Recipe` or a preset name.
      fn: ``fn(params, *batch)``, the model the calibration batches run through (needed with
        `calibration`).
      calibration: iterable of batches (a tuple is unpacked into arguments), for rules whose
        algorithm needs data (GPTQ, AWQ, SmoothQuant).
      algorithm_options: `AlgorithmOptions` (padding mask, precomputed statistics,
        sequential GPTQ passes, progress callbacks) for rules with an algorithm.
      report: an `AlgorithmReport` to fill with what each algorithm's weight got.
      uses: ops each parameter feeds (`param_uses`), needed by rules with an `ops` filter.
      uncalibrated: accept rules with `static_activation=True` (and a calibration other than
        `Fixed`) without bounds; their activations are then quantized dynamically until
        `calibrate` sets the bounds.
      layout_axes: traced contraction axes by key path (`kernel_axes_of`): a 2-D parameter no
        rule names by path (``w``, ``qkv``) is matched as the layout its use shows: an
        `[in, out]` ``kernel`` over axis 0, an `[out, in]` ``weight`` over axis 1.
      strict: raise instead of warning when the recipe matches no parameter at all, and
        instead of falling back to round-to-nearest where an algorithm cannot run.
      kernel_layouts: lay the quantized weights the CPU kernels run out in the kernels'
        layout at once (`lowbit.ops.PreparedQArray`, which holds that layout *instead of* the
        codes; `.logical()` gives the QArray back exactly), so no call repacks them. Weights
        whose use is known are laid out for it (`layout_axes`); without a traced use, a 2-D
        ``kernel`` is taken as contracted over axis 0 (Flax's `Linear` / `Dense`) and a 2-D
        ``embedding`` over axis 1 (an `Embed` tied as the output projection; its rows are
        still read from the layout, or it stays logical where they cannot be). Only
        weights held on CPU devices (concrete arrays, not tracers) are laid out; others stay
        logical QArrays. `lowbit.quantize` and `quantize_model` turn it on.
      skip: parameter paths returned as they are although a rule selects them (a caller that
        rounds them itself).
    Returns:
      The same pytree with QArrays in place of the quantized arrays (`PreparedQArray`s where
      `kernel_layouts` laid them out). With AWQ / SmoothQuant the tree also holds the folded
      norm scales (float), so it is the whole model's parameters, not only weights.
    Raises:
      ValueError: if a rule asks for a quantization the parameter's shape cannot take (the
        message names every such parameter), a rule filters on ops and `uses` is missing, a
        rule asks for static activation bounds (use `calibrate`, or pass `uncalibrated=True`),
        or (strict) no rule matches any parameter; for rules with an algorithm: an algorithm
        on a format it cannot serve, a rule that needs data without `fn` and `calibration`
        (naming the rule), too few calibration tokens, NaN/Inf in the calibration inputs
        (`lowbit.algorithms.CalibrationError`), and (strict) a weight that would fall back to
        round-to-nearest.
    Warns:
      UserWarning: when no rule matches any parameter (nothing would be quantized).

    Example:
      >>> import jax.numpy as jnp
      >>> q = quantize_params({"dense": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones(3)}}, "int8w")
      >>> type(q["dense"]["kernel"]).__name__, q["dense"]["bias"].shape
      ('QArray', (3,))
    """
    recipe = as_recipe(recipe)
    if any(spanning_processes(leaf) for _, leaf in param_leaves(params)):
        # Every process is in this call together (its arrays span them): a process with
        # another recipe would compute other programs and wait on collectives forever.
        check_same_recipe(recipe)
    recipe.check_shapes(params)  # a plan chosen for another model names the first mismatch
    decisions = check_decisions(recipe, params, uses, layout_axes)
    wanted = {p: v for p, v in _with_algorithm(recipe, decisions).items() if p not in skip}
    if decisions and all(d.rule_index is None for d in decisions.values()):
        # A preset's rules match parameters by name (e.g. ".*kernel"): a tree named otherwise
        # would come back all float, which must not pass unnoticed.
        names = ", ".join(repr(p) for p in sorted(decisions)[:5])
        message = (
            f"recipe {recipe.name!r} quantizes none of the {len(decisions)} parameters "
            f"({names}{', ...' if len(decisions) > 5 else ''}): its rules match by path "
            f"({', '.join(repr(r.path) for r in recipe.rules[:3])}); pass example inputs "
            "(quantize_model(..., example_args=(x,))) so weights are found by use, or write a "
            "Recipe whose Rule(path=...) names these parameters"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, UserWarning, stacklevel=3)
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

    rounded: dict[str, QArray] = {}
    if wanted:
        params, rounded = round_with_algorithms(
            params,
            recipe,
            wanted,
            quantize_weight,
            fn=fn,
            calibration=calibration,
            options=algorithm_options or AlgorithmOptions(),
            report=AlgorithmReport() if report is None else report,
            strict=strict,
            floats=frozenset(p for p, d in decisions.items() if not d.quantized),
        )

    def one(path: str, leaf: Any) -> Any:
        decision = decisions[path]
        if path in rounded:
            return rounded.pop(path)  # held once: in the result only
        if not decision.quantized or path in skip:
            return leaf
        if not EXPLICIT_AXES_QUANTIZE and on_explicit_axes(leaf):
            raise ValueError(
                f"parameter {path!r} is sharded on a mesh with explicit axes, which JAX "
                f"{jax.__version__} cannot reshape into quantization groups (its sharding rule "
                "for reshape fails); use a mesh with AxisType.Auto axes, or JAX 0.10 or newer"
            )
        try:
            return quantize_weight(leaf, decision.config, recipe.rules[decision.rule_index])
        except ValueError as e:
            if "straddles two shards" not in str(e):
                raise
            raise ValueError(f"parameter {path!r}: {e}") from None

    quantized = map_params(one, params)
    if not kernel_layouts:
        return quantized
    flat = jax.tree_util.tree_flatten_with_path(quantized, is_leaf=lambda x: isinstance(x, QArray))
    axes = {}
    for keys, leaf in flat[0]:
        axis = _serving_axis(layout_axes or {}, tuple(keys))
        if isinstance(leaf, QArray) and axis is not None and _on_cpu(leaf):
            axes[tuple(keys)] = axis
    del flat
    prepared = prepare_weights(quantized, axes)
    return jax.tree_util.tree_map_with_path(
        lambda keys, leaf: _unless_rows_need_codes(tuple(keys), leaf),
        prepared,
        is_leaf=lambda x: isinstance(x, QArray) or is_prepared(x),
    )


def _on_cpu(q: QArray) -> bool:
    """Whether a quantized weight is concrete and held on CPU devices only."""
    codes = q.codes
    if not isinstance(codes, jax.Array) or isinstance(codes, jax.core.Tracer):
        return False
    return all(device.platform == "cpu" for device in codes.devices())


# Flax names -> the axis a use contracts: a `Linear` / `Dense` ``kernel`` is `[in, out]`; an
# `Embed` ``embedding`` `[vocab, dim]` is gathered by rows and, tied as the output projection
# (`Embed.attend`, ``x @ E.T``), contracted over axis 1.
_CONVENTIONAL_AXES = {"kernel": 0, "embedding": 1}


def _param_name(keys: tuple) -> str | None:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in keys]
    while names and names[-1] in ("value", "raw_value"):  # an NNX Variable's own field
        names.pop()
    return names[-1] if names else None


def _serving_axis(layout_axes: Mapping[tuple, int], keys: tuple) -> int | None:
    """The axis a weight is laid out for at quantize time: its traced use, else the Flax
    convention (`_CONVENTIONAL_AXES`), else None (logical)."""
    axis = layout_axes.get(keys)
    if axis is not None:
        return axis
    return _CONVENTIONAL_AXES.get(_param_name(keys))


def _unless_rows_need_codes(keys: tuple, leaf: Any) -> Any:
    """An embedding laid out by convention whose rows the layout cannot return alone (it
    keeps a scale or zero point beside it) goes back to its logical QArray: a lookup would
    otherwise recover the whole table on every call."""
    if is_prepared(leaf) and _param_name(keys) == "embedding" and not leaf.gathers_rows:
        return leaf.logical()
    return leaf


_PARAMS_OPTIONS = frozenset(inspect.signature(quantize_params).parameters) - {"params", "recipe"}


def quantize(params: Any, recipe: Recipe | str, **options: Any) -> Any:
    """`lowbit.quantize`: quantizes a params pytree by a recipe (`quantize_params`).

    The weights the CPU kernels run come back in the kernels' layout (`kernel_layouts=True`,
    see `quantize_params`), so ``jax.jit(lowbit.run(fn))(qparams, x)`` runs at serving speed
    with no per-call repacking; ``kernel_layouts=False`` gives logical QArrays throughout.

    Options of `quantize_params` (``uses``, ``uncalibrated``, ``kernel_layouts``, and for rules
    with an algorithm ``fn``, ``calibration``, ``algorithm_options``, ``report``) are passed to
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
    params_options.setdefault("kernel_layouts", True)
    return quantize_params(params, recipe, **params_options)
