"""The calibration walk shared by `capture` and `lowbit.calibrate`."""

import jax.numpy as jnp
import numpy as np

from lowbit.algorithms import activation_rows, batch_args, kept_rows, walk_batch


def test_batch_args_unpacks_tuples_only():
    x = jnp.ones(3)
    assert batch_args((x, x)) == (x, x)
    assert batch_args(x)[0] is x


def test_walk_batch_gives_each_use_the_batch_mask_and_its_rows():
    params = {"w": jnp.arange(12.0).reshape(4, 3)}
    x = jnp.arange(2 * 5 * 4, dtype=jnp.float32).reshape(2, 5, 4)
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    seen = []

    def visit(use, m):
        if use.op == "dot_general":
            rows, row_shape = activation_rows(use)
            seen.append((use.paths, rows.shape, row_shape, kept_rows(m, row_shape)))

    walk_batch(lambda p, x, m: x @ p["w"], params, (x, mask), visit, row_mask=lambda x, m: m)
    ((paths, shape, row_shape, keep),) = seen
    assert paths == {"w"} and shape == (10, 4) and row_shape == (2, 5)
    np.testing.assert_array_equal(keep, mask.reshape(-1) != 0)


def test_kept_rows_is_none_without_a_mask_or_for_other_row_shapes():
    mask = jnp.ones((2, 5))
    assert kept_rows(None, (2, 5)) is None
    assert kept_rows(mask, (10,)) is None
    assert kept_rows(mask, (2, 5)).shape == (10,)
