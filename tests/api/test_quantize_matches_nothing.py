"""A recipe that matches no parameter says so (a tree named otherwise must not come back float)."""

import jax.numpy as jnp
import pytest

import lowbit
from lowbit.qarray import QArray


def test_a_preset_matching_nothing_warns_and_strict_raises():
    params = {"w": jnp.ones((64, 32))}
    with pytest.warns(UserWarning, match=r"quantizes none of the 1 parameters \('w'\)"):
        out = lowbit.quantize(params, "int8_weight_only")
    assert not isinstance(out["w"], QArray)
    with pytest.raises(ValueError, match="Rule\\(path=...\\) names these parameters"):
        lowbit.quantize(params, "int8_weight_only", strict=True)


def test_a_recipe_that_matches_something_is_silent():
    recipe = lowbit.Recipe(rules=(lowbit.Rule(path="w", weight=lowbit.QuantConfig(format="int8")),))
    out = lowbit.quantize({"w": jnp.ones((64, 32))}, recipe, strict=True)
    assert isinstance(out["w"], QArray)
