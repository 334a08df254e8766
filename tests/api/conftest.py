"""Fixtures shared by the API tests."""

import jax
import pytest
from api_models import MLP, Block
from flax import nnx


@pytest.fixture(scope="session")
def mlp():
    # Equal layer shapes: one compiled quantizer per preset serves both kernels.
    return MLP((128, 128, 128), rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def mlp_input():
    return jax.random.normal(jax.random.key(1), (8, 128))


@pytest.fixture(scope="session")
def block():
    return Block(rngs=nnx.Rngs(2))


@pytest.fixture(scope="session")
def mlp_output(mlp, mlp_input):
    return mlp(mlp_input)
