"""Fuzzes recipe JSON (`Recipe.from_json`, `lowbit.recipes._json`) and MaxText's mixed-precision
JSON (`preset_from_maxtext_json`).

Contract: a `ValueError` (naming the field, or "recipe JSON" / "intmp" for the text itself), or
a recipe whose JSON parses back to an equal recipe.
"""

from __future__ import annotations

from fuzz._contract import documented, main
from fuzz._seeds import recipe_seeds

seeds = recipe_seeds  # what `python -m fuzz` starts the corpus from

# Every error names where: a Recipe / Rule field, the text, or the intmp entry.
_NAMES = ("Recipe", "Rule", "recipe JSON", "intmp", "algorithm", "kv_cache")


def _load():
    global Recipe, preset_from_maxtext_json
    from lowbit.recipes import Recipe, preset_from_maxtext_json


def test_one(data: bytes) -> None:
    with documented((ValueError,), _NAMES):
        recipe = Recipe.from_json(data)
        again = Recipe.from_json(recipe.to_json())
        assert again == recipe, (recipe, again)
    text = data.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):
        with documented((ValueError,), _NAMES):
            preset_from_maxtext_json(text)


if __name__ == "__main__":
    main(test_one, _load)
