"""One object per algorithm that rounds a weight: `needs_data` and `round(...)`.

The api layer decides which weights a rule's algorithm gets (`lowbit.quantize_params`), folds
AWQ / SmoothQuant scales, and hands each weight here one at a time; what an algorithm got is
written into the `AlgorithmReport`. `rounding_for(rule.algorithm)` is the one table from the
algorithm configs of `lowbit.recipes` to their implementations:

  * `GPTQ`         — nearest (on AWQ's clipped grid with ``clip``), then GPTQ's column updates;
  * `AWQ`, `SmoothQuant` — nearest (or onto the clipped grid) of the already rescaled weight;
  * `HQQ`          — data-free half-quadratic optimization of the zero points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.algorithms._capture import (
    CalibrationError,
    Statistics,
    expert_use,
    single_matrix_use,
)
from lowbit.algorithms._clip import clip_experts, clip_search
from lowbit.algorithms._gptq import gptq_qarray
from lowbit.algorithms._hqq import hqq_qarray
from lowbit.qarray import QArray, QuantConfig
from lowbit.recipes import AWQ, GPTQ, HQQ, Recipe, Rule, SmoothQuant

# Input rows kept per weight for SmoothQuant's alpha search.
SMOOTHQUANT_SAMPLE_ROWS = 1024

# Rounds a float weight to nearest by its rule (the api's `quantize_weight`, config and
# activation quantizer bound): the grid every algorithm starts from.
Nearest = Callable[[jax.Array], QArray]


def sample_rows(recipe: Recipe) -> int:
    """Input rows to sample per weight while capturing statistics for `recipe`."""
    search = any(isinstance(r.algorithm, SmoothQuant) and r.algorithm.grid for r in recipe.rules)
    return SMOOTHQUANT_SAMPLE_ROWS if search else 0


@dataclasses.dataclass
class AlgorithmReport:
    """Per weight whose rule names an algorithm: what it got.

    Pass one to `lowbit.quantize_params(..., report=AlgorithmReport())` to have it filled.

    Attributes:
      applied: {path: description} e.g. ``"gptq (damp 0.01, 4096 tokens)"`` or
        ``"rtn: Hessian singular after dampening"``.
      notes: other remarks (fallbacks per layer).
      statistics: the captured `Statistics` (None for data-free recipes).
      solved_by: {path: process index} of the weights whose GPTQ solve was spread over the
        processes of a multi-process program (the same on every process; empty with one).
    """

    applied: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    statistics: Statistics | None = None
    solved_by: dict[str, int] = dataclasses.field(default_factory=dict)

    def lines(self) -> list[str]:
        return [f"{path}: {what}" for path, what in self.applied.items()] + self.notes


@dataclasses.dataclass
class Context:
    """What rounding one weight may read and write besides the weight.

    Attributes:
      statistics: the weights' input statistics (None for data-free recipes).
      report: filled with what each weight got.
      strict: raise instead of falling back to round-to-nearest.
      factors: inverse-Hessian factors of recent Gram matrices (q, k and v share one).
    """

    statistics: Statistics | None
    report: AlgorithmReport
    strict: bool = False
    factors: dict = dataclasses.field(default_factory=dict)


class Rounding(Protocol):
    """An algorithm's implementation: whether it needs data, and how it rounds one weight."""

    needs_data: bool

    def round(
        self, path: str, weight: jax.Array, config: QuantConfig, nearest: Nearest, ctx: Context
    ) -> QArray:
        """weight: [*shape] float (folded scales applied) -> its QArray by `config`."""
        ...


@dataclasses.dataclass(frozen=True)
class NearestRounding:
    """AWQ / SmoothQuant: their scales are folded before; the weight is rounded to nearest,
    on the range AWQ's clipping search picks when the algorithm asks for it (``clip``)."""

    algorithm: AWQ | SmoothQuant | GPTQ
    needs_data = True

    def round(self, path, weight, config, nearest, ctx) -> QArray:
        return first_rounding(path, weight, config, self.algorithm, nearest, ctx)


