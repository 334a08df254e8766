"""Multiple-choice knapsack: one choice per item, least total error within a byte budget.

Item ``i`` has choices ``j`` with ``cost[i][j]`` bytes and ``error[i][j]``; `solve` picks one
choice per item so that ``sum cost <= budget`` and ``sum error`` is small:

1. **Lagrangian search.** For a multiplier ``λ >= 0`` every item independently takes
   ``argmin_j error + λ cost``; the total cost falls as λ grows. λ is bisected (on a log
   scale) to the smallest value whose choice fits the budget. That choice is optimal for its
   own total cost (a point on the lower convex hull of the error/cost trade-off), and at most
   one item's step along its hull separates it from the continuous relaxation's optimum.
2. **Repair / fill.** The bytes left are spent greedily: among single-item changes to a
   choice of lower error that still fit, the one with the largest error drop per added byte,
   until none fits.

Items with one choice, dominated choices and ties are fine; costs are integers (bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _pick(costs: list[np.ndarray], errors: list[np.ndarray], lam: float) -> np.ndarray:
    # Ties go to the cheaper choice, so the total cost falls monotonically in λ.
    out = np.empty(len(costs), np.int64)
    for i, (c, e) in enumerate(zip(costs, errors, strict=True)):
        score = e + lam * c
        best = np.flatnonzero(score <= score.min())
        out[i] = best[np.argmin(c[best])]
    return out


def _total(costs: list[np.ndarray], choice: np.ndarray) -> int:
    return int(sum(int(c[j]) for c, j in zip(costs, choice, strict=True)))


def bounds(costs: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(smallest, largest) total cost: every item at its cheapest, every item at its
    dearest choice."""
    return int(sum(min(c) for c in costs)), int(sum(max(c) for c in costs))


def solve(
    costs: Sequence[Sequence[int]],
    errors: Sequence[Sequence[float]],
    budget: int,
    *,
    steps: int = 100,
) -> tuple[int, ...]:
    """One choice per item with total cost <= `budget` and small total error.

    Args:
      costs: per item, the bytes of each choice (non-negative integers).
      errors: per item, the error of each choice (finite, non-negative).
      budget: the most bytes allowed.
      steps: bisection steps of the multiplier.
    Returns:
      The chosen index per item.
    Raises:
      ValueError: if an item has no choice, the shapes differ, or the budget is below the
        cheapest choice of every item (naming the smallest feasible total).
    """
    c = [np.asarray(x, np.int64) for x in costs]
    e = [np.asarray(x, np.float64) for x in errors]
    if len(c) != len(e) or any(
        a.shape != b.shape or a.size == 0 for a, b in zip(c, e, strict=True)
    ):
        raise ValueError("solve: costs and errors need the same non-empty choices per item")
    if any(not np.all(np.isfinite(x)) for x in e):
        raise ValueError("solve: errors must be finite")
    low, _ = bounds(c)
    if budget < low:
        raise ValueError(f"budget {budget} bytes is below the smallest total, {low} bytes")
    choice = _pick(c, e, 0.0)
    if _total(c, choice) > budget:
        # Bracket: λ large enough that every item takes a cheapest choice (error spread over
        # the smallest cost step bounds it).
        spread = max(float(x.max() - x.min()) for x in e) + 1.0
        hi = spread + 1.0
        while _total(c, _pick(c, e, hi)) > budget:
            hi *= 2.0
        lo = hi * 1e-15
        if _total(c, _pick(c, e, lo)) <= budget:
            hi = lo
        for _ in range(steps):
            mid = float(np.sqrt(lo * hi))
            if _total(c, _pick(c, e, mid)) > budget:
                lo = mid
            else:
                hi = mid
        choice = _pick(c, e, hi)
    return tuple(int(j) for j in _fill(c, e, choice, budget))


def _fill(c: list[np.ndarray], e: list[np.ndarray], choice: np.ndarray, budget: int):
    """Greedy upgrades into the bytes left: best error drop per byte first."""
    choice = choice.copy()
    left = budget - _total(c, choice)
    while True:
        best, best_gain = None, 0.0
        for i, j in enumerate(choice):
            extra = c[i] - c[i][j]
            drop = e[i][j] - e[i]
            ok = (extra <= left) & (drop > 0)
            if not ok.any():
                continue
            # A free improvement (no extra bytes) is taken first.
            gain = np.where(ok, drop / np.maximum(extra, 1e-9), -np.inf)
            k = int(np.argmax(gain))
            if gain[k] > best_gain:
                best, best_gain = (i, k), float(gain[k])
        if best is None:
            return choice
        i, k = best
        left -= int(c[i][k] - c[i][choice[i]])
        choice[i] = k


def solve_timed(
    costs: Sequence[Sequence[int]],
    errors: Sequence[Sequence[float]],
    times: Sequence[Sequence[float]],
    budget: int,
    max_time: float,
    *,
    steps: int = 60,
) -> tuple[int, ...]:
    """`solve` with a second limit: the chosen choices' summed `times` <= `max_time`.

    The time enters as a second multiplier: each choice's error becomes ``error + μ time``,
    and μ >= 0 is bisected (log scale) to the smallest value whose `solve` meets the time
    limit, so the error is traded for time only as far as the limit needs.

    Raises:
      ValueError: as `solve`, or if no choice within the byte budget meets the time limit
        (naming the fastest total time found).
    """
    t = [np.asarray(x, np.float64) for x in times]
    e = [np.asarray(x, np.float64) for x in errors]
    if len(t) != len(e) or any(a.shape != b.shape for a, b in zip(t, e, strict=True)):
        raise ValueError("solve_timed: times need the same choices per item as errors")
    if any(not np.all(np.isfinite(x) & (x >= 0)) for x in t):
        raise ValueError("solve_timed: times must be finite and non-negative")

    def took(choice: tuple[int, ...]) -> float:
        return float(sum(x[j] for x, j in zip(t, choice, strict=True)))

    # A limit equal to a plan's time must admit it whatever order the sum was taken in.
    within = max_time + 1e-12 * max(1.0, abs(max_time))

    def with_weight(mu: float) -> tuple[int, ...]:
        return solve(costs, [a + mu * b for a, b in zip(e, t, strict=True)], budget)

    choice = with_weight(0.0)
    if took(choice) <= within:
        return choice
    # Bracket: μ large enough that time outweighs every error difference.
    spread = max(float(x.max() - x.min()) for x in e) + 1.0
    step = min(
        (float(np.diff(np.unique(x)).min()) for x in t if np.unique(x).size > 1), default=1.0
    )
    hi = spread / max(step, 1e-12) * 4.0
    fastest = with_weight(hi)
    if took(fastest) > within:
        raise ValueError(
            f"no plan within {budget} bytes takes at most {max_time:.6g} s; the fastest found "
            f"takes {took(fastest):.6g} s"
        )
    lo, best = 0.0, fastest
    for _ in range(steps):
        mid = float(np.sqrt(max(lo, hi * 1e-12) * hi))
        candidate = with_weight(mid)
        if took(candidate) <= within:
            hi, best = mid, candidate
        else:
            lo = mid
    return best
