"""GGUF Q4_K / Q6_K weights on the CPU kernels (uint4 g32 / int8 g16 views), M = 1 and large M."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit import kernels
from lowbit.ops import PreparedQArray, prepare_weight
from lowbit.qarray import quantize


@pytest.mark.skipif(not kernels.available(), reason=kernels.status())
@pytest.mark.parametrize(("fmt", "path"), [("q4_k", "uint4"), ("q6_k", "int8")])
def test_gguf_blocks_run_the_cpu_kernels(fmt, path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    w[:, 3] = -0.5  # a constant column: Q4_K sub-blocks with scale 0 hold only the minimum
    q = quantize(jnp.asarray(w), fmt)
    # Superblocks are not recovered from a kernel layout yet: they stay logical (laid out per call).
    assert not isinstance(prepare_weight(q, 0), PreparedQArray)
    dense = np.asarray(q.dequantize())
    forward = jax.jit(lowbit.run(lambda p, x: x @ p))
    for m in (1, 64):
        x = jnp.asarray(rng.standard_normal((m, 512)).astype(np.float32))
        report = lowbit.trace_report(lambda p, x: x @ p, q, x)
        assert report.quantized_ops == {f"dot_general:cpu_kernel_{path}": 1}
        y, ref = np.asarray(forward(q, x)), np.asarray(x) @ dense
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