@dataclasses.dataclass(frozen=True)
class GptqRounding:
    """GPTQ on the grid of `NearestRounding` (clipped with ``GPTQ.clip``)."""

    algorithm: GPTQ
    needs_data = True

    def round(self, path, weight, config, nearest, ctx) -> QArray:
        q = first_rounding(path, weight, config, self.algorithm, nearest, ctx)
        return gptq_one(path, weight, q, self.algorithm, ctx, ctx.factors)


@dataclasses.dataclass(frozen=True)
class HqqRounding:
    """HQQ: zero points by half-quadratic optimization, no data."""

    algorithm: HQQ
    needs_data = False

    def round(self, path, weight, config, nearest, ctx) -> QArray:
        q, history = hqq_qarray(weight, config, self.algorithm)
        ctx.report.applied[path] = (
            f"hqq ({self.algorithm.iters} iterations, lp error {float(history[0]):.4g} -> "
            f"{float(history[-1]):.4g})"
        )
        return q


_ROUNDINGS: dict[type, Callable[[Any], Rounding]] = {
    GPTQ: GptqRounding,
    HQQ: HqqRounding,
    AWQ: NearestRounding,
    SmoothQuant: NearestRounding,
}
IMPLEMENTED = tuple(_ROUNDINGS)


def rounding_for(algorithm: Any) -> Rounding:
    """The implementation of an algorithm config (`lowbit.recipes.GPTQ`, ...)."""
    return _ROUNDINGS[type(algorithm)](algorithm)


def check_algorithm(index: int, rule: Rule, config: QuantConfig) -> None:
    """Raises for an algorithm this version lacks or on a format it cannot serve.

    Args:
      index: the rule's index in its recipe (for the message).
      rule: the rule; `rule.algorithm` is not None.
      config: the weight config the rule resolved to for one parameter.
    Raises:
      ValueError: naming the rule, the algorithm and the format, and what to use instead.
    """
    algorithm = rule.algorithm
    if type(algorithm) not in _ROUNDINGS:
        raise ValueError(
            f"rule {index} (path={rule.path!r}) asks for {algorithm.name!r}, which this "
            f"version does not implement; accepted: {[a.name for a in IMPLEMENTED]}"
        )
    if isinstance(algorithm, HQQ) and config.symmetric:
        raise ValueError(
            f"rule {index} (path={rule.path!r}): algorithm 'hqq' optimizes zero points "
            f"but format {config.format!r} is symmetric (no zero point); use an asymmetric "
            "uintN weight config (symmetric=False)"
        )
    if isinstance(algorithm, SmoothQuant) and rule.activation is None:
        raise ValueError(
            f"rule {index} (path={rule.path!r}): algorithm 'smoothquant' moves "
            f"activation outliers into the weights, but the rule quantizes weights only "
            f"({config.format!r}, activation=None); give an activation config (w8a8, w4a8) "
            "or use 'awq' / 'gptq' for weight-only formats"
        )


def folds(algorithm: Any) -> bool:
    """Whether a rule's algorithm folds per-input-channel scales."""
    return isinstance(algorithm, AWQ | SmoothQuant) or (
        isinstance(algorithm, GPTQ) and algorithm.scale
    )


class Rescaled:
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
        out = []
        for st in stats:
            gram, abs_sum, abs_max = _divided(st.gram, st.abs_sum, st.abs_max, s)
            sample = None if st.sample is None else np.asarray(st.sample / np.asarray(s))
            out.append(
                dataclasses.replace(st, gram=gram, abs_sum=abs_sum, abs_max=abs_max, sample=sample)
            )
        return out


@jax.jit
def _divided(gram, abs_sum, abs_max, s):
    """Statistics of inputs divided by `s` [K]: gram [K, K] by ``s sᵀ``, the others by `s`."""
    return gram / (s[:, None] * s[None, :]), abs_sum / s, abs_max / s


