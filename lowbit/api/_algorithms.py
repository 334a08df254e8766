"""Rules with an algorithm inside `lowbit.quantize_params`: calibrate, fold scales, round.

`quantize_params` rounds the weights whose rule has no algorithm to nearest and hands the
others here (`round_with_algorithms`). Data-driven algorithms read statistics captured from the
float model on the calibration batches through the engine (`lowbit.algorithms.capture`); AWQ
and SmoothQuant scales are folded into the preceding norm or linear layer where the probe shows
that is exact; each weight is then rounded by its algorithm's implementation
(`lowbit.algorithms.rounding_for`), one at a time, so the model never holds a second float copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from lowbit._host_memory import release_free_memory
from lowbit.algorithms import (
    AlgorithmReport,
    Context,
    Nearest,
    Rescaled,
    Statistics,
    apply_factors,
    capture,
    check_same_everywhere,
    first_rounding,
    fold_factors,
    folds,
    gptq_one,
    held_whole,
    input_scales,
    local_copy,
    plan_folds,
    plan_spread,
    rounding_for,
    sample_rows,
    scale_leaf,
    stats_span_processes,
)
from lowbit.qarray import QArray
from lowbit.recipes import GPTQ, Recipe, map_params, param_leaves


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmOptions:
    """How `lowbit.quantize_params` calibrates and runs rules that carry an algorithm.

    Attributes:
      row_mask: ``row_mask(*batch)``: the positions of a batch that count (e.g.
        ``lambda tokens, mask: mask`` for padded encoder batches), as for
        `lowbit.algorithms.capture`.
      statistics: already captured `Statistics` (shared between recipes) instead of batches.
      sequential: GPTQ in this many passes (as in the GPTQ paper, for deep models): the GPTQ
        weights are split in groups in the order the model reads them, and group i is
        calibrated on the model whose earlier groups are already quantized. Each pass runs the
        calibration batches again (so they must be re-iterable, e.g. a list).
      on_batch: progress, called with the number of calibration batches done.
      on_weight: progress, called with (weights done, total) of the algorithms' weights.
      spread: in a program of several processes (``jax.distributed``) calibrating on
        statistics summed across them, give each GPTQ weight's solve to one process and
        exchange the results (the same quantized tree on every process, bit for bit); False:
        every process solves every weight.
    """

    row_mask: Callable[..., Any] | None = None
    statistics: Statistics | None = None
    sequential: int = 1
    on_batch: Callable[[int], None] | None = None
    on_weight: Callable[[int, int], None] | None = None
    spread: bool = True

    def __post_init__(self):
        if not isinstance(self.sequential, int) or self.sequential < 1:
            raise ValueError(
                f"AlgorithmOptions.sequential={self.sequential!r}: accepted an int >= 1"
            )


def round_with_algorithms(
    params: Any,
    recipe: Recipe,
    wanted: Mapping[str, tuple[Any, Any]],
    nearest: Callable[[Any, Any, Any], QArray],
    *,
    fn: Callable[..., Any] | None,
    calibration: Iterable[Any] | None,
    options: AlgorithmOptions,
    report: AlgorithmReport,
    strict: bool,
    floats: frozenset[str] = frozenset(),
) -> tuple[Any, dict[str, QArray]]:
    """Rounds the weights in `wanted` by their rules' algorithms.

    Args:
      params: float params pytree.
      recipe: the recipe (for messages and `sample_rows`).
      wanted: {path: (decision, rule)} of the weights whose rule has an algorithm.
      nearest: ``nearest(weight, config, rule) -> QArray``, rounding to nearest by a rule.
      fn: ``fn(params, *batch)``, needed with `calibration`.
      calibration: iterable of batches (a tuple is unpacked into arguments).
      options: `AlgorithmOptions`.
      report: filled with what each weight got.
      strict: raise instead of falling back to RTN for a weight.
      floats: parameters the recipe leaves in float; one reading an input whose scale is
        folded (a MoE router) is multiplied by the scale so the float model is unchanged.
    Returns:
      (params with the folded norm scales, {path: QArray} of the weights in `wanted`).
    Raises:
      ValueError: a rule needs data and none was given (naming the rule and the fix), too few
        calibration tokens, NaN/Inf in the inputs (`CalibrationError`), and in strict mode a
        weight that would fall back to RTN.
    """
    statistics = options.statistics
    data_paths = [p for p, (_, rule) in wanted.items() if rule.algorithm.needs_data]
    if data_paths and statistics is None:
        if calibration is None or fn is None:
            first = wanted[data_paths[0]][1]
            index = recipe.rules.index(first)
            raise ValueError(
                f"lowbit.quantize_params: recipe {recipe.name!r}, rule {index} "
                f"(path={first.path!r}) uses algorithm {first.algorithm.name!r} for "
                f"{data_paths[0]!r}, which needs calibration data; pass fn=... and "
                "calibration=<iterable of batches> "
                "(lowbit.quantize_model(model, recipe, calibration=batches) for a Flax model), "
                "or use a data-free algorithm (hqq)"
            )
        statistics = capture(
            fn,
            params,
            calibration,
            paths=data_paths,
            sample_rows=sample_rows(recipe),
            row_mask=options.row_mask,
            on_batch=options.on_batch,
        )
    report.statistics = statistics
    if stats_span_processes(statistics, data_paths):
        check_same_recipe(recipe)  # before the processes go different ways
    sequential = options.sequential
    if sequential > 1 and (fn is None or calibration is None):
        raise ValueError(
            f"AlgorithmOptions.sequential={sequential!r}: sequential > 1 recalibrates between "
            "passes, so it needs fn and calibration (not precomputed statistics)"
        )
    folding = {p: v for p, v in wanted.items() if folds(v[1].algorithm)}
    factors: dict[str, list] = {}
    in_op: dict[str, Any] = {}  # weights whose scale the op applies: {path: input_scale}
    if folding:
        fold_list, skipped = plan_folds(dict(param_leaves(params)), folding, statistics, floats)
        if skipped and strict:
            lines = "; ".join(f"{p}: {why}" for p, why in skipped.items())
            raise ValueError(f"strict mode: no scale to fold for {lines}")
        axes = {p: statistics.for_path(p)[0].input_axes[0] for f in fold_list for p in f.weights}
        factors = fold_factors(fold_list, axes)
        ndims = {p: np.ndim(leaf) for p, leaf in param_leaves(params) if p in axes}
        in_op = input_scales(fold_list, axes, ndims)
        # Parameters no algorithm rounds (norm scales) absorb their factors now; the rounded
        # weights are scaled one at a time as each is rounded, so the model never has a second
        # float copy of its weights.
        params = apply_factors(params, {p: f for p, f in factors.items() if p not in wanted})
        for fold in fold_list:
            for p in fold.weights:
                report.applied[p] = fold.note
        for p, why in skipped.items():
            report.applied[p] = why
        statistics = Rescaled(statistics, fold_list)
    floats = dict(param_leaves(params))

    def scaled(path: str) -> Any:
        """The float weight at `path` with its folded scales."""
        return scale_leaf(floats[path], factors[path]) if path in factors else floats[path]

    def nearest_of(path: str) -> Nearest:
        decision, rule = wanted[path]
        return lambda w: nearest(w, decision.config, rule)

    ctx = Context(statistics, report, strict)
    out: dict[str, QArray] = {}
    if sequential > 1:
        # `params` already holds the norms' factors: scale only the weights here (applying
        # every factor again divided each norm twice, so the later passes calibrated on a
        # model that was not the one being quantized). Weights with an in-op scale stay as
        # they are: nothing divides their input in this float model.
        weights = {p: f for p, f in factors.items() if p in wanted and p not in in_op}
        folded = apply_factors(params, weights)
        gptq = [p for p, (_, rule) in wanted.items() if isinstance(rule.algorithm, GPTQ)]
        rtn_leaves = {
            path: first_rounding(
                path,
                scaled(path),
                wanted[path][0].config,
                wanted[path][1].algorithm,
                nearest_of(path),
                ctx,
            )
            for path in gptq
        }
        _sequential_gptq(gptq, wanted, folded, rtn_leaves, ctx, fn, calibration, options, out)
        del folded, rtn_leaves

    def solve_here(path: str, local_ctx: Context) -> QArray:
        """`path` rounded by its algorithm on this process's copies (a spread solve)."""
        decision, rule = wanted[path]
        w = local_copy(floats[path])
        if path in factors:
            w = scale_leaf(w, [(local_copy(f), axis) for f, axis in factors[path]])
        rounding = rounding_for(rule.algorithm)
        return rounding.round(path, w, decision.config, nearest_of(path), local_ctx)

    spread = None
    if options.spread:
        gptq = [
            p
            for p, (_, rule) in wanted.items()
            if isinstance(rule.algorithm, GPTQ)
            and p not in out
            and all(held_whole(f) for f, _ in factors.get(p, []))
        ]
        spread = plan_spread(
            gptq,
            ctx,
            floats.__getitem__,
            solve_here,
            lambda path: nearest_of(path)(local_copy(floats[path])),
        )
    for n, (path, (decision, rule)) in enumerate(wanted.items()):
        if spread is not None and path in spread:
            out[path] = spread.result(path)
        elif path not in out:  # else done by a sequential pass
            rounding = rounding_for(rule.algorithm)
            out[path] = rounding.round(path, scaled(path), decision.config, nearest_of(path), ctx)
        if path in in_op:
            out[path] = dataclasses.replace(out[path], input_scale=in_op[path])
        release_free_memory()
        if options.on_weight is not None:
            options.on_weight(n + 1, len(wanted))
    return params, out


