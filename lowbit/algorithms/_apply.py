"""Recipes whose rules carry an algorithm: capture statistics, then round with the algorithm.

`quantize_params` is `lowbit.api.quantize_params` plus the rules' algorithms: weights whose rule
has none are rounded to nearest exactly as there; the others get GPTQ / HQQ codes on the same
layout. Data-driven algorithms read statistics captured from the float model on calibration
batches through the engine (`capture`). Every weight an algorithm was asked for appears in the
`AlgorithmReport` with what it got.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from lowbit.algorithms._capture import (
    CalibrationError,
    Statistics,
    capture,
    single_matrix_use,
)
from lowbit.algorithms._clip import clip_search
from lowbit.algorithms._gptq import gptq_qarray
from lowbit.algorithms._hqq import hqq_qarray
from lowbit.algorithms._smooth import (
    apply_factors,
    fold_factors,
    input_scales,
    plan_folds,
    scale_leaf,
)
from lowbit.api import QuantizedLinen, QuantizedModel
from lowbit.api import quantize_model as api_quantize_model
from lowbit.api import quantize_params as api_quantize_params
from lowbit.api._quantize import as_recipe, check_decisions, quantize_weight
from lowbit.ops._host_memory import release_free_memory
from lowbit.qarray import QArray
from lowbit.recipes import AWQ, GPTQ, HQQ, Recipe, SmoothQuant, map_params, param_leaves

IMPLEMENTED = (GPTQ, HQQ, AWQ, SmoothQuant)
# Input rows kept per weight for SmoothQuant's alpha search.
SMOOTHQUANT_SAMPLE_ROWS = 1024


def sample_rows(recipe: Recipe) -> int:
    """Input rows to sample per weight while capturing statistics for `recipe`."""
    search = any(isinstance(r.algorithm, SmoothQuant) and r.algorithm.grid for r in recipe.rules)
    return SMOOTHQUANT_SAMPLE_ROWS if search else 0


@dataclasses.dataclass
class AlgorithmReport:
    """Per weight whose rule names an algorithm: what it got.

    Attributes:
      applied: {path: description} e.g. ``"gptq (damp 0.01, 4096 tokens)"`` or
        ``"rtn: Hessian singular after dampening"``.
      notes: other remarks (fallbacks per layer).
      statistics: the captured `Statistics` (None for data-free recipes).
    """

    applied: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    statistics: Statistics | None = None

    def lines(self) -> list[str]:
        return [f"{path}: {what}" for path, what in self.applied.items()] + self.notes


def _strip(recipe: Recipe) -> Recipe:
    rules = tuple(dataclasses.replace(r, algorithm=None) for r in recipe.rules)
    return Recipe(rules=rules, name=recipe.name)


def algorithm_weights(recipe: Recipe, params: Any, uses=None) -> dict[str, Any]:
    """{path: (decision, rule)} of the weights whose matching rule has an algorithm.

    Raises:
      ValueError: for an algorithm on a format it cannot serve, naming both.
    """
    decisions = check_decisions(recipe, params, uses)
    out = {}
    for path, d in decisions.items():
        if not d.quantized:
            continue
        rule = recipe.rules[d.rule_index]
        algorithm = rule.algorithm
        if algorithm is None:
            continue
        if not isinstance(algorithm, IMPLEMENTED):
            raise ValueError(
                f"rule {d.rule_index} (path={rule.path!r}) asks for {algorithm.name!r}, which this "
                f"version does not implement; accepted: {[a.name for a in IMPLEMENTED]}"
            )
        if isinstance(algorithm, HQQ) and d.config.symmetric:
            raise ValueError(
                f"rule {d.rule_index} (path={rule.path!r}): algorithm 'hqq' optimizes zero points "
                f"but format {d.config.format!r} is symmetric (no zero point); use an asymmetric "
                "uintN weight config (symmetric=False)"
            )
        if isinstance(algorithm, SmoothQuant) and rule.activation is None:
            raise ValueError(
                f"rule {d.rule_index} (path={rule.path!r}): algorithm 'smoothquant' moves "
                f"activation outliers into the weights, but the rule quantizes weights only "
                f"({d.config.format!r}, activation=None); give an activation config (w8a8, w4a8) "
                "or use 'awq' / 'gptq' for weight-only formats"
            )
        out[path] = (d, rule)
    return out


def quantize_with_report(
    params: Any,
    recipe: Recipe | str,
    *,
    fn: Callable[..., Any] | None = None,
    calibration: Iterable[Any] | None = None,
    row_mask: Callable[..., Any] | None = None,
    statistics: Statistics | None = None,
    strict: bool = False,
    uses: Mapping[str, frozenset[str]] | None = None,
    kernel_layouts: bool = False,
    on_batch: Callable[[int], None] | None = None,
    on_weight: Callable[[int, int], None] | None = None,
    sequential: int = 1,
) -> tuple[Any, AlgorithmReport]:
    """`quantize_params` that also returns the `AlgorithmReport`.

    Args:
      params: float params pytree.
      recipe: a `Recipe` or preset name.
      fn: ``fn(params, *batch)``, needed with `calibration`.
      calibration: iterable of batches (a tuple is unpacked into arguments), for rules whose
        algorithm needs data (GPTQ, AWQ, SmoothQuant).
      row_mask: ``row_mask(*batch)``: the positions of a batch that count (e.g.
        ``lambda tokens, mask: mask`` for padded encoder batches), as for
        `lowbit.algorithms.capture`.
      statistics: already captured `Statistics` (shared between recipes) instead of batches.
      strict: raise instead of falling back to RTN for a weight (singular Hessian, no stats).
      uses: as for `lowbit.api.quantize_params`.
      kernel_layouts: as for `lowbit.api.quantize_params` (False: the result is logical; lay
        it out for the CPU kernels with `lowbit.prepare_for_kernels`).
      on_batch / on_weight: progress callbacks (batches done; weights done, total).
      sequential: GPTQ in this many passes (as in the GPTQ paper, for deep models): the GPTQ
        weights are split in groups in the order the model reads them, and group i is
        calibrated on the model whose earlier groups are already quantized. Each pass runs
        the calibration batches again (so `calibration` must be re-iterable, e.g. a list).
    Returns:
      (quantized params, report). With AWQ / SmoothQuant the returned tree also holds the
      folded norm scales (float), so it is the whole model's parameters, not only weights.
    Raises:
      ValueError: a rule needs data and none was given (naming the rule), an algorithm on a
        format it cannot serve, too few calibration tokens (saying how many are needed), NaN/Inf
        in calibration inputs (`CalibrationError`, naming the layer), and in strict mode a
        weight that would fall back to RTN.
    """
    recipe = as_recipe(recipe)
    if kernel_layouts:
        api_quantize_params(params, recipe, kernel_layouts=True)  # raises, saying what to use
    wanted = algorithm_weights(recipe, params, uses)
    report = AlgorithmReport()
    if not wanted:
        return api_quantize_params(params, _strip(recipe), uses=uses), report
    data_paths = [p for p, (_, rule) in wanted.items() if rule.algorithm.needs_data]
    if data_paths and statistics is None:
        if calibration is None or fn is None:
            first = wanted[data_paths[0]][1]
            index = recipe.rules.index(first)
            raise ValueError(
                f"recipe {recipe.name!r}: rule {index} (path={first.path!r}) uses algorithm "
                f"{first.algorithm.name!r}, which needs calibration data; pass fn=... and "
                "calibration=<iterable of batches> (lowbit.algorithms.quantize_params), or use a "
                "data-free algorithm (hqq)"
            )
        statistics = capture(
            fn,
            params,
            calibration,
            paths=data_paths,
            sample_rows=sample_rows(recipe),
            row_mask=row_mask,
            on_batch=on_batch,
        )
    report.statistics = statistics
    if sequential < 1 or (sequential > 1 and (fn is None or calibration is None)):
        raise ValueError(
            f"sequential={sequential!r}: accepted an int >= 1; sequential > 1 recalibrates "
            "between passes, so it needs fn and calibration (not precomputed statistics)"
        )
    folding = {p: v for p, v in wanted.items() if _folds(v[1].algorithm)}
    factors: dict[str, list] = {}
    in_op: dict[str, Any] = {}  # weights whose scale the op applies: {path: input_scale}
    if folding:
        folds, skipped = plan_folds(dict(param_leaves(params)), folding, statistics)
        if skipped and strict:
            lines = "; ".join(f"{p}: {why}" for p, why in skipped.items())
            raise ValueError(f"strict mode: no scale to fold for {lines}")
        axes = {p: statistics.for_path(p)[0].input_axes[0] for f in folds for p in f.weights}
        factors = fold_factors(folds, axes)
        ndims = {p: np.ndim(leaf) for p, leaf in param_leaves(params) if p in axes}
        in_op = input_scales(folds, axes, ndims)
        # Parameters no algorithm rounds (norm scales) absorb their factors now; the rounded
        # weights are scaled one at a time as each is rounded, so the model never has a second
        # float copy of its weights.
        params = apply_factors(params, {p: f for p, f in factors.items() if p not in wanted})
        for fold in folds:
            for p in fold.weights:
                report.applied[p] = fold.note
        for p, why in skipped.items():
            report.applied[p] = why
        statistics = _Rescaled(statistics, folds)
    floats = dict(param_leaves(params))

    def scaled(path: str) -> Any:
        """The float weight at `path` with its folded scales."""
        return scale_leaf(floats[path], factors[path]) if path in factors else floats[path]

    # Weights without an algorithm are rounded to nearest here; the algorithm's weights stay
    # float (the arrays `params` holds) and are replaced below one at a time.
    out = dict(param_leaves(api_quantize_params(params, _strip(recipe), uses=uses, skip=wanted)))
    replaced: dict[str, QArray] = {}
    if sequential > 1:
        # `params` already holds the norms' factors: scale only the weights here (applying
        # every factor again divided each norm twice, so the later passes calibrated on a
        # model that was not the one being quantized). Weights with an in-op scale stay as
        # they are: nothing divides their input in this float model.
        weights = {p: f for p, f in factors.items() if p in wanted and p not in in_op}
        folded = apply_factors(params, weights)
        gptq = [p for p, (_, rule) in wanted.items() if isinstance(rule.algorithm, GPTQ)]
        rtn_leaves = {
            path: _first_rounding(path, scaled(path), wanted[path], statistics, report)
            for path in gptq
        }
        _sequential_gptq(
            gptq,
            wanted,
            folded,
            rtn_leaves,
            statistics,
            sequential,
            fn,
            calibration,
            row_mask,
            strict,
            report,
            replaced,
            on_batch,
        )
        del folded, rtn_leaves
    factors_seen: dict = {}  # inverse-Hessian factors of recent Gram matrices (q/k/v share one)
    for n, (path, (decision, rule)) in enumerate(wanted.items()):
        algorithm = rule.algorithm
        if path in replaced:
            out[path] = replaced.pop(path)  # done by a sequential pass
        elif isinstance(algorithm, HQQ):
            q, history = hqq_qarray(scaled(path), decision.config, algorithm)
            out[path] = q
            report.applied[path] = (
                f"hqq ({algorithm.iters} iterations, lp error {float(history[0]):.4g} -> "
                f"{float(history[-1]):.4g})"
            )
        else:
            w = scaled(path)
            q = _first_rounding(path, w, (decision, rule), statistics, report)
            if isinstance(algorithm, GPTQ):
                q = _gptq_one(path, w, q, algorithm, statistics, strict, report, factors_seen)
            # AWQ / SmoothQuant: folded above, rounded to nearest (or onto the clipped grid).
            out[path] = q
            del w, q
        if path in in_op:
            out[path] = dataclasses.replace(out[path], input_scale=in_op[path])
        release_free_memory()
        if on_weight is not None:
            on_weight(n + 1, len(wanted))
    return map_params(lambda path, leaf: out.get(path, leaf), params), report


def _folds(algorithm: Any) -> bool:
    """Whether a rule's algorithm folds per-input-channel scales."""
    return isinstance(algorithm, AWQ | SmoothQuant) or (
        isinstance(algorithm, GPTQ) and algorithm.scale
    )


