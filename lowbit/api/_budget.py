"""`choose_plan`: a format per weight under a size budget, as a `Recipe`.

Every weight a candidate fits is measured with every candidate (`lowbit.algorithms.measure`:
stored bytes, and output error on the calibration Gram matrices), then one candidate per weight
is chosen by the multiple-choice knapsack (`lowbit.algorithms.solve_knapsack`) to minimise the
summed error within the budget. The budget is mean bits per weight (``bits``: stored bytes of the
planned weights, scales included, times 8 over their element count) or bytes (``max_bytes``).

Measured with a `FileBytes` (`lowbit.io.gguf_plan_bytes` for a GGUF export), a candidate costs
the bytes the file holds for it (in the type the file stores its format as, padding included),
and ``max_bytes`` is the whole file's size: the bytes it holds besides the planned weights
(header, metadata, norms, alignment) are taken off the budget first.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from lowbit.algorithms import (
    Measured,
    Statistics,
    knapsack_bounds,
    measure,
    solve_knapsack,
    solve_knapsack_timed,
    stored_nbytes,
)
from lowbit.api._candidate_time import time_candidates
from lowbit.api._measurements import Measurements
from lowbit.recipes import (
    Candidate,
    Recipe,
    default_candidates,
    param_leaves,
    plan_recipe,
    storable,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileBytes:
    """How a file counts a plan's bytes.

    Attributes:
      fixed: bytes the file holds besides the planned weights (header, metadata, tensor
        table, alignment padding, tensors left in float).
      nbytes: ``nbytes(path, q) -> int``: bytes the weight at `path` takes in the file when
        quantized as `q` (a QArray of shape structs: shapes and formats, no data), padding
        included.
      what: the file, as plans and errors name it (e.g. ``"GGUF file"``).
    """

    fixed: int
    nbytes: Callable[[str, Any], int]
    what: str


@dataclasses.dataclass(frozen=True)
class TensorChoice:
    """The plan for one weight.

    Attributes:
      path: parameter path.
      shape: its shape.
      chosen: the measured candidate taken.
      measured: every candidate measured on it (bytes, error).
    """

    path: str
    shape: tuple[int, ...]
    chosen: Measured
    measured: tuple[Measured, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def bits(self) -> float:
        return 8 * self.chosen.nbytes / self.size


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """A plan chosen under a budget.

    Attributes:
      recipe: the plan as a `Recipe` (one rule per weight; JSON with `Recipe.to_json`).
      tensors: one `TensorChoice` per planned weight, in parameter order.
      budget: the byte budget.
      target: ``"lowbit"`` or ``"gguf"``.
      unplanned: {path: why} for 2-D+ weights no candidate fits (left in float).
      max_seconds: the time limit per token it was chosen under, or None.
      fixed: bytes the file holds besides the planned weights (`FileBytes`), 0 when the
        plan was measured without a file.
      file: the file it was measured for (`FileBytes.what`), or None.
      step: the fewest bytes any change to a candidate of lower error adds (more than the
        bytes left, or it would have been made); None when every weight has its least-error
        candidate (the budget does not bind).
    """

    recipe: Recipe
    tensors: tuple[TensorChoice, ...]
    budget: int
    target: str
    unplanned: Mapping[str, str] = dataclasses.field(default_factory=dict)
    max_seconds: float | None = None
    fixed: int = 0
    file: str | None = None
    step: int | None = None

    @property
    def seconds(self) -> float | None:
        """Summed kernel seconds per token of the chosen candidates, when they were timed."""
        times = [t.chosen.seconds for t in self.tensors]
        return None if any(x is None for x in times) else float(sum(times))

    @property
    def nbytes(self) -> int:
        """Bytes of the planned weights."""
        return sum(t.chosen.nbytes for t in self.tensors)

    @property
    def file_nbytes(self) -> int:
        """Bytes of the whole file (the planned weights and `fixed`)."""
        return self.nbytes + self.fixed

    @property
    def bits(self) -> float:
        """Mean stored bits per weight over the planned weights."""
        return 8 * self.nbytes / max(sum(t.size for t in self.tensors), 1)

    @property
    def error(self) -> float:
        return sum(t.chosen.error for t in self.tensors)

    def bits_per_layer(self) -> dict[str, float]:
        """Mean stored bits per weight of each layer (``layers/{i}``) and of every weight
        outside the layers, in parameter order."""
        groups: dict[str, list[int]] = {}
        for t in self.tensors:
            m = re.match(r"(.*?layers/\d+)/", t.path)
            key = m.group(1) if m else t.path
            acc = groups.setdefault(key, [0, 0])
            acc[0] += t.chosen.nbytes
            acc[1] += t.size
        return {k: 8 * b / n for k, (b, n) in groups.items()}

    def __str__(self) -> str:
        timed = self.seconds is not None
        head = (
            f"plan for {self.target}: {len(self.tensors)} weights, {self.nbytes} bytes "
            f"({self.bits:.3f} bits per weight) within {self.budget} bytes"
        )
        if self.file is not None:
            head += (
                f"; the {self.file}: {self.file_nbytes} bytes ({self.fixed} besides the planned "
                f"weights) within {self.budget + self.fixed}"
            )
        left = self.budget - self.nbytes
        if self.step is None:
            head += f"; {left} bytes left: every weight has its least-error candidate"
        else:
            head += (
                f"; {left} bytes left: the smallest change to a candidate of lower error adds "
                f"{self.step} bytes"
            )
        if timed:
            limit = "" if self.max_seconds is None else f" within {self.max_seconds * 1e3:.4g}"
            head += f"; {self.seconds * 1e3:.4g} ms of kernels per token{limit}"
        lines = [
            head,
            f"  {'parameter':<40} {'shape':<14} {'candidate':<16} {'bits':>6} {'error':>10}"
            + (f" {'ms':>8}" if timed else ""),
        ]
        for t in self.tensors:
            ms = f" {t.chosen.seconds * 1e3:>8.4f}" if timed else ""
            lines.append(
                f"  {t.path:<40} {str(t.shape):<14} {t.chosen.candidate.name:<16} "
                f"{t.bits:>6.3f} {t.chosen.error:>10.4g}{ms}"
            )
        for path, why in self.unplanned.items():
            lines.append(f"  {path:<40} float: {why}")
        lines.append("bits per layer:")
        for key, bits in self.bits_per_layer().items():
            lines.append(f"  {key:<40} {bits:6.3f} {'#' * round(bits * 4)}")
        return "\n".join(lines)


def planned_weights(params: Any, candidates: tuple[Candidate, ...]) -> dict[str, tuple[int, ...]]:
    """{path: shape} of the float weights with 2+ axes that some candidate's layout names."""
    out = {}
    for path, leaf in param_leaves(params):
        shape = tuple(np.shape(leaf))
        floating = jnp.issubdtype(getattr(leaf, "dtype", np.float32), jnp.floating)
        if len(shape) >= 2 and floating and candidates[0].config(path, len(shape)) is not None:
            out[path] = shape
    return out


