"""N:M sparsity: masks against a NumPy reference, compressed storage, the engine runs it dense."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.qarray import PerChannel, nm_mask, nm_sparsify, quantize


def np_mask(x, n, m, axis):
    moved = np.moveaxis(np.abs(x), axis, -1)
    groups = moved.reshape(*moved.shape[:-1], -1, m)
    keep = np.zeros(groups.shape, bool)
    np.put_along_axis(keep, np.argsort(-groups, axis=-1, kind="stable")[..., :n], True, axis=-1)
    return np.moveaxis(keep.reshape(moved.shape), -1, axis)


@pytest.mark.parametrize("n, m, axis", [(2, 4, 0), (1, 4, 1), (2, 8, 0), (3, 4, -1)])
def test_mask_and_round_trip(n, m, axis):
    x = np.random.default_rng(0).normal(size=(16, 24)).astype(np.float32)
    x[0, :4] = 1.0  # ties keep the lower index
    mask = nm_mask(jnp.asarray(x), n, m, axis)
    np.testing.assert_array_equal(mask, np_mask(x, n, m, axis))
    sparse = nm_sparsify(jnp.asarray(x), n, m, axis)
    np.testing.assert_array_equal(sparse.mask(), mask)
    np.testing.assert_array_equal(sparse.dequantize(), np.where(mask, x, 0))
    assert sparse.values.shape[axis % 2] == x.shape[axis % 2] * n // m


def test_sparse_int8_storage_is_below_six_tenths_of_dense_int8():
    w = jax.random.normal(jax.random.key(0), (384, 96))
    int8 = lambda v: quantize(v, "int8", granularity=PerChannel((-1,)))
    sparse = nm_sparsify(w, 2, 4, 0, quantize_values=int8)
    assert sparse.nbytes <= 0.6 * int8(w).nbytes
    kept = np.where(nm_mask(w, 2, 4, 0), w, 0)
    err = np.abs(sparse.dequantize() - kept).max()
    assert err <= np.abs(kept).max() / 127 / 2 + 1e-6


def test_the_engine_runs_it_dense_and_counts_it():
    w = jax.random.normal(jax.random.key(0), (32, 8))
    params = {"w": nm_sparsify(w, 2, 4, 0)}
    report = lowbit.EngineReport()
    x = jnp.ones((2, 32))
    y = lowbit.run(lambda p, x: x @ p["w"], report=report)(params, x)
    np.testing.assert_allclose(y, x @ params["w"].dequantize(), rtol=1e-5)
    assert report.fallbacks == {"dot_general": 1}
    with pytest.raises(lowbit.EngineFallbackError, match="N:M sparse"):
        lowbit.run(lambda p, x: x @ p["w"], strict=True)(params, x)


@pytest.mark.parametrize(
    "shape, kwargs, fragment",
    [
        ((30, 4), dict(n=2, m=4, axis=0), "m=4 does not divide axis 0 of shape (30, 4)"),
        ((8, 4), dict(n=4, m=4, axis=0), "n=4 must be below m=4"),
        ((8, 4), dict(n=2, m=4, axis=2), "axis=2 is out of range"),
    ],
)
def test_bad_patterns(shape, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        nm_sparsify(jnp.ones(shape), **kwargs)


def test_checkpoints_store_the_compressed_form(tmp_path):
    from lowbit.io import load_checkpoint, save_checkpoint
    from lowbit.qarray import NMSparse

    w = jax.random.normal(jax.random.key(0), (64, 16))
    int8 = lambda v: quantize(v, "int8", granularity=PerChannel((-1,)))
    params = {"dense": {"kernel": nm_sparsify(w, 2, 4, 0, quantize_values=int8)}}
    save_checkpoint(tmp_path / "ckpt", params)
    restored = load_checkpoint(tmp_path / "ckpt", like={"dense": {"kernel": w}})["dense"]["kernel"]
    assert isinstance(restored, NMSparse) and restored.nbytes == params["dense"]["kernel"].nbytes
    np.testing.assert_array_equal(restored.dequantize(), params["dense"]["kernel"].dequantize())