def first_rounding(
    path: str, w: jax.Array, config: QuantConfig, algorithm: Any, nearest: Nearest, ctx: Context
) -> QArray:
    """Round-to-nearest of weight `w` (float, folded scales applied) by its rule, on the range
    AWQ's clipping search picks when the rule asks for it (`AWQ.clip`, `GPTQ.clip`; searched
    on the Gram matrix of the weight's inputs): what AWQ / SmoothQuant store and the grid GPTQ
    rounds onto."""
    report = ctx.report
    if isinstance(algorithm, AWQ | GPTQ) and algorithm.clip:
        stats = ctx.statistics.for_path(path)
        note = report.applied.setdefault(path, "")
        sep = "; " if note else ""
        if expert_use(stats):
            grams = [
                s.gram / s.count if s.count else None for s in sorted(stats, key=lambda s: s.fixed)
            ]
            found = clip_experts(w, grams, config)
            if isinstance(found, str):
                report.applied[path] = f"{note}{sep}no clip search ({found})"
            else:
                clipped, ratio = found
                report.applied[path] = (
                    f"{note}{sep}clipped per expert (mean range ratio {ratio:.3f})"
                )
                return nearest(clipped.astype(w.dtype))
        elif not single_matrix_use(stats):
            report.applied[path] = f"{note}{sep}no clip search (needs one 2-D use with statistics)"
        else:
            h = stats[0].gram / max(stats[0].count, 1)
            found = clip_search(w, stats[0].input_axes[0], config, h)
            if isinstance(found, str):
                report.applied[path] = f"{note}{sep}no clip search ({found})"
            else:
                clipped, ratio = found
                report.applied[path] = f"{note}{sep}clipped (mean range ratio {ratio:.3f})"
                return nearest(clipped.astype(w.dtype))
    return nearest(w)


def gptq_one(
    path: str, w: jax.Array, q: QArray, algorithm: GPTQ, ctx: Context, factors=None
) -> QArray:
    """GPTQ of weight `w` from its nearest rounding `q` on `ctx.statistics` (RTN `q` back,
    noted, where it has none; strict mode raises there)."""
    report = ctx.report
    stats = ctx.statistics.for_path(path)
    if not stats:
        reason = ctx.statistics.unmapped.get(path, "it was not seen feeding any matmul of fn")
        message = f"{path}: no calibration statistics ({reason})"
        if ctx.strict:
            raise ValueError(message + "; strict mode does not fall back to RTN")
        report.applied[path] = f"rtn: {message}"
        return q
    plain = [s for s in stats if not s.ragged]
    experts = [s for s in stats if s.ragged]
    # Routed experts see what the router sends them: a rare expert may get fewer rows than
    # its inputs (GPTQ runs on the dampened Hessian) or none (its RTN codes are kept).
    empty = [s for s in experts if s.count == 0]
    if empty and ctx.strict:
        e = empty[0].fixed[0][1]
        raise ValueError(
            f"{path}: expert {e} received no calibration rows; strict mode does not fall back "
            "to RTN (give more calibration data)"
        )
    needed = max(int(s.gram.shape[0]) for s in stats)
    have = min((s.count for s in plain), default=0)
    if plain and have < needed:
        raise CalibrationError(
            f"{path}: GPTQ needs at least {needed} calibration token rows (its input size) per "
            f"layer, got {have}; give more or longer calibration sequences"
        )
    solved = [s for s in stats if not (s.ragged and s.count == 0)]
    new, notes = gptq_qarray(w, q, solved, algorithm, factors) if solved else (q, [])
    if notes and ctx.strict:
        raise ValueError("; ".join(notes) + " (strict mode)")
    report.notes += notes
    for s in empty:
        e = s.fixed[0][1]
        report.notes.append(f"{path}[expert {e}]: rtn: expert {e} received no calibration rows")
    options = (
        f"{', act_order' if algorithm.act_order else ''}"
        f"{f', {algorithm.refine} refinement sweep(s)' if algorithm.refine else ''}"
    )
    if experts:
        rows = [s.count for s in experts]
        what = (
            f"gptq per expert ({len(experts) - len(empty)} of {len(experts)} experts, "
            f"{min(rows)}-{max(rows)} rows each{options})"
        )
        what += "".join(
            f"; rtn: expert {s.fixed[0][1]} received no calibration rows" for s in empty
        )
    else:
        what = (
            f"gptq ({len(stats)} stats set{'s' if len(stats) > 1 else ''}, {have} tokens{options})"
        )
    before = report.applied.get(path)  # the folded scale and clip search, if any
    report.applied[path] = (
        what if not notes else "gptq with RTN fallback on some layers (see notes)"
    ) + (f" on {before}" if before else "")
    return new
