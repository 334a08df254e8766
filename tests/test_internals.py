"""Only `lowbit/engine/_compat.py` touches JAX internals (one place to change per JAX release),
and `lowbit/kernels/_platform.py`, which defines one primitive (per-platform lowering rules) through
`jax.extend`, the extension API, and sits below the engine."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "lowbit"
ALLOWED = (PACKAGE / "engine" / "_compat.py", PACKAGE / "kernels" / "_platform.py")
INTERNAL = ("jax.extend", "jax._src")


def _violations(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            # `.bind(` calls, and `jax.extend.x` / `jax._src.x` reached by attribute.
            if node.attr == "bind":
                found.append(f"line {node.lineno}: .bind")
            names = [ast.unparse(node)]
        else:
            continue
        found += [
            f"line {node.lineno}: {name}"
            for name in names
            if any(name == p or name.startswith(p + ".") for p in INTERNAL)
        ]
    return found


def test_only_compat_touches_jax_internals():
    offenders = {
        str(path.relative_to(PACKAGE)): v
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in ALLOWED and (v := _violations(path))
    }
    assert offenders == {}


def test_the_check_sees_violations(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from jax.extend import core\nimport jax._src.core\nx = p.bind(1)\n")
    assert len(_violations(bad)) >= 3
