"""The package's layers import only from layers below them, and nothing imports pickle.

The same layers, with no import of another package's private module and no cycle between the
modules of a package, are import-linter contracts in pyproject.toml (`make lint`); the last
tests here run them."""

import ast
import importlib.util
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowbit"

# Bottom to top. GGUF (block codecs, the file reader and writer) sits below everything that
# reads or writes GGUF; kernels sit below ops (the ops layer picks kernels); algorithms
# (rounding math and calibration statistics) sit below the api that runs them from `quantize`;
# models (plain float reference networks) sit below io, whose importers map checkpoints onto
# them.
LAYERS = [
    "gguf",
    "formats",
    "qarray",
    "kernels",
    "ops",
    "engine",
    "recipes",
    "algorithms",
    "api",
    "models",
    "io",
    "serving",
    "server",
    "eval",
    "cli",
]


def _imports(path: pathlib.Path) -> set[str]:
    """Modules `path` imports. ``from lowbit import kernels`` counts as ``lowbit.kernels``, and
    ``from lowbit import quantize`` (a name, not a layer) as the package root ``lowbit``."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "lowbit":
                names.add(node.module)
                continue
            names.update(
                f"lowbit.{alias.name}" if alias.name in LAYERS else "lowbit" for alias in node.names
            )
    return names


def _rank(name: str) -> int | None:
    """The layer `name` sits in (the package root above every layer), None outside lowbit."""
    parts = name.split(".")
    if parts[0] != "lowbit":
        return None
    if len(parts) == 1:
        return len(LAYERS)
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def _layer_files():
    for layer in LAYERS:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            yield layer, path


@pytest.mark.parametrize("layer, path", list(_layer_files()), ids=lambda v: str(v))
def test_imports_only_from_lower_layers(layer, path):
    rank = LAYERS.index(layer)
    for name in _imports(path):
        other = _rank(name)
        assert other is None or other <= rank, f"{path.name} ({layer}) imports {name}"


# What the bottom layer may import besides the standard library and the package-root helpers.
GGUF_THIRD_PARTY = {"numpy", "jax", "ml_dtypes", "gguf"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "gguf").rglob("*.py")), ids=lambda p: p.name)
def test_gguf_layer_needs_only_numpy_jax_and_gguf(path):
    for name in _imports(path):
        top = name.split(".")[0]
        if top == "lowbit":
            assert name.split(".")[1] in ("gguf", "_untrusted", "_atomic"), f"{path.name}: {name}"
        else:
            assert top in sys.stdlib_module_names or top in GGUF_THIRD_PARTY, f"{path.name}: {name}"


def test_the_check_reads_every_import_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import lowbit\nimport lowbit.io._gguf_import\nfrom lowbit import kernels, quantize\n"
        "from lowbit.api import quantize_model\n"
    )
    ranks = {name: _rank(name) for name in _imports(source)}
    assert ranks == {
        "lowbit": len(LAYERS),
        "lowbit.io._gguf_import": LAYERS.index("io"),
        "lowbit.kernels": LAYERS.index("kernels"),
        "lowbit.api": LAYERS.index("api"),
    }


def test_no_pickle_anywhere():
    for path in PACKAGE.rglob("*.py"):
        names = _imports(path)
        assert not {"pickle", "cloudpickle", "dill"} & names, path


def _contracts() -> list[dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["root_package"] == "lowbit"
    return config["contracts"]


def test_the_import_linter_contracts_are_these_layers_with_no_exceptions():
    contracts = _contracts()
    assert sorted(c["type"] for c in contracts) == ["acyclic_siblings", "layers", "private_modules"]
    (layers,) = [c for c in contracts if c["type"] == "layers"]
    assert layers["layers"] == [f"lowbit.{name}" for name in reversed(LAYERS)]
    for contract in contracts:
        assert not {"ignore_imports", "unmatched_ignore_imports_alerting"} & set(contract), contract


def test_import_linter_contracts_hold():
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip(
            "import-linter is not installed (it is in the test extras: pip install -e '.[test]')"
        )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
            "--no-cache",
            "--no-logo",
            "pyproject.toml",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"import-linter:\n{result.stdout}\n{result.stderr}"


def test_importing_lowbit_compiles_nothing():
    # Every command pays for its imports: a module-level table computed with JAX ops compiled
    # one program per op (a second of every `lowbit` start, before this was checked).
    env = dict(os.environ, JAX_LOG_COMPILES="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", "import lowbit, lowbit.cli, lowbit.server"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    compiled = [line for line in result.stderr.splitlines() if "XLA compilation" in line]
    assert not compiled, "\n".join(compiled)
