"""Calibration statistics through the engine's probe, against NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.algorithms import CalibrationError, capture

D, V, H, HD, L = 8, 12, 2, 4, 3


def _params():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "embed": jax.random.normal(k[0], (V, D)),
        "stack": jax.random.normal(k[1], (L, D, D)) / 3,
        "heads": jax.random.normal(k[2], (H, HD, D)),  # einsum weight, contracted over (H, HD)
        "proj": jax.random.normal(k[3], (H * HD, D)),  # stored [in, out] but used transposed
    }


def _model(p, ids):
    x = jnp.take(p["embed"], ids, axis=0)  # [b, s, D]

    def layer(h, w):
        return jnp.tanh(h @ w), h

    x, inputs = jax.lax.scan(layer, x, p["stack"])
    y = (x @ p["proj"].T).reshape(*x.shape[:-1], H, HD)  # [b, s, H, HD]
    z = jnp.einsum("bshd,hde->bse", y, p["heads"])
    return z @ p["embed"].T, (inputs, x, y, z)  # tied logits


def _reference(p, ids):
    _, (inputs, x, y, z) = _model(p, ids)
    flat = lambda a: np.asarray(a, np.float64).reshape(-1, a.shape[-1])
    ref = {("stack", ((0, i),)): flat(inputs[i]) for i in range(L)}
    ref[("proj", ())] = flat(x)
    ref[("heads", ())] = np.asarray(y, np.float64).reshape(-1, H * HD)
    ref[("embed", ())] = flat(z)
    return ref


def test_statistics_match_numpy_for_scan_einsum_transposed_and_tied_weights():
    p = _params()
    batches = [jnp.array([[1, 2, 3, 4]]), jnp.array([[5, 6, 7, 0]])]
    stats = capture(lambda p, ids: _model(p, ids)[0], p, batches, sample_rows=3)
    refs = [_reference(p, b) for b in batches]
    assert set(stats.weights) == set(refs[0])
    for key, s in stats.weights.items():
        rows = np.concatenate([r[key] for r in refs])
        np.testing.assert_allclose(s.gram, rows.T @ rows, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(s.abs_max, np.abs(rows).max(0), rtol=1e-5)
        np.testing.assert_allclose(s.abs_mean, np.abs(rows).mean(0), rtol=1e-4)
        assert s.count == len(rows) and s.sample.shape == (3, rows.shape[1])
    assert stats.weights[("heads", ())].input_axes == (0, 1)
    assert stats.weights[("proj", ())].input_axes == (1,)
    assert stats.weights[("stack", ((0, 2),))].input_axes == (1,)
    assert stats.weights[("embed", ())].input_axes == (1,)


def test_nan_inputs_name_the_layer():
    p = _params()
    p["stack"] = p["stack"].at[1, 0, 0].set(jnp.nan)
    with pytest.raises(CalibrationError, match=r"stack\[2\].*NaN or Inf"):
        capture(lambda p, ids: _model(p, ids)[0], p, [jnp.array([[1, 2]])])


def test_no_batches_is_an_error():
    with pytest.raises(CalibrationError, match="empty"):
        capture(lambda p, ids: _model(p, ids)[0], _params(), [])


def test_row_mask_keeps_padded_positions_out():
    # An encoder batch [b, s] with padding: padded positions carry huge activations that must
    # not reach the Gram matrix, the sums, the max, the row count or the sample.
    k = jax.random.split(jax.random.key(3), 3)
    params = {"w": jax.random.normal(k[0], (D, 4)), "v": jax.random.normal(k[1], (4, 3))}
    x = np.array(jax.random.normal(k[2], (2, 5, D)))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    x[mask == 0] = 1e3
    x[0, 4] = np.nan  # a padded position's NaN does not count either

    def fn(p, x, mask):
        return jnp.tanh(x @ p["w"]) @ p["v"]

    stats = capture(fn, params, [(x, mask)], sample_rows=16, row_mask=lambda x, mask: mask)
    real = np.asarray(x, np.float64)[mask == 1]  # [8, D]
    (w,) = stats.for_path("w")
    np.testing.assert_allclose(np.asarray(w.gram), real.T @ real, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(w.abs_max), np.abs(real).max(0), rtol=1e-6)
    assert w.count == 8 and w.sample.shape == (8, D)
    np.testing.assert_allclose(np.sort(w.sample[:, 0]), np.sort(real[:, 0]), rtol=1e-6)
    (v,) = stats.for_path("v")
    assert v.count == 8  # the next layer's input is masked the same way
    # Without the mask every position counts (and the NaN is an error).
    x[0, 4] = 1e3
    plain = capture(fn, params, [(x, mask)])
    assert plain.for_path("w")[0].count == 10
    assert float(plain.for_path("w")[0].abs_max.max()) == 1e3
    x[0, 4] = np.nan
    with pytest.raises(CalibrationError, match="NaN or Inf"):
        capture(fn, params, [(x, mask)])
