"""GGUF block weights on their own type's CPU kernel: prepared once (block rows, the types
with tiles as tiles of 8 rows), exact back to the logical QArray, rows gathered from the
layout, decode and prefill sizes, both arithmetics, and a per-call layout counted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit import kernels
from lowbit.ops import PreparedQArray, prepare_weight, with_int8_activations
from lowbit.qarray import quantize

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.status())

# The GGUF kinds imported as GGUF block formats (Q4_0 / Q4_1 / Q8_0 import as int4 / uint4 /
# int8 QArrays, which run on those kernels).
FORMATS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "iq4_nl", "iq4_xs")


def _weight(fmt: str, axis: int):
    """A GGUF QArray of shape [K, N] (axis 0, blocks along K) or [N, K] (axis 1)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    w[:, 3] = -0.5  # a constant column: K-quant sub-blocks holding only their minimum
    return quantize(
        jnp.asarray(w if axis == 0 else w.T), fmt, granularity=lowbit.PerGroup(32, axis)
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("axis", [0, 1])
def test_gguf_weights_run_their_own_kernel(fmt, axis):
    q = _weight(fmt, axis)
    fn = (lambda p, x: x @ p) if axis == 0 else (lambda p, x: x @ p.T)
    prepared = prepare_weight(q, axis)
    assert isinstance(prepared, PreparedQArray) and prepared.route.kind == fmt
    # the block rows, nothing beside them (types with tiles: as tiles of 8 rows)
    tiled = fmt in ("q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
    assert kernels.is_tiled(prepared.weight.data, 256) == tiled
    spelled_out = {
        "q3_k": 912 / 880,
        "q4_k": 1184 / 1152,
        "q5_k": 1440 / 1408,
    }  # tiles with their scales as bytes
    assert prepared.resident_nbytes == q.codes.size * spelled_out.get(fmt, 1)
    back = prepared.logical()
    assert np.asarray(back.codes).tobytes() == np.asarray(q.codes).tobytes()
    # Given up by its caller (a loader's own QArray), a weight whose tiles are its rows' size
    # is laid out over its codes; the layout is the same bytes either way.
    given = jax.tree.map(jnp.copy, q)
    donated = prepare_weight(given, axis, donate=True)
    assert np.asarray(donated.weight.data).tobytes() == np.asarray(prepared.weight.data).tobytes()
    assert given.codes.is_deleted() == (fmt.upper() in kernels.TILES_OVER_ROWS)
    dense = np.asarray(q.dequantize())
    dense = dense if axis == 0 else dense.T
    forward = jax.jit(lowbit.run(fn, strict=True))
    rng = np.random.default_rng(1)
    # decode rows and a batch; a prefill (the float GEMM path) for the most common type only
    for m in (1, 4, 300) if fmt == "q4_k" else (1, 4):
        x = jnp.asarray(rng.standard_normal((m, 512)).astype(np.float32))
        report = lowbit.trace_report(fn, prepared, x)
        assert report.quantized_ops == {f"dot_general:cpu_kernel_{fmt}": 1}
        assert report.fallbacks == {}
        y, ref = np.asarray(forward(prepared, x)), np.asarray(x) @ dense
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    int8 = with_int8_activations(prepared)
    for m in (1, 2, 9):  # the tile kernels' one-row and several-row loops
        x = jnp.asarray(rng.standard_normal((m, 512)).astype(np.float32))
        report = lowbit.trace_report(fn, int8, x)
        assert report.quantized_ops == {f"dot_general:cpu_kernel_{fmt}+int8_act": 1}
        y, ref = np.asarray(forward(int8, x)), np.asarray(x) @ dense
        assert np.abs(y - ref).max() < 3e-2 * np.abs(ref).max()


def test_rows_are_gathered_from_the_block_rows():
    q = _weight("q6_k", 1)  # [N, K]: an embedding tied to the output projection
    prepared = prepare_weight(q, 1)
    ids = jnp.asarray([3, 0, 255])
    rows = prepared.rows(ids)
    np.testing.assert_array_equal(
        np.asarray(rows.dequantize()), np.asarray(q.dequantize())[[3, 0, 255]]
    )


def test_a_logical_kn_weight_is_a_counted_per_call_layout():
    q = _weight("q4_k", 0)  # [K, N] logical: its rows are a transposed copy made every call
    x = jnp.ones((1, 512))
    report = lowbit.trace_report(lambda p, x: x @ p, q, x)
    assert sum(report.fallbacks.values()) == 1
    with pytest.raises(lowbit.EngineFallbackError):
        jax.jit(lowbit.run(lambda p, x: x @ p, strict=True))(q, x)
    # Stored [N, K] and contracted over K, the codes are the kernel's rows: nothing to lay out.
    nk = lambda p, x: jax.lax.dot_general(x, p, (((1,), (1,)), ((), ())))  # noqa: E731
    report = lowbit.trace_report(nk, _weight("q4_k", 1), x)
    assert report.fallbacks == {}
