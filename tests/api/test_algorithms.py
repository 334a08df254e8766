"""`lowbit.quantize_params` with rules that carry an algorithm: options and bad input."""

import jax
import pytest

import lowbit
from lowbit.api import AlgorithmOptions
from lowbit.qarray import PerGroup, QuantConfig
from lowbit.recipes import AWQ, Recipe, Rule

INT4 = QuantConfig(format="int4", granularity=PerGroup(8, axis=0))


def test_options_refuse_a_bad_sequential_count():
    with pytest.raises(ValueError, match=r"AlgorithmOptions.sequential=0.*int >= 1"):
        AlgorithmOptions(sequential=0)


def test_a_rule_needing_data_names_the_rule_the_parameter_and_the_fix():
    params = {"w": jax.random.normal(jax.random.key(0), (16, 4))}
    recipe = Recipe(rules=(Rule(path="w", weight=INT4, algorithm=AWQ()),), name="r")
    with pytest.raises(
        ValueError,
        match=r"quantize_params: recipe 'r', rule 0 \(path='w'\).*'awq' for 'w'.*calibration=",
    ):
        lowbit.quantize_params(params, recipe)


def test_precomputed_statistics_give_the_codes_calibration_gives():
    # How eval shares one calibration pass between recipes: capture once, pass the statistics.
    import numpy as np

    from lowbit.algorithms import AlgorithmReport, capture
    from lowbit.recipes import GPTQ

    fn = lambda p, x: jax.numpy.tanh(x @ p["a"]) @ p["b"]
    keys = jax.random.split(jax.random.key(0), 2)
    params = {"a": jax.random.normal(keys[0], (16, 16)), "b": jax.random.normal(keys[1], (16, 8))}
    batches = [jax.random.normal(jax.random.key(i), (32, 16)) for i in range(1, 3)]
    recipe = Recipe(rules=(Rule(weight=INT4, algorithm=GPTQ()),))
    direct = lowbit.quantize_params(params, recipe, fn=fn, calibration=batches)
    done, report = [], AlgorithmReport()
    options = AlgorithmOptions(
        statistics=capture(fn, params, batches, paths=["a", "b"]),
        on_weight=lambda n, total: done.append((n, total)),
    )
    shared = lowbit.quantize_params(params, recipe, algorithm_options=options, report=report)
    for path in ("a", "b"):
        np.testing.assert_array_equal(shared[path].codes, direct[path].codes)
    assert done == [(1, 2), (2, 2)] and sorted(report.applied) == ["a", "b"]