def budget_bytes(
    *,
    bits: float | None,
    max_bytes: int | None,
    elements: int,
    low: int,
    high: int,
    fixed: int = 0,
    file: str | None = None,
) -> int:
    """The byte budget of the planned weights: `bits` (mean bits per weight over `elements`)
    or `max_bytes` (less the `fixed` bytes a file holds besides them).

    Raises:
      ValueError: for neither or both, or a budget outside [low, high] (naming both bounds,
        and with a `file`, the file's smallest and largest size).
    """
    if (bits is None) == (max_bytes is None):
        raise ValueError("give exactly one budget: bits (--bits) or max_bytes (--max-bytes)")
    budget = int(bits * elements / 8) if bits is not None else int(max_bytes) - fixed
    low_bits, high_bits = 8 * low / elements, 8 * high / elements
    what = f"--bits {bits}" if bits is not None else f"--max-bytes {max_bytes}"
    span = (
        f"the candidates give {low} to {high} bytes ({low_bits:.3f} to {high_bits:.3f} bits per "
        "weight)"
    )
    if file is not None:
        span = (
            f"the {file} takes {low + fixed} to {high + fixed} bytes ({fixed} besides the "
            f"planned weights); {span}"
        )
    if budget < low:
        raise ValueError(
            f"{what} is below the smallest plan: {span}; raise the budget or add smaller "
            "candidates (--candidates)"
        )
    if budget > high:
        raise ValueError(
            f"{what} is above the largest plan: {span}; every weight would take its largest "
            "candidate, so lower the budget or add larger candidates (--candidates)"
        )
    return budget