class _Rescaled:
    """`Statistics` as the rescaled weights see their inputs: divided by the folded scale (the
    Gram matrix by ``s sᵀ``, mean and max |x| by `s`). Computed per weight when asked, so the
    captured Gram matrices (cached per calibration set) are not held twice."""

    def __init__(self, statistics: Statistics, folds: list):
        self.base = statistics
        self.unmapped = statistics.unmapped
        self.scale = {p: jnp.asarray(f.scale, jnp.float32) for f in folds for p in f.weights}

    def read_order(self) -> list[str]:
        return self.base.read_order()

    def for_path(self, path: str) -> list:
        s = self.scale.get(path)
        stats = self.base.for_path(path)
        if s is None:
            return stats
        return [
            dataclasses.replace(
                st,
                gram=st.gram / (s[:, None] * s[None, :]),
                abs_sum=st.abs_sum / s,
                abs_max=st.abs_max / s,
                sample=None if st.sample is None else np.asarray(st.sample / np.asarray(s)),
            )
            for st in stats
        ]


def _first_rounding(path, w, wanted_entry, statistics, report) -> QArray:
    """Round-to-nearest of weight `w` (float, folded scales applied) by its rule, on the range
    AWQ's clipping search picks when the rule asks for it (`AWQ.clip`, `GPTQ.clip`; searched
    on the Gram matrix of the weight's inputs): what AWQ / SmoothQuant store and the grid GPTQ
    rounds onto."""
    decision, rule = wanted_entry
    if isinstance(rule.algorithm, AWQ | GPTQ) and rule.algorithm.clip:
        stats = statistics.for_path(path)
        note = report.applied.setdefault(path, "")
        sep = "; " if note else ""
        if not single_matrix_use(stats):
            report.applied[path] = f"{note}{sep}no clip search (needs one 2-D use with statistics)"
        else:
            h = stats[0].gram / max(stats[0].count, 1)
            found = clip_search(w, stats[0].input_axes[0], decision.config, h)
            if isinstance(found, str):
                report.applied[path] = f"{note}{sep}no clip search ({found})"
            else:
                clipped, ratio = found
                report.applied[path] = f"{note}{sep}clipped (mean range ratio {ratio:.3f})"
                return quantize_weight(clipped.astype(w.dtype), decision.config, rule)
    return quantize_weight(w, decision.config, rule)


