"""The Python examples of the README and of each page in docs/ run: each file in order, as one
program, so a page's examples may build on its earlier ones."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def test_readme_has_a_tour():
    assert len(_blocks(ROOT / "README.md")) >= 3


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.name)
def test_examples_run(page: pathlib.Path):
    namespace: dict = {}
    for block in _blocks(page):
        exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 - our own pages
