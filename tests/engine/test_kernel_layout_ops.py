"""The engine on prepared weights: other layout ops see the logical weight, never a stale layout;
the contraction axis of each weight comes from the traced use."""

import jax
import numpy as np
import pytest

from lowbit import kernels
from lowbit.engine import EngineReport, interpret, kernel_axes
from lowbit.ops import PreparedQArray, prepare_weight, prepare_weights
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
    stored = prepare_weight(_weight(), 0)
    assert isinstance(stored, PreparedQArray)
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


def test_kernel_axes_follow_transposes_and_tied_embeddings():
    w = _weight()
    table = quantize(
        jax.random.normal(jax.random.key(2), (N, K)),
        QuantConfig(format="int8", granularity=PerChannel((0,))),
    )

    def model(p, ids):
        h = jax.numpy.take(p["table"], ids, axis=0)  # [B, K]
        h = jax.jit(lambda h, w: h @ w)(h, p["w"])  # [B, N]
        return h @ p["w"].T @ p["table"].T  # tied output projection

    params = {"w": w, "table": table}
    ids = jax.numpy.arange(3)
    axes = kernel_axes(model, params, ids)
    key = lambda name: (
        (jax.tree_util.SequenceKey(0), jax.tree_util.SequenceKey(0))
        + (jax.tree_util.DictKey(name),)
    )
    # `w` is contracted over axis 0 and (transposed) over axis 1: two layouts, left out.
    assert axes == {key("table"): 1}
    prepared = prepare_weights(params, {(jax.tree_util.DictKey("table"),): 1})
    assert isinstance(prepared["table"], PreparedQArray)
    report = EngineReport()
    got = jax.jit(interpret(model, report=report))(prepared, ids)
    want = interpret(model)(params, ids)
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    # The lookup read rows from the kernel layout: no full conversion back to codes.
    assert not any("from_kernel_layout" in k for k in report.layout_ops)
    # `w` (logical, used along both axes) is laid out by the kernel on each call where a
    # kernel runs it (`h @ w`; `w.T` scales along its contraction, a pure-JAX path): counted.
    assert report.fallbacks == {"dot_general": 1}, report.fallback_details
    assert "['w'] is a logical QArray" in report.fallback_details[0]
    # ... and the transpose feeding the output projection kept the layout (a conversion to
    # codes and back on every call made decoding ~3x slower once). Read in the program
    # lowered for CPU: the other platforms' branches recover logical weights by design.
    program = jax.jit(interpret(model)).lower(prepared, ids).as_text()
    # (the row lookup converts only the panels it reads, inside `prepared_columns`)
    assert program.count("call @prepared_to_logical") == program.count("call @prepared_columns")
