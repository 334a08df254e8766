"""A weight with an online Hadamard input: the engine rotates the activation and runs the inner
weight's product, equal to the float layer; layout ops that change the shape fall back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.ops import HadamardInput, rotate_weight_input
from lowbit.qarray import PerGroup, quantize

RNG = np.random.default_rng(0)
W = jnp.asarray(RNG.normal(size=(96, 32)), jnp.float32)  # K = 96 = 12 * 8
X = jnp.asarray(RNG.normal(size=(3, 96)), jnp.float32)


def test_dequantize_is_the_logical_weight():
    value = HadamardInput(rotate_weight_input(W))
    np.testing.assert_allclose(np.asarray(value.dequantize()), np.asarray(W), atol=1e-5)


def test_engine_rotates_the_input_of_a_float_inner_weight():
    report = lowbit.EngineReport()
    fn = lowbit.run(lambda w, x: x @ w, strict=True, report=report)
    got = jax.jit(fn)(HadamardInput(rotate_weight_input(W)), X)
    np.testing.assert_allclose(np.asarray(got), np.asarray(X @ W), atol=1e-4)
    assert report.quantized_ops == {"dot_general:hadamard+float": 1}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_inner_weight_matches_its_reference(fmt):
    q = quantize(rotate_weight_input(W), fmt, granularity=PerGroup(32))
    fn = lowbit.run(lambda w, x: x @ w, strict=True)
    got = fn(HadamardInput(q), X)
    reference = X @ HadamardInput(q).dequantize()
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), rtol=2e-2, atol=2e-2)


def test_a_product_over_another_axis_is_refused_to_a_fallback():
    fn = lowbit.run(lambda w, y: w @ y, strict=True)
    with pytest.raises(lowbit.EngineFallbackError, match="rotated input axis"):
        fn(HadamardInput(rotate_weight_input(W)), jnp.ones((32, 4)))
