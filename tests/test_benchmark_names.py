"""Every name a benchmark module takes from lowbit still exists.

The benchmarks run outside the suite (`make bench`, with the peers), so a helper renamed or
removed in the package would otherwise be found only when a benchmark next runs: the
`decode_rows` section once called three server helpers removed months before. This reads the
modules' source (no benchmark runs) and looks each ``from lowbit... import name`` and each
``module.attribute`` of an imported lowbit module up in the package."""

import ast
import importlib
import pathlib
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted((ROOT / "benchmarks").glob("*.py"))


def _lookup(module: types.ModuleType, name: str) -> object | None:
    """``module.name``, or the submodule of that name, or None when neither exists."""
    if hasattr(module, name):
        return getattr(module, name)
    try:
        return importlib.import_module(f"{module.__name__}.{name}")
    except ModuleNotFoundError:
        return None


def missing_names(source: str) -> list[str]:
    """``line: module.name`` for each lowbit name `source` uses that the package lacks."""
    tree = ast.parse(source)
    modules: dict[str, types.ModuleType] = {}  # local name -> the lowbit module it is bound to
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lowbit":
            module = importlib.import_module(node.module)
            for alias in node.names:
                found = _lookup(module, alias.name)
                if found is None:
                    missing.append(f"{node.lineno}: {node.module}.{alias.name}")
                elif isinstance(found, types.ModuleType):
                    modules[alias.asname or alias.name] = found
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lowbit":
                    bound = alias.asname or "lowbit"
                    modules[bound] = importlib.import_module(alias.name if alias.asname else bound)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _lookup(modules[node.value.id], node.attr) is None
        ):
            missing.append(f"{node.lineno}: {modules[node.value.id].__name__}.{node.attr}")
    return missing


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_benchmark_uses_only_names_lowbit_has(path):
    assert missing_names(path.read_text()) == []


def test_a_removed_helper_is_found():
    source = (
        "from lowbit.server import _programs as programs\n"
        "from lowbit.models import take_rows, no_such_function\n"
        "programs.decode_rows, programs._gather\n"
    )
    assert missing_names(source) == [
        "2: lowbit.models.no_such_function",
        "3: lowbit.server._programs._gather",
    ]
