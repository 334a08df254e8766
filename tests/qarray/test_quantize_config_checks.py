"""Configs and inputs a new user gets wrong: a string granularity, a contradicting MX group
size, a 0-d array (issue: untrusted input, fuzzed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from lowbit.qarray import PerGroup, QuantConfig, quantize


def test_granularity_must_be_a_granularity_object():
    with pytest.raises(
        TypeError, match=r"QuantConfig.granularity='per_tensor' is a str.*PerTensor\(\)"
    ):
        QuantConfig(granularity="per_tensor")


@pytest.mark.parametrize("value", [3, None, ["int4"]])
def test_format_that_is_not_a_name_is_a_type_error_listing_the_names(value):
    with pytest.raises(
        TypeError,
        match=r"format must be a format name \(str\) or a Format, got "
        rf"{type(value).__name__}: .*; accepted names: .*int4, .*nf4",
    ):
        QuantConfig(format=value)


def test_calibration_must_be_a_calibration_object():
    with pytest.raises(TypeError, match=r"QuantConfig.calibration='absmax' is a str"):
        QuantConfig(calibration="absmax")


def test_mx_group_size_contradiction_names_the_parameter_and_the_rule():
    with pytest.raises(
        ValueError,
        match=r"granularity=PerGroup\(64\) contradicts format 'mxfp4': MX formats share one "
        r"E8M0 scale per 32 elements .*fixed at 32",
    ):
        QuantConfig(format="mxfp4", granularity=PerGroup(64))
    assert QuantConfig(format="mxfp4", granularity=PerGroup(32, axis=1)).granularity.axis == 1


@pytest.mark.parametrize("fmt", ["int8", "uint4", "int1"])
def test_a_0d_array_quantizes_to_a_0d_qarray(fmt):
    q = quantize(jnp.float32(-2.5), fmt)
    assert q.shape == () and q.codes.shape == () and q.scale.shape == ()
    assert q.dequantize().shape == ()
    assert float(q.dequantize()) == pytest.approx(-2.5, rel=0.3)
    traced = jax.jit(lambda x: quantize(x, fmt).dequantize())(jnp.float32(1.5))
    assert traced.shape == ()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "q4_k"])
def test_a_0d_array_under_a_block_format_is_refused_by_name(fmt):
    with pytest.raises(ValueError, match=f"0-d array .*format '{fmt}' stores blocks"):
        quantize(jnp.float32(1.0), fmt)
