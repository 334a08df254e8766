"""Recipe specs: a preset name, a recipe JSON file, ``"float"`` or ``"gguf"``."""

import pytest

from lowbit import serving
from lowbit.recipes import preset


def test_preset_and_json_file(tmp_path):
    assert serving.load_recipe("int8") == preset("int8")
    path = tmp_path / "mine.json"
    path.write_text(preset("int8").to_json())
    assert serving.load_recipe(str(path)) == preset("int8")
    assert serving.recipe_label(str(path)) == "mine"
    assert serving.recipe_label("int8") == "int8"


def test_errors_name_the_recipe(tmp_path):
    with pytest.raises(ValueError, match="neither a preset nor a .json file"):
        serving.load_recipe("no-such-recipe")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        serving.load_recipe(str(tmp_path / "x.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="recipe file"):
        serving.load_recipe(str(bad))


def test_gguf_needs_no_recipe_file():
    serving.check_recipe_spec(serving.GGUF_RECIPE)
    with pytest.raises(ValueError):
        serving.check_recipe_spec("no-such-recipe")
