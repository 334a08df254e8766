"""Recipes refuse out-of-range sizes and bounds when they are built, not when they are used."""

import json

import pytest

from lowbit.recipes import Recipe, preset


def _recipe_json(**weight) -> str:
    return json.dumps({"rules": [{"path": ".*", "weight": {"format": "int8", **weight}}]})


@pytest.mark.parametrize(
    "weight, fragment",
    [
        (dict(granularity="per_block:0x32"), r"granularity: 'per_block:0x32': PerBlock.block"),
        (dict(granularity="per_block:-1x4"), r"granularity: 'per_block:-1x4': PerBlock.block"),
        (dict(granularity="per_group:0"), r"granularity: 'per_group:0': PerGroup.size=0"),
        (dict(calibration="percentile,150"), r"calibration: .*Percentile.q=150"),
        (dict(calibration="absmax,0"), r"calibration: .*AbsMax.clip=0"),
        (dict(format="uint4", symmetric=True, calibration="fixed,-1,1"), "lo=-1.0 is negative"),
    ],
)
def test_from_json_refuses_out_of_range_values(weight, fragment):
    with pytest.raises(ValueError, match=fragment):
        Recipe.from_json(_recipe_json(**weight))


def test_from_json_unsigned_format_defaults_to_asymmetric():
    recipe = Recipe.from_json(_recipe_json(format="uint4", granularity="per_group:32"))
    assert recipe.rules[0].weight.symmetric is False
    assert Recipe.from_json(recipe.to_json()) == recipe


@pytest.mark.parametrize("group_size", [0, -8])
def test_preset_refuses_a_non_positive_group_size(group_size):
    with pytest.raises(ValueError, match=f"preset 'int4_weight_only' with group_size={group_size}"):
        preset("int4_weight_only", group_size=group_size)
