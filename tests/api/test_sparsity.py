"""Sparse-aware training with mask refreshes, and compressed sparse params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowbit.api import SparseRule, apply_masks, nm_masks, nm_sparsify_params
from lowbit.qarray import NMSparse, PerChannel, QArray, QuantConfig


def test_sparse_aware_training_refreshes_masks_and_matches_the_compressed_model():
    key = jax.random.key(0)
    params = {"dense": {"kernel": jax.random.normal(key, (16, 8)), "bias": jnp.zeros(8)}}
    x = jax.random.normal(jax.random.key(1), (64, 16))
    target = x @ jax.random.normal(jax.random.key(2), (16, 8))
    rule = SparseRule(update_every=5)

    def loss(p, masks):
        p = apply_masks(p, masks)
        return jnp.mean((x @ p["dense"]["kernel"] + p["dense"]["bias"] - target) ** 2)

    opt = optax.adam(0.05)
    state = opt.init(params)
    step = jax.jit(jax.value_and_grad(loss))
    masks, history, losses = None, [], []
    for i in range(20):
        if rule.refresh(i):
            masks = nm_masks(params, rule)
            history.append(np.asarray(masks["dense/kernel"]))
        value, grads = step(params, masks)
        updates, state = opt.update(grads, state)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    assert len(history) == 4 and losses[-1] < losses[0]
    assert all(m.sum() == 16 * 8 // 2 for m in history)
    assert set(nm_masks(params, rule)) == {"dense/kernel"}  # the bias stays dense

    int8 = QuantConfig(format="int8", granularity=PerChannel((-1,)))
    sparse = nm_sparsify_params(params, SparseRule(values=int8))
    kernel = sparse["dense"]["kernel"]
    assert isinstance(kernel, NMSparse) and isinstance(kernel.values, QArray)
    masked = apply_masks(params, nm_masks(params, rule))["dense"]["kernel"]
    assert np.abs(kernel.dequantize() - masked).max() <= np.abs(masked).max() / 254 + 1e-6


def test_bad_rules():
    with pytest.raises(ValueError, match="selects no parameter"):
        nm_masks({"w": jnp.ones((4, 4))}, SparseRule(path="nothing"))
    with pytest.raises(ValueError, match="m=4 does not divide"):
        nm_masks({"dense": {"kernel": jnp.ones((6, 4))}}, SparseRule())
    with pytest.raises(ValueError, match="SparseRule.update_every"):
        SparseRule(update_every=0)
    with pytest.raises(ValueError, match="n=4 must be below m=4"):
        SparseRule(n=4, m=4)
