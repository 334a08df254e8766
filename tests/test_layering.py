"""The package's layers import only from layers below them, and nothing imports pickle."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "lowbit"

# Bottom to top. Kernels sit below ops (the ops layer picks kernels); models (plain float
# reference networks) sit below io, whose importers map checkpoints onto them.
LAYERS = [
    "formats",
    "qarray",
    "kernels",
    "ops",
    "engine",
    "recipes",
    "api",
    "algorithms",
    "models",
    "io",
    "serving",
    "eval",
    "cli",
]


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _layer_files():
    for layer in LAYERS:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            yield layer, path


@pytest.mark.parametrize("layer, path", list(_layer_files()), ids=lambda v: str(v))
def test_imports_only_from_lower_layers(layer, path):
    rank = LAYERS.index(layer)
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] != "lowbit" or len(parts) < 2 or parts[1] not in LAYERS:
            continue
        assert LAYERS.index(parts[1]) <= rank, f"{path.name} ({layer}) imports {name}"


def test_no_pickle_anywhere():
    for path in PACKAGE.rglob("*.py"):
        names = _imports(path)
        assert not {"pickle", "cloudpickle", "dill"} & names, path
