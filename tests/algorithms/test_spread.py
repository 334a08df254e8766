"""Spreading GPTQ solves over processes: the assignment, the costs, and what one process does."""

import jax
import numpy as np
import pytest

import lowbit
from lowbit.algorithms import AlgorithmReport, _rounding
from lowbit.algorithms._capture import WeightStats
from lowbit.algorithms._spread import (
    assign,
    check_same_everywhere,
    gptq_cost,
    held_whole,
    local_copy,
)
from lowbit.api import AlgorithmOptions
from lowbit.qarray import QArray


def test_assign_gives_largest_first_to_least_loaded():
    # 10 -> p0; 8 -> p1; 5 -> p1 (8 < 10); 4 -> p0 (10 < 13); 1 -> p1 (13 < 14).
    assert assign([5, 10, 1, 8, 4], 2) == [1, 0, 1, 1, 0]
    loads = np.zeros(2)
    np.add.at(loads, assign([5, 10, 1, 8, 4], 2), [5, 10, 1, 8, 4])
    assert sorted(loads) == [14, 14]


def test_assign_is_deterministic_and_breaks_ties_by_index():
    assert assign([3, 3, 3, 3], 2) == [0, 1, 0, 1]
    assert assign([3, 3, 3, 3], 4) == [0, 1, 2, 3]
    assert assign([7], 3) == [0]
    assert assign([], 2) == []
    assert assign([2, 1], 1) == [0, 0]


def test_assign_balances_many_jobs():
    rng = np.random.default_rng(0)
    costs = rng.integers(1, 100, size=40)
    owner = assign(costs, 4)
    loads = np.bincount(owner, weights=costs, minlength=4)
    # Greedy largest-first: every process within the largest job of the mean.
    assert loads.max() - loads.min() <= costs.max()
    assert owner == assign(list(costs), 4)


def test_assign_refuses_no_processes():
    with pytest.raises(ValueError, match="processes=0"):
        assign([1.0], 0)


def _stats(k, fixed=()):
    z = np.zeros(k, np.float32)
    return WeightStats("w", (0,), fixed, np.zeros((k, k), np.float32), z, z)


def test_gptq_cost_is_rows_times_inputs_squared():
    assert gptq_cost((256, 384), [_stats(256)]) == 384 * 256**2
    # Stacked layers: one matrix per layer index.
    stacked = [_stats(64, ((0, i),)) for i in range(3)]
    assert gptq_cost((3, 64, 32), stacked) == 3 * 32 * 64**2


def test_one_process_holds_arrays_whole_and_agrees_with_itself():
    x = jax.numpy.ones((4, 4))
    assert held_whole(x) and held_whole(np.ones(3))
    assert local_copy(x) is x
    check_same_everywhere("recipe", "a", "text", "fix")  # one process: nothing to compare


def test_one_process_solves_every_weight_and_reports_no_spread():
    """With one process nothing is spread (and the option changes nothing)."""
    rng = np.random.default_rng(0)
    params = {"a": {"kernel": rng.normal(size=(64, 32)).astype(np.float32)}}
    batches = [(rng.normal(size=(96, 64)).astype(np.float32),)]
    solved = []
    solve = _rounding.gptq_qarray

    def counting(w, q, stats, *args, **kwargs):
        solved.append(stats[0].path)
        return solve(w, q, stats, *args, **kwargs)

    results = []
    for spread in (True, False):
        report = AlgorithmReport()
        _rounding.gptq_qarray = counting
        try:
            q = lowbit.quantize(
                params,
                "int4w_g64_gptq",
                fn=lambda p, x: x @ p["a"]["kernel"],
                calibration=batches,
                kernel_layouts=False,
                report=report,
                algorithm_options=AlgorithmOptions(spread=spread),
            )
        finally:
            _rounding.gptq_qarray = solve
        assert report.solved_by == {}
        results.append(np.asarray(q["a"]["kernel"].codes))
    assert solved == ["a/kernel", "a/kernel"]
    np.testing.assert_array_equal(results[0], results[1])


def _solves(solve):
    """`SpreadSolves` over two weights in this one process (its exchanges run as with many)."""
    from lowbit.algorithms._rounding import Context
    from lowbit.algorithms._spread import SpreadSolves

    ctx = Context(statistics=None, report=AlgorithmReport())
    floats = {"a": np.ones((64, 32), np.float32), "b": np.full((64, 32), 2.0, np.float32)}
    return SpreadSolves(["a", "b"], [1.0, 2.0], solve, ctx, floats.__getitem__, _rtn), ctx


def _rtn(path):
    w = np.full((64, 32), ord(path), np.float32)
    return lowbit.quantize({"a": {"kernel": w}}, "int4w_g32_asym", kernel_layouts=False)["a"][
        "kernel"
    ]


def test_spread_solves_exchange_the_qarray_and_the_report(monkeypatch):
    import lowbit.algorithms._spread as spread

    monkeypatch.setattr(spread, "local_context", lambda ctx, report: ctx.__class__(None, report))

    def solve(path, ctx):
        ctx.report.applied[path] = f"solved {path}"
        ctx.report.notes.append(f"note {path}")
        return _rtn(path)

    solves, ctx = _solves(solve)
    solves._round()  # "a" solved and exchanged;
    solves.treedefs.clear()  # rebuilt as a process that did not solve it does
    a, b = solves.result("a"), solves.result("b")
    assert ctx.report.applied == {"a": "solved a", "b": "solved b"}
    assert ctx.report.notes == ["note a", "note b"]
    assert ctx.report.solved_by == {"a": 0, "b": 0}
    assert isinstance(a, QArray) and isinstance(a.codes, jax.Array)
    np.testing.assert_array_equal(a.dequantize(), np.full((64, 32), ord("a"), np.float32))
    np.testing.assert_array_equal(b.dequantize(), np.full((64, 32), ord("b"), np.float32))


def test_an_error_in_a_spread_solve_is_raised_naming_the_process(monkeypatch):
    import lowbit.algorithms._spread as spread

    monkeypatch.setattr(spread, "local_context", lambda ctx, report: ctx.__class__(None, report))

    def solve(path, ctx):
        raise ValueError(f"{path}: Hessian singular (strict mode)")

    solves, _ = _solves(solve)
    with pytest.raises(
        ValueError, match=r"b: Hessian singular .* \(raised on process 0, which solved 'b'\)"
    ):
        solves.result("b")
