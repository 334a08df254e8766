"""`Recipe.rotate`: text forms, JSON round trip, and errors that name the field."""

import pytest

from lowbit.recipes import Recipe, RotationConfig, parse_rotation, preset


@pytest.mark.parametrize(
    "text, online, strict",
    [
        ("hadamard", ("down_proj",), False),
        ("hadamard:offline", (), False),
        ("hadamard+strict", ("down_proj",), True),
    ],
)
def test_text_forms_round_trip(text, online, strict):
    config = parse_rotation(text)
    assert config.online == online and config.strict == strict
    assert parse_rotation(config.to_text()) == config


@pytest.mark.parametrize("text", [None, "", "none", "float"])
def test_no_rotation(text):
    assert parse_rotation(text) is None


def test_recipe_json_round_trip_keeps_the_rotation():
    recipe = preset("int4w_g64_rot_gptq")
    assert recipe.rotate == RotationConfig()
    back = Recipe.from_json(recipe.to_json())
    assert back == recipe and '"rotate": "hadamard"' in recipe.to_json()
    assert "rotate" not in preset("int4w_g64_gptq").to_json()


def test_bad_rotation_names_the_field_and_the_forms():
    with pytest.raises(ValueError, match=r"Recipe.rotate: 'spin' .*hadamard:offline"):
        Recipe.from_json({"rules": [], "rotate": "spin"})
    with pytest.raises(ValueError, match="rotate.online names"):
        RotationConfig(online=("q_proj",))