def _sequential_gptq(
    paths,
    wanted,
    params,
    rtn_leaves,
    statistics,
    passes,
    fn,
    calibration,
    row_mask,
    strict,
    report,
    replaced,
    on_batch,
) -> None:
    """GPTQ in `passes` groups (in the order the model reads the weights), recalibrating each
    group on the model with the earlier groups quantized (their dequantized values)."""
    seen = statistics.read_order()
    order = [p for p in seen if p in paths] + [p for p in paths if p not in seen]
    groups = [list(g) for g in np.array_split(np.array(order, dtype=object), passes) if len(g)]
    batches = list(calibration)
    current = params
    for i, group in enumerate(groups):
        stats = statistics
        if i > 0:
            stats = capture(fn, current, batches, paths=group, row_mask=row_mask, on_batch=on_batch)
        floats = dict(param_leaves(current))
        for path in group:
            algorithm = wanted[path][1].algorithm
            replaced[path] = _gptq_one(
                path, floats[path], rtn_leaves[path], algorithm, stats, strict, report
            )
            report.applied[path] += f", sequential pass {i + 1}/{len(groups)}"
        done = set(group)
        current = map_params(
            lambda p, leaf, done=done: replaced[p].dequantize() if p in done else leaf, current
        )


def _gptq_one(path, w, q, algorithm, statistics, strict, report, factors=None) -> QArray:
    stats = statistics.for_path(path)
    if not stats:
        reason = statistics.unmapped.get(path, "it was not seen feeding any matmul of fn")
        message = f"{path}: no calibration statistics ({reason})"
        if strict:
            raise ValueError(message + "; strict mode does not fall back to RTN")
        report.applied[path] = f"rtn: {message}"
        return q
    needed = max(int(s.gram.shape[0]) for s in stats)
    have = min(s.count for s in stats)
    if have < needed:
        raise CalibrationError(
            f"{path}: GPTQ needs at least {needed} calibration token rows (its input size) per "
            f"layer, got {have}; give more or longer calibration sequences"
        )
    new, notes = gptq_qarray(w, q, stats, algorithm, factors)
    if notes and strict:
        raise ValueError("; ".join(notes) + " (strict mode)")
    report.notes += notes
    before = report.applied.get(path)  # the folded scale and clip search, if any
    report.applied[path] = (
        f"gptq ({len(stats)} stats set{'s' if len(stats) > 1 else ''}, {have} tokens"
        f"{', act_order' if algorithm.act_order else ''}"
        f"{f', {algorithm.refine} refinement sweep(s)' if algorithm.refine else ''})"
        if not notes
        else "gptq with RTN fallback on some layers (see notes)"
    ) + (f" on {before}" if before else "")
    return new


