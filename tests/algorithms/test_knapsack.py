"""The multiple-choice knapsack against brute force on small random instances."""

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lowbit.algorithms import knapsack_bounds, solve_knapsack, solve_knapsack_timed


def _instance(seed: int, items: int, choices: int):
    rng = np.random.default_rng(seed)
    costs = [rng.integers(1, 50, size=rng.integers(1, choices + 1)) for _ in range(items)]
    # Error falls with cost (as a format's error falls with its bits), plus noise: some
    # choices are dominated.
    errors = [100.0 / c + rng.uniform(0, 5, size=c.size) for c in costs]
    return costs, errors


def _brute(costs, errors, budget):
    best = None
    for pick in itertools.product(*(range(len(c)) for c in costs)):
        cost = sum(c[j] for c, j in zip(costs, pick, strict=True))
        if cost <= budget:
            err = sum(e[j] for e, j in zip(errors, pick, strict=True))
            best = err if best is None else min(best, err)
    return best


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    items=st.integers(1, 5),
    choices=st.integers(1, 4),
    where=st.floats(0, 1),
)
def test_feasible_and_within_one_item_of_the_optimum(seed, items, choices, where):
    costs, errors = _instance(seed, items, choices)
    low, high = knapsack_bounds(costs)
    budget = int(low + where * (high - low))
    pick = solve_knapsack(costs, errors, budget)
    cost = sum(c[j] for c, j in zip(costs, pick, strict=True))
    err = sum(e[j] for e, j in zip(errors, pick, strict=True))
    assert cost <= budget
    best = _brute(costs, errors, budget)
    assert err >= best - 1e-9
    # The Lagrangian choice is on the lower hull; one item's step separates it from the
    # relaxation's optimum, and the fill only lowers the error.
    assert err <= best + max(float(e.max() - e.min()) for e in errors) + 1e-9


def test_mostly_exact_on_random_instances():
    exact = 0
    for seed in range(40):
        costs, errors = _instance(seed, 6, 4)
        low, high = knapsack_bounds(costs)
        budget = (low + high) // 2
        pick = solve_knapsack(costs, errors, budget)
        err = sum(e[j] for e, j in zip(errors, pick, strict=True))
        exact += abs(err - _brute(costs, errors, budget)) < 1e-9
    assert exact >= 30, exact


def test_budget_at_the_bounds():
    costs = [[1, 4], [2, 8]]
    errors = [[5.0, 1.0], [7.0, 2.0]]
    assert solve_knapsack(costs, errors, 3) == (0, 0)
    assert solve_knapsack(costs, errors, 12) == (1, 1)
    assert solve_knapsack(costs, errors, 6) == (1, 0)  # 4 + 2 bytes: error 8 (not 12)


def test_below_the_smallest_total_raises():
    with pytest.raises(ValueError, match="below the smallest total, 3 bytes"):
        solve_knapsack([[1, 4], [2, 8]], [[1.0, 0.0], [1.0, 0.0]], 2)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="same non-empty choices"):
        solve_knapsack([[1, 2]], [[1.0]], 5)


def _timed(seed: int, items: int, choices: int):
    costs, errors = _instance(seed, items, choices)
    rng = np.random.default_rng(seed + 1)
    # Time falls with cost less than error does: fewer bytes are mostly faster, not always.
    times = [0.5 * c + rng.uniform(0, 20, size=c.size) for c in costs]
    return costs, errors, times


# One choice per item: the limit is the only plan's time (summed in another order).
@example(seed=66254951, items=5, choices=1)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), items=st.integers(1, 5), choices=st.integers(1, 4))
def test_timed_choice_meets_both_limits(seed, items, choices):
    costs, errors, times = _timed(seed, items, choices)
    budget = knapsack_bounds(costs)[1]  # bytes never bind: only the time does
    took = lambda p: sum(t[j] for t, j in zip(times, p, strict=True))
    fastest = sum(float(t.min()) for t in times)
    slowest_free = took(solve_knapsack(costs, errors, budget))
    limit = fastest + 0.5 * (slowest_free - fastest)
    pick = solve_knapsack_timed(costs, errors, times, budget, limit)
    assert took(pick) <= limit + 1e-9
    assert sum(c[j] for c, j in zip(costs, pick, strict=True)) <= budget
    # A limit the untimed choice already meets changes nothing.
    assert solve_knapsack_timed(costs, errors, times, budget, slowest_free) == solve_knapsack(
        costs, errors, budget
    )


def test_timed_limit_below_the_fastest_raises():
    costs, errors, times = _timed(0, 3, 3)
    fastest = sum(float(t.min()) for t in times)
    with pytest.raises(ValueError, match="the fastest found takes"):
        solve_knapsack_timed(costs, errors, times, 10**6, 0.5 * fastest)
    with pytest.raises(ValueError, match="finite and non-negative"):
        solve_knapsack_timed(costs, errors, [-t for t in times], 10**6, 1.0)
