"""`lowbit.quantize`: preset options, and the value checks on each weight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.qarray import PerGroup, QuantConfig
from lowbit.recipes import Recipe, Rule

PARAMS = {"dense": {"kernel": jax.random.normal(jax.random.key(0), (64, 8)), "bias": jnp.ones(8)}}


def test_preset_options_are_forwarded():
    q = lowbit.quantize(PARAMS, "int4_weight_only", group_size=32, kernel_layouts=False)
    kernel = q["dense"]["kernel"]
    assert kernel.format == "uint4" and kernel.scale.shape == (2, 8)  # 64 / 32 groups
    with pytest.raises(ValueError, match="group size 128 does not divide"):
        lowbit.quantize(PARAMS, "int4_weight_only")  # the preset's default groups of 128
    with pytest.raises(ValueError, match="does not take options"):
        lowbit.quantize(PARAMS, "int8_weight_only", group_size=32)
    with pytest.raises(TypeError, match="only a preset name takes"):
        lowbit.quantize(PARAMS, lowbit.preset("int8w"), group_size=32)


def _rule(**config) -> Recipe:
    return Recipe(rules=(Rule(path=".*kernel", weight=QuantConfig(**config)),))


def test_weights_are_checked_before_the_compiled_quantizer():
    bad = {"dense": {"kernel": jnp.full((64, 8), jnp.nan)}}
    with pytest.raises(ValueError, match="no finite value"):
        lowbit.quantize(bad, _rule(format="int8"))
    symmetric_uint = _rule(format="uint4", symmetric=True, granularity=PerGroup(32))
    with pytest.raises(ValueError, match="'uint4' is unsigned"):
        lowbit.quantize(PARAMS, symmetric_uint)
    q = lowbit.quantize(PARAMS, _rule(format="uint4", granularity=PerGroup(32)))
    np.testing.assert_allclose(
        q["dense"]["kernel"].dequantize(), PARAMS["dense"]["kernel"], atol=0.5
    )