def check_budget(
    params: Any,
    *,
    bits: float | None = None,
    max_bytes: int | None = None,
    candidates: tuple[Candidate, ...] | None = None,
    target: str = "lowbit",
    file: FileBytes | None = None,
) -> None:
    """Refuses a budget that no plan can meet, from the weights' shapes alone: before the
    calibration and measuring that `plan_within` would refuse it after (`choose_plan`'s
    arguments).

    Raises:
      ValueError: as `budget_bytes` (naming the smallest and largest plan, or file).
    """
    candidates = storable(candidates or default_candidates(target), target)
    leaves = dict(param_leaves(params))
    costs, elements = [], 0
    nbytes = None if file is None else file.nbytes
    for path, shape in planned_weights(params, candidates).items():
        fit = [c for c in candidates if c.fits(path, shape)]
        if fit:
            costs.append(
                [stored_nbytes(path, leaves[path], c, target=target, nbytes=nbytes) for c in fit]
            )
            elements += math.prod(shape)
    if not costs:
        return  # `measure_candidates` says which weights and why
    low, high = knapsack_bounds(costs)
    budget_bytes(
        bits=bits,
        max_bytes=max_bytes,
        elements=elements,
        low=low,
        high=high,
        fixed=0 if file is None else file.fixed,
        file=None if file is None else file.what,
    )


def measure_candidates(
    params: Any,
    statistics: Statistics,
    *,
    candidates: tuple[Candidate, ...] | None = None,
    target: str = "lowbit",
    on_weight: Callable[[int, int], None] | None = None,
    sensitivity: Mapping[str, Any] | None = None,
    file: FileBytes | None = None,
) -> Measurements:
    """Measures every candidate on every weight a candidate's layout names (see
    `choose_plan`, which takes the same arguments).

    With a `file`, each candidate costs the bytes that file holds for it, and its fixed bytes
    are kept for a ``max_bytes`` budget (see module docstring).

    Raises:
      ValueError: for a candidate the target cannot store, no weight a candidate fits, or a
        `sensitivity` that lacks a planned weight.
    """
    candidates = storable(candidates or default_candidates(target), target)
    shapes = planned_weights(params, candidates)
    if sensitivity is not None:
        missing = [p for p in shapes if p not in sensitivity]
        if missing:
            raise ValueError(
                f"sensitivity has no score for the planned weight {missing[0]!r} "
                f"({len(missing)} of {len(shapes)} missing): compute it with "
                "lowbit.algorithms.output_sensitivity(..., paths=...) over every planned weight"
            )
    leaves = dict(param_leaves(params))
    rows = max((s.count for s in statistics.weights.values()), default=1)
    factors: dict = {}
    measured: dict[str, list[Measured]] = {}
    unplanned: dict[str, str] = {}
    for done, (path, shape) in enumerate(shapes.items()):
        found = measure(
            path,
            leaves[path],
            statistics.for_path(path),
            candidates,
            target=target,
            rows=rows,
            factors=factors,
            sensitivity=None if sensitivity is None else sensitivity[path],
            nbytes=None if file is None else file.nbytes,
        )
        if found:
            measured[path] = found
        else:
            unplanned[path] = f"no candidate fits shape {shape}"
        if on_weight is not None:
            on_weight(done + 1, len(shapes))
    if not measured:
        raise ValueError(
            f"no weight takes any of the candidates {', '.join(c.name for c in candidates)}: "
            f"groups must divide the contraction axis ({len(shapes)} weights, e.g. "
            f"{next(iter(shapes.items()), None)})"
        )
    return Measurements(
        shapes,
        measured,
        target,
        unplanned,
        fixed=0 if file is None else file.fixed,
        file=None if file is None else file.what,
    )


