"""Recipes by name or file: a preset name (`lowbit.recipes.preset_names`), a path to a recipe
``.json`` file (`Recipe.from_json`), ``"float"`` (the reference itself) or ``"gguf"`` (a GGUF
file's own quantized blocks imported directly; GGUF models only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lowbit._untrusted import read_text
from lowbit.recipes import Recipe, preset, preset_names

GGUF_RECIPE = "gguf"
FLOAT_RECIPE = "float"


def load_recipe(spec: str) -> Any:
    """A `Recipe` from a preset name or a recipe JSON file.

    Raises:
      ValueError: for an unknown name (listing the presets) or a malformed file.
    """
    if spec.endswith(".json") or os.sep in spec:
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"recipe file {spec!r} does not exist")
        try:
            return Recipe.from_json(read_text(path))
        except ValueError as err:
            raise ValueError(f"recipe file {spec!r}: {err}") from None
    if spec not in preset_names():
        names = ", ".join([*preset_names(), GGUF_RECIPE])
        raise ValueError(
            f"recipe {spec!r} is neither a preset nor a .json file; accepted presets: {names}"
        )
    return preset(spec)


def check_recipe_spec(spec: str) -> None:
    """Raises the error `load_recipe` would, without a model: call before slow loading.

    Raises:
      ValueError / FileNotFoundError: for an unknown preset or a bad recipe file.
    """
    if spec != GGUF_RECIPE:
        load_recipe(spec)


def recipe_label(spec: str) -> str:
    """The name a recipe spec shows in tables: the preset name, or the JSON file's stem."""
    return Path(spec).stem if spec.endswith(".json") else spec
