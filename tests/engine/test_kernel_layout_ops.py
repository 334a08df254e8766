"""The engine's layout ops on a weight with a stored kernel layout never reuse it stale."""

import jax
import numpy as np
import pytest

from lowbit import kernels
from lowbit.engine import interpret
from lowbit.ops import attach_kernel_layout
from lowbit.qarray import PerChannel, QuantConfig, quantize

pytestmark = pytest.mark.skipif(
    not kernels.available() or jax.default_backend() != "cpu",
    reason="CPU kernels unavailable: " + kernels.status(),
)

K, N = 256, 264


def _weight():
    w = jax.random.normal(jax.random.key(1), (K, N))
    return quantize(w, QuantConfig(format="int8", granularity=PerChannel((1,))))


def test_sliced_or_reshaped_weights_do_not_use_a_stale_layout():
    # Inside a model, slicing or reshaping a weight builds a new QArray (no stored layout):
    # the result is that of the sliced weight, not of the full one.
    stored = attach_kernel_layout(_weight())
    assert stored.kernel is not None
    x = jax.random.normal(jax.random.key(5), (2, 128))

    def sliced(x, w):
        return x @ w[:128]

    got = interpret(sliced)(x, stored)
    want = np.asarray(x) @ np.asarray(stored.dequantize())[:128]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

    def reshaped(x, w):
        return x[:, None, :] @ w.reshape(2, 128, N)

    got = interpret(reshaped)(x, stored)
    want = np.asarray(x)[:, None, :] @ np.asarray(stored.dequantize()).reshape(2, 128, N)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