def quantize_params(params: Any, recipe: Recipe | str, **options: Any) -> Any:
    """`lowbit.quantize_params` with algorithms: `quantize_with_report` without the report.

    Without an algorithm in the recipe this is `lowbit.api.quantize_params`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lowbit.recipes import Recipe, Rule, GPTQ
      >>> from lowbit.qarray import QuantConfig, PerGroup
      >>> rule = Rule(weight=QuantConfig(format="int4", granularity=PerGroup(8, axis=0)),
      ...             algorithm=GPTQ())
      >>> w = jax.random.normal(jax.random.key(0), (16, 4))
      >>> xs = [jax.random.normal(jax.random.key(1), (32, 16))]
      >>> q = quantize_params({"w": w}, Recipe(rules=(rule,)), fn=lambda p, x: x @ p["w"],
      ...                     calibration=xs)
      >>> type(q["w"]).__name__
      'QArray'
    """
    return quantize_with_report(params, recipe, **options)[0]


def quantize_model(
    model: nnx.Module | linen.Module,
    recipe: Recipe | str,
    *,
    calibration: Iterable[Any] | None = None,
    params: Any = None,
    strict: bool = False,
    uses: Mapping[str, frozenset[str]] | None = None,
    **options: Any,
) -> QuantizedModel | QuantizedLinen:
    """`lowbit.quantize_model` with algorithms: calibration batches are the model's inputs
    (``model(*batch)``, Linen: ``model.apply(params, *batch)``).

    Without an algorithm in the recipe this is `lowbit.api.quantize_model`.
    """
    recipe = as_recipe(recipe)
    if not any(r.algorithm is not None for r in recipe.rules):
        return api_quantize_model(model, recipe, params=params, strict=strict, uses=uses)
    if isinstance(model, nnx.Module):
        if params is not None:
            raise TypeError("quantize_model: params= is for Linen modules")
        graphdef, state = nnx.split(model)
        fn = lambda s, *batch: nnx.merge(graphdef, s)(*batch)
        qstate = quantize_params(
            state, recipe, fn=fn, calibration=calibration, uses=uses, strict=strict, **options
        )
        return QuantizedModel(nnx.merge(graphdef, qstate), strict=strict)
    if isinstance(model, linen.Module):
        if params is None:
            raise TypeError("quantize_model: a Linen module needs params=variables")
        fn = lambda p, *batch: model.apply(p, *batch)
        qparams = quantize_params(
            params, recipe, fn=fn, calibration=calibration, uses=uses, strict=strict, **options
        )
        return QuantizedLinen(model, qparams, strict)
    raise TypeError(
        f"quantize_model expects a flax nnx.Module or linen.Module, got {type(model).__name__}"
    )
