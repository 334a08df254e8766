"""The fixed-order row sum: the kernel, the pure-JAX reference and a NumPy statement of the
order give the same bits, at any leading shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import kernels
from lowbit.kernels import _reference


def pairwise(row: np.ndarray) -> np.float32:
    """The order `row_sum` promises, in NumPy: pad to a power of two, add the halves."""
    width = 1 << max(len(row) - 1, 0).bit_length()
    row = np.concatenate([row, np.zeros(width - len(row), np.float32)])
    while len(row) > 1:
        row = row[: len(row) // 2] + row[len(row) // 2 :]
    return row[0]


def spread(shape, seed) -> np.ndarray:
    """Values over seven decades, where the order of the adds shows in the last bits."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)).astype(np.float32)


_kernel = jax.jit(kernels.row_sum, static_argnames="square")
_tree = jax.jit(_reference.row_sum, static_argnames="square")


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("d", [1, 5, 64, 576, 1000])
def test_row_sum_adds_in_its_fixed_order_at_any_leading_shape(d, square):
    x = spread((8, d), d)
    want = np.array([pairwise(r * r if square else r) for r in x])
    got = np.asarray(_kernel(x, square=square))
    assert got.shape == (8, 1)
    np.testing.assert_array_equal(got[:, 0], want)
    np.testing.assert_array_equal(np.asarray(_tree(x, square=square))[:, 0], want)
    for rows in (x[:1], x[:3], x.reshape(2, 4, d)):  # other programs, the same bits per row
        np.testing.assert_array_equal(
            np.asarray(_kernel(rows, square=square)).reshape(-1), want[: rows[..., 0].size]
        )


def test_row_sum_of_many_rows_has_the_same_bits():
    x = spread((300, 576), 7)  # a prefill's rows
    want = np.array([pairwise(r) for r in x])
    np.testing.assert_array_equal(np.asarray(_kernel(x))[:, 0], want)


def test_row_sum_edges_vmap_and_gradient():
    np.testing.assert_array_equal(_kernel(np.zeros((2, 0), np.float32)), np.zeros((2, 1)))
    assert _kernel(np.zeros((0, 4), np.float32)).shape == (0, 1)
    x = spread((3, 2, 5), 1)
    np.testing.assert_array_equal(jax.vmap(kernels.row_sum)(x), _kernel(x))
    grad = jax.grad(lambda v: kernels.row_sum(v, square=True).sum())(jnp.arange(4.0))
    np.testing.assert_array_equal(grad, [0.0, 2.0, 4.0, 6.0])
    nan = _kernel(np.array([[1.0, np.nan, 2.0]], np.float32))
    assert np.isnan(nan).all()
    # float64 and bfloat16 take the reference (the same order), other dtypes are refused.
    assert kernels.row_sum(jnp.ones((2, 3), jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="float array"):
        kernels.row_sum(jnp.ones((2, 3), jnp.int32))


@pytest.mark.skipif(not kernels.available(), reason=kernels.status())
def test_row_sum_is_one_kernel_call_on_cpu():
    text = jax.jit(kernels.row_sum).lower(jnp.ones((4, 576))).as_text()
    assert "lowbit_row_sum" in text and "stablehlo.add" not in text
