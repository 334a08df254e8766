"""Finite inputs near float32's maximum: every format decodes them to finite values, and the
GGUF block formats, whose float16 scales cannot reach them, refuse concrete ones by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.gguf import block_type, encode
from lowbit.qarray import quantize

BIG = float(np.finfo(np.float32).max)
GGUF_FORMATS = ("iq4_nl", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "tq1_0", "tq2_0")


def _extremes(v: float) -> np.ndarray:
    """[256, 2]: ±v, halves, zeros: every 32-block holds the extremes."""
    col = np.tile(np.array([v, -v, v / 2, 0.0, -v / 3, v], np.float32), 43)[:256]
    return np.stack([col, col[::-1]], axis=1)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_gguf_block_formats_refuse_concrete_values_past_their_range(fmt):
    with pytest.raises(ValueError, match=f"format '{fmt}' stores values up to ±65504"):
        quantize(jnp.asarray(_extremes(1e38)), fmt)


@pytest.mark.parametrize("fmt", ["q5_0", "tq2_0"])  # the K-quants compile for ~15 s each
def test_gguf_block_formats_saturate_traced_values_to_finite(fmt):
    decoded = jax.jit(lambda x: quantize(x, fmt).dequantize())(jnp.asarray(_extremes(BIG)))
    assert bool(jnp.isfinite(decoded).all())
    assert float(jnp.abs(decoded).max()) <= 1.1 * block_type(fmt.upper()).max_abs


def test_q8_k_keeps_1e38_and_refuses_the_top_of_float32():
    x = _extremes(1e38)[:, 0][None]
    assert encode("Q8_K", x).shape == (1, 292)
    with pytest.raises(ValueError, match="format 'q8_k'"):
        encode("Q8_K", _extremes(BIG)[:, 0][None])


def _asymmetric_reference(x: np.ndarray, bits: int) -> np.ndarray:
    """Per-tensor min/max asymmetric quantization in float64, where nothing overflows."""
    x64 = x.astype(np.float64)
    lo, hi = min(x64.min(), 0.0), max(x64.max(), 0.0)
    steps = 2**bits - 1
    scale = (hi - lo) / steps
    zero = -lo / scale
    codes = np.clip(np.round(x64 / scale + zero), 0, steps)
    return (codes - zero) * scale, scale


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize("v", [1e38, BIG])
def test_unsigned_formats_with_zero_points_decode_near_float32_max(bits, v, traced):
    # Traced as `quantize_params` traces it: compiled, XLA divides by the broadcast scale as a
    # product with its reciprocal (below float32's normal range for these scales).
    x = np.array([v, -v, v / 2, 0.0, -v / 4, v / 8, -v, v], np.float32)
    fn = jax.jit(quantize, static_argnums=1) if traced else quantize
    q = fn(jnp.asarray(x), f"uint{bits}")
    assert q.zero_point is not None
    decoded = np.asarray(q.dequantize(), np.float64)
    assert np.isfinite(decoded).all()
    expected, step = _asymmetric_reference(x, bits)
    if bits == 1 and v == BIG:
        return  # a one-step grid cannot span [-max, max]: its scale saturates (still finite)
    assert np.abs(decoded - expected).max() <= step * 1.001
    assert decoded[0] > 0 and decoded[1] < 0  # 1e38 never decodes as a negative


@pytest.mark.parametrize("fmt", ["int8", "int6", "fp8_e4m3fn"])
def test_symmetric_formats_stay_finite_at_float32_max(fmt):
    x = jnp.asarray(np.array([BIG, -BIG, 1.0, 0.0] * 8, np.float32))
    decoded = np.asarray(quantize(x, fmt).dequantize())
    assert np.isfinite(decoded).all()
    np.testing.assert_allclose(decoded[:2], [BIG, -BIG], rtol=1e-4)
