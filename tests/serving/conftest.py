"""A small Llama whose matmuls are big enough for the CPU kernels."""

import pytest
from lm_support import tiny_lm as _tiny_lm


@pytest.fixture
def tiny_lm():
    return _tiny_lm(dim=256, ffn_dim=512)
