"""SparseGPT N:M pruning against magnitude pruning and a plain NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.algorithms import sparsegpt_matrix
from lowbit.api import SparseRule, nm_sparsify_params, sparsegpt_params
from lowbit.qarray import NMSparse, nm_mask, nm_sparsify

F, K = 6, 32


def _weight(seed=0):
    return jax.random.normal(jax.random.key(seed), (F, K), jnp.float32)


def _correlated_inputs(n=256, k=K, seed=1):
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(k // 4, k))
    return (rng.normal(size=(n, k // 4)) @ mix + 0.05 * rng.normal(size=(n, k))).astype(np.float32)


def _numpy_sparsegpt(w, h, n, m, damp=0.01):
    """Column by column in float64, no lazy blocks: mask per group of m at its first column."""
    w = np.array(w, np.float64)
    h = np.array(h, np.float64) + damp * np.mean(np.diag(h)) * np.eye(len(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    keep = np.zeros(w.shape, bool)
    for j in range(w.shape[1]):
        if j % m == 0:
            cost = w[:, j : j + m] ** 2 / np.diag(u)[j : j + m] ** 2
            ranks = np.argsort(np.argsort(-cost, axis=1, kind="stable"), axis=1, kind="stable")
            keep[:, j : j + m] = ranks < n
        q = np.where(keep[:, j], w[:, j], 0.0)
        err = (w[:, j] - q) / u[j, j]
        w[:, j:] -= np.outer(err, u[j, j:])
    return w, keep


def test_identity_hessian_gives_magnitude_pruning():
    w = _weight()
    pruned, keep = sparsegpt_matrix(w, jnp.eye(K), 2, 4, block=8)
    expected = nm_mask(w, 2, 4, axis=1)
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(expected))
    np.testing.assert_allclose(pruned, jnp.where(expected, w, 0.0), atol=1e-6)


def test_matches_numpy_reference_and_beats_magnitude_pruning():
    w, x = _weight(2), _correlated_inputs()
    gram = x.T @ x
    pruned, keep = sparsegpt_matrix(w, gram, 2, 4, block=8)  # lazy blocks of 8 columns
    ref, ref_keep = _numpy_sparsegpt(w, gram, 2, 4)
    np.testing.assert_array_equal(np.asarray(keep), ref_keep)
    np.testing.assert_allclose(np.asarray(pruned), ref, rtol=1e-3, atol=1e-3)
    assert np.all(np.asarray(pruned)[~ref_keep] == 0)
    assert np.all(ref_keep.reshape(F, K // 4, 4).sum(-1) == 2)
    err = lambda q: float(np.sum((x @ (np.asarray(w) - np.asarray(q)).T) ** 2))
    magnitude = jnp.where(nm_mask(w, 2, 4, axis=1), w, 0.0)
    assert err(pruned) < 0.7 * err(magnitude)


def test_group_size_must_divide_the_inputs():
    with pytest.raises(ValueError, match="m=3 does not divide the 32 inputs"):
        sparsegpt_matrix(_weight(), jnp.eye(K), 1, 3)


def _mlp(p, x):
    h = jnp.tanh(x @ p["up"]["kernel"])
    return h @ p["down"]["kernel"]


def test_params_prune_every_selected_kernel_and_compress_with_their_masks():
    keys = jax.random.split(jax.random.key(3), 2)
    params = {
        "up": {"kernel": jax.random.normal(keys[0], (K, 16)) / 4},
        "down": {"kernel": jax.random.normal(keys[1], (16, 8)) / 4},
    }
    x = jnp.asarray(_correlated_inputs(n=128))
    batches = [x[:64], x[64:]]
    rule = SparseRule()
    pruned, masks, notes = sparsegpt_params(_mlp, params, batches, rule)
    assert notes == [] and set(masks) == {"up/kernel", "down/kernel"}
    for path, (a, b) in {"up/kernel": ("up", "kernel"), "down/kernel": ("down", "kernel")}.items():
        w, keep = np.asarray(pruned[a][b]), np.asarray(masks[path])
        assert np.all(w[~keep] == 0)
        assert np.all(keep.reshape(-1, 4, keep.shape[-1]).sum(1) == 2)  # 2:4 along inputs
    sparse = nm_sparsify_params(pruned, rule, masks)
    assert isinstance(sparse["up"]["kernel"], NMSparse)
    np.testing.assert_array_equal(sparse["up"]["kernel"].dequantize(), pruned["up"]["kernel"])

    reference = _mlp(params, x)
    magnitude = nm_sparsify_params(params, rule)
    dense = lambda p: jax.tree.map(
        lambda leaf: leaf.dequantize() if isinstance(leaf, NMSparse) else leaf,
        p,
        is_leaf=lambda leaf: isinstance(leaf, NMSparse),
    )
    err = lambda p: float(jnp.mean((_mlp(dense(p), x) - reference) ** 2))
    assert err(sparse) < err(magnitude)


def test_a_mask_that_is_not_n_of_m_is_refused():
    w = _weight()
    with pytest.raises(ValueError, match="keeps other than n=2"):
        nm_sparsify(w, 2, 4, axis=1, mask=jnp.ones(w.shape, bool))
    with pytest.raises(ValueError, match="mask shape"):
        nm_sparsify(w, 2, 4, axis=1, mask=jnp.ones((2, 2), bool))
    masks = {"dense/kernel": jnp.ones((8, 4), bool)}
    with pytest.raises(ValueError, match="dense/kernel"):
        nm_sparsify_params({"dense": {"kernel": jnp.ones((8, 4))}}, SparseRule(), masks)


def test_sequential_passes_calibrate_later_weights_on_pruned_earlier_ones():
    keys = jax.random.split(jax.random.key(4), 2)
    params = {
        "up": {"kernel": jax.random.normal(keys[0], (K, 16)) / 4},
        "down": {"kernel": jax.random.normal(keys[1], (16, 8)) / 4},
    }
    x = jnp.asarray(_correlated_inputs(n=128, seed=5))
    one, masks_one, _ = sparsegpt_params(_mlp, params, [x], SparseRule())
    two, masks_two, _ = sparsegpt_params(_mlp, params, [x], SparseRule(), passes=2)
    # "up" is read first: the same in both; "down" sees pruned "up" outputs in the second.
    np.testing.assert_array_equal(one["up"]["kernel"], two["up"]["kernel"])
    reference = _mlp(params, x)
    err = lambda p: float(jnp.mean((_mlp(p, x) - reference) ** 2))
    assert err(two) < err(one)
    with pytest.raises(ValueError, match="passes=0"):
        sparsegpt_params(_mlp, params, [x], SparseRule(), passes=0)
