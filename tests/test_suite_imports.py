"""Test modules import the suite's helpers (`lm_support`, `compiled`, ...) as top-level
modules, never through a `tests` package: `make test-jax-compat` runs pytest from inside tests/
(so that the installed lowbit is the one imported), where no `tests` package exists."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def _through_tests_package(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        if any(name == "tests" or name.startswith("tests.") for name in names):
            lines.append(node.lineno)
    return lines


def test_no_test_module_imports_through_a_tests_package():
    offenders = {
        str(path.relative_to(TESTS)): lines
        for path in sorted(TESTS.rglob("*.py"))
        if (lines := _through_tests_package(path.read_text()))
    }
    assert not offenders, f"import these as top-level modules (tests/ is on sys.path): {offenders}"


def test_the_check_sees_both_forms():
    assert _through_tests_package("from tests.lm_support import tiny_lm\nimport tests.compiled\n")
    assert _through_tests_package("import tests\n") == [1]
    assert not _through_tests_package("from lm_support import tiny_lm\nimport testsuite\n")
