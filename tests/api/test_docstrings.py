"""The examples in the public docstrings run."""

import doctest

import jax.numpy as jnp
import pytest
from flax import nnx

import lowbit.api._model
import lowbit.api._quantize
import lowbit.api._trace
import lowbit.recipes._presets
import lowbit.recipes._recipe


@pytest.mark.parametrize(
    "module",
    [
        lowbit.recipes._recipe,
        lowbit.recipes._presets,
        lowbit.api._trace,
        lowbit.api._quantize,
        lowbit.api._model,
    ],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, extraglobs={"jnp": jnp, "nnx": nnx}, verbose=False)
    assert result.attempted > 0 and result.failed == 0
