"""The Hadamard rotation against its dense matrix, built independently here in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.ops import hadamard_matrix, hadamard_transform
from lowbit.ops._hadamard import split_size


def _sylvester(p):
    h = np.array([[1.0]])
    while h.shape[0] < p:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


@pytest.mark.parametrize("n", [2, 8, 6, 12, 40, 256, 576, 18, 14])
def test_transform_matches_dense_orthogonal_matrix(n):
    h = hadamard_matrix(n, np.float64)
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-12)
    x = np.random.default_rng(n).normal(size=(3, 2, n)).astype(np.float32)
    got = jax.jit(hadamard_transform)(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), x @ h, atol=2e-5 * np.sqrt(n))
    back = hadamard_transform(got, inverse=True)
    np.testing.assert_allclose(np.asarray(back), x, atol=2e-5 * np.sqrt(n))


def test_power_of_two_is_sylvester_and_symmetric():
    np.testing.assert_allclose(hadamard_matrix(256, np.float64), _sylvester(256) / 16.0)


@pytest.mark.parametrize("n", [12, 20, 28, 36, 96, 576, 1536])
def test_orders_with_a_paley_factor_are_true_hadamard_matrices(n):
    # Every entry +-1/sqrt(n): outliers spread evenly over all channels.
    h = hadamard_matrix(n, np.float64)
    np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(n), rtol=1e-12)


def test_split_sizes():
    assert split_size(576) == (36, 16)
    assert split_size(1536) == (12, 128)
    assert split_size(64) == (1, 64)
    assert split_size(18) == (9, 2)  # no 36 from a factor of 2 alone: DCT of order 9


@pytest.mark.parametrize("n", [0, 9, -4])
def test_sizes_without_a_power_of_two_factor_are_refused(n):
    with pytest.raises(ValueError, match="power-of-two factor|positive size"):
        hadamard_matrix(n)
