"""AWQ's clipping search against a NumPy brute force over the same ratios."""

import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.algorithms._clip import clip_search
from lowbit.qarray import PerGroup, PerTensor, QuantConfig


def _rtn_int4(w: np.ndarray, group: int) -> np.ndarray:
    """Symmetric int4 round-to-nearest per group along axis 0 (NumPy reference)."""
    k, n = w.shape
    blocks = w.reshape(k // group, group, n)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / 7
    scale = np.where(scale > 0, scale, 1.0)
    return (np.clip(np.round(blocks / scale), -7, 7) * scale).reshape(k, n)


def test_clip_search_matches_brute_force_and_never_raises_the_error():
    rng = np.random.default_rng(0)
    k, n, group = 32, 5, 8
    w = rng.standard_t(3, size=(k, n)).astype(np.float32)  # heavy tails: clipping pays
    x = rng.normal(size=(200, k)).astype(np.float32) * np.linspace(0.2, 3, k, dtype=np.float32)
    h = x.T @ x
    ratios = (1.0, 0.9, 0.8, 0.7)
    config = QuantConfig(format="int4", granularity=PerGroup(group, axis=0))
    clipped, mean_ratio = clip_search(jnp.asarray(w), 0, config, jnp.asarray(h), ratios)

    expected = np.empty_like(w)
    chosen = []
    for g in range(k // group):
        rows = slice(g * group, (g + 1) * group)
        hb = h[rows, rows]
        for j in range(n):
            col = w[rows, j]
            errs = []
            for r in ratios:
                c = np.clip(col, -r * np.abs(col).max(), r * np.abs(col).max())
                d = col - _rtn_int4(c[:, None], group)[:, 0]
                errs.append(d @ hb @ d)
            best = int(np.argmin(errs))
            chosen.append(ratios[best])
            bound = ratios[best] * np.abs(col).max()  # symmetric grid: both sides
            expected[rows, j] = np.clip(col, -bound, bound)
    np.testing.assert_allclose(np.asarray(clipped), expected, rtol=1e-6)
    assert mean_ratio == pytest.approx(np.mean(chosen)) and mean_ratio < 1.0
    out_err = lambda v: np.sum((x @ (w - _rtn_int4(v, group))) ** 2)
    assert out_err(np.asarray(clipped)) < out_err(w)


def test_clip_search_on_the_other_input_axis_and_unsupported_blocks():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 16)).astype(np.float32)  # [out, in]: input axis 1
    h = jnp.eye(16)
    config = QuantConfig(format="int4", granularity=PerGroup(8, axis=1))
    clipped, _ = clip_search(jnp.asarray(w), 1, config, h, (1.0,))
    np.testing.assert_array_equal(np.asarray(clipped), w)
    per_tensor = QuantConfig(format="int4", granularity=PerTensor())
    assert "one scale per output column" in clip_search(jnp.asarray(w), 1, per_tensor, h)
