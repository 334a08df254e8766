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
