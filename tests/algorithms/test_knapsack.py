"""The multiple-choice knapsack against brute force on small random instances."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.algorithms import knapsack_bounds, solve_knapsack


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