def check_same_recipe(recipe: Recipe) -> None:
    """Raises unless every process quantizes with the same recipe (a collective)."""
    try:
        text = recipe.to_json()
    except Exception:  # noqa: BLE001 - a recipe JSON cannot carry: compare its repr
        text = repr(recipe)
    check_same_everywhere(
        "recipe",
        recipe.name,
        text,
        "every process must quantize with the same recipe (same rules, formats and algorithm "
        "settings): build it the same way on each",
    )


def _sequential_gptq(paths, wanted, params, rtn_leaves, ctx, fn, calibration, options, out) -> None:
    """GPTQ in `options.sequential` groups (in the order the model reads the weights),
    recalibrating each group on the model with the earlier groups quantized (their
    dequantized values)."""
    seen = ctx.statistics.read_order()
    order = [p for p in seen if p in paths] + [p for p in paths if p not in seen]
    groups = [
        list(g) for g in np.array_split(np.array(order, dtype=object), options.sequential) if len(g)
    ]
    batches = list(calibration)
    current = params
    for i, group in enumerate(groups):
        pass_ctx = ctx
        if i > 0:
            stats = capture(
                fn,
                current,
                batches,
                paths=group,
                row_mask=options.row_mask,
                on_batch=options.on_batch,
            )
            pass_ctx = Context(stats, ctx.report, ctx.strict)
        floats = dict(param_leaves(current))
        for path in group:
            algorithm = wanted[path][1].algorithm
            out[path] = gptq_one(path, floats[path], rtn_leaves[path], algorithm, pass_ctx)
            ctx.report.applied[path] += f", sequential pass {i + 1}/{len(groups)}"
        done = set(group)
        current = map_params(
            lambda p, leaf, done=done: out[p].dequantize() if p in done else leaf, current
        )
