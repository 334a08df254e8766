"""HQQ: the lp objective never increases and ends below round-to-nearest's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.algorithms import hqq_qarray
from lowbit.qarray import MinMax, PerGroup, QuantConfig
from lowbit.qarray import quantize as quantize_array
from lowbit.recipes import HQQ

CONFIG = QuantConfig(
    format="uint4", granularity=PerGroup(16, axis=0), symmetric=False, calibration=MinMax()
)


def _lp(w, v, p):
    return float(np.sum(np.abs(np.asarray(w) - np.asarray(v)) ** p))


def test_objective_non_increasing_and_below_rtn():
    w = jax.random.normal(jax.random.key(0), (64, 24)) ** 3  # heavy tails
    q, history = hqq_qarray(w, CONFIG, HQQ(iters=30))
    h = np.asarray(history)
    assert np.all(np.diff(h) <= 1e-6 * h[0])
    assert h[-1] < h[0]
    rtn = quantize_array(w, CONFIG)
    # The returned QArray realizes the objective (independent NumPy evaluation).
    assert _lp(w, q.dequantize(), 0.7) == pytest.approx(float(h[-1]), rel=1e-3)
    assert _lp(w, q.dequantize(), 0.7) < _lp(w, rtn.dequantize(), 0.7)
    assert q.codes.shape == rtn.codes.shape and q.scale.shape == rtn.scale.shape


def test_symmetric_format_is_refused():
    with pytest.raises(ValueError, match="zero point"):
        hqq_qarray(jnp.ones((16, 4)), QuantConfig(format="int4"), HQQ())