def plan_within(
    measurements: Measurements,
    *,
    bits: float | None = None,
    max_bytes: int | None = None,
    name: str = "plan",
    max_ms_per_token: float | None = None,
) -> BudgetPlan:
    """The plan of least summed error within a budget, from `measure_candidates`.

    `max_ms_per_token` also limits the summed kernel time of the chosen candidates (timed by
    `time_candidates`, one activation row: a decode step): error is traded for time only as
    far as the limit needs (`lowbit.algorithms.solve_knapsack_timed`).

    Raises:
      ValueError: for neither or both budgets, one outside what the candidates can give
        (naming both bounds), a time limit on untimed measurements, or one no plan within the
        byte budget meets (naming the fastest).
    """
    measured = measurements.measured
    costs = [[m.nbytes for m in ms] for ms in measured.values()]
    errors = [[m.error for m in ms] for ms in measured.values()]
    low, high = knapsack_bounds(costs)
    budget = budget_bytes(
        bits=bits,
        max_bytes=max_bytes,
        elements=measurements.elements,
        low=low,
        high=high,
        fixed=measurements.fixed,
        file=measurements.file,
    )
    max_seconds = None
    if max_ms_per_token is None:
        picks = solve_knapsack(costs, errors, budget)
    else:
        if max_ms_per_token <= 0:
            raise ValueError(f"max_ms_per_token={max_ms_per_token} must be > 0")
        if any(m.seconds is None for ms in measured.values() for m in ms):
            raise ValueError(
                "a time limit needs timed candidates: "
                "lowbit.api.time_candidates(measurements) first"
            )
        max_seconds = max_ms_per_token / 1e3
        times = [[m.seconds for m in ms] for ms in measured.values()]
        picks = solve_knapsack_timed(costs, errors, times, budget, max_seconds)
    shapes = measurements.shapes
    tensors = tuple(
        TensorChoice(path, shapes[path], ms[j], tuple(ms))
        for (path, ms), j in zip(measured.items(), picks, strict=True)
    )
    steps = [
        m.nbytes - t.chosen.nbytes
        for t in tensors
        for m in t.measured
        if m.error < t.chosen.error and m.nbytes > t.chosen.nbytes
    ]
    recipe = plan_recipe({t.path: (t.chosen.candidate, t.shape) for t in tensors}, name=name)
    return BudgetPlan(
        recipe,
        tensors,
        budget,
        measurements.target,
        measurements.unplanned,
        max_seconds,
        fixed=measurements.fixed,
        file=measurements.file,
        step=min(steps, default=None),
    )


def choose_plan(
    params: Any,
    statistics: Statistics,
    *,
    bits: float | None = None,
    max_bytes: int | None = None,
    candidates: tuple[Candidate, ...] | None = None,
    target: str = "lowbit",
    name: str = "plan",
    on_weight: Callable[[int, int], None] | None = None,
    sensitivity: Mapping[str, Any] | None = None,
    max_ms_per_token: float | None = None,
    file: FileBytes | None = None,
) -> BudgetPlan:
    """Chooses a format per weight within a size budget (see module docstring).

    `measure_candidates` then `plan_within`; call those to choose several plans from one
    measurement.

    Args:
      params: float params pytree (pure dicts or NNX state).
      statistics: calibration statistics of its weights (`lowbit.algorithms.capture`, or
        `lowbit.eval.calibrator`); a weight with none is costed as a lookup table.
      bits: mean stored bits per weight over the planned weights; or
      max_bytes: their stored bytes.
      candidates: `Candidate`s to choose from (default: `default_candidates(target)`).
      target: ``"lowbit"`` (checkpoint bytes) or ``"gguf"`` (GGML block bytes; GGML types only).
      name: the plan recipe's name.
      on_weight: progress ``(done, total)`` over the measured weights.
      sensitivity: {path: score} from `lowbit.algorithms.output_sensitivity`: errors are then
        the model's output change (``Σ s ΔW²``) rather than each layer's own output error;
        better plans where layers differ in how much their errors reach the output
        (SmolLM2 at 4.5 bits: perplexity 26.7 against 316.9; MiniLM at 3.5 bits: cosine
        0.911 against 0.872; docs/budget.md). The Gram statistics are still used by GPTQ
        candidates. The CLI computes it by default.
      max_ms_per_token: also limit the chosen candidates' summed kernel time for one token,
        timed on this machine (`time_candidates`; see `plan_within`).
      file: how the file that will hold the plan counts bytes (`lowbit.io.gguf_plan_bytes`):
        each candidate then costs what that file holds for it, and `max_bytes` is the whole
        file's size.
    Returns:
      A `BudgetPlan` (its `recipe` quantizes the model: `quantize_params(params, plan.recipe,
      algorithm_options=AlgorithmOptions(statistics=statistics))`).
    Raises:
      ValueError: for a candidate the target cannot store, no weight a candidate fits, or a
        budget outside what the candidates can give (naming both bounds).
    """
    if (bits is None) == (max_bytes is None):  # before the measuring, not after
        raise ValueError("give exactly one budget: bits (--bits) or max_bytes (--max-bytes)")
    measurements = measure_candidates(
        params,
        statistics,
        candidates=candidates,
        target=target,
        on_weight=on_weight,
        sensitivity=sensitivity,
        file=file,
    )
    if max_ms_per_token is not None:
        measurements = time_candidates(measurements)
    return plan_within(
        measurements,
        bits=bits,
        max_bytes=max_bytes,
        name=name,
        max_ms_per_token=max_ms_per_token,
    )
