"""Recipe JSON from a file a stranger wrote: every failure is a ValueError naming the source."""

from __future__ import annotations

import os

import pytest

from lowbit.recipes import Recipe, preset_from_maxtext_json


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{"rules": ' + "[" * 30000 + "]" * 30000 + "}", "recipe JSON is JSON nested too deeply"),
        ('{"rules": ' + "[" * 3000 + "]" * 3000 + "}", r"Recipe.rules\[0\]: \[\[\["),
        ('{"rules": [], "name": ' + "7" * 5000 + "}", "recipe JSON is not JSON this reader"),
        ('{"rules": [], "rules": []}', "key 'rules' appears twice"),
        ("{", "recipe JSON is not valid JSON"),
    ],
)
def test_recipe_from_json_refuses_hostile_text(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        Recipe.from_json(text)


def test_maxtext_json_file_names_the_file(tmp_path):
    path = tmp_path / "mp.json"
    path.write_text("[" * 30000)
    with pytest.raises(ValueError, match="intmp JSON file .*mp.json' is JSON nested too deeply"):
        preset_from_maxtext_json(str(path))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO"):
        preset_from_maxtext_json(str(fifo))
