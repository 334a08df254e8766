"""Inputs `quantize` must refuse or handle exactly: unsigned formats, int1 zero blocks, empty and
all-NaN arrays, and out-of-range granularity / calibration parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import qarray
from lowbit.qarray import (
    MSE,
    RMS,
    AbsMax,
    Fixed,
    PerBlock,
    Percentile,
    PerChannel,
    PerGroup,
    QuantConfig,
    broadcast_blocks,
    parse_calibration,
    quantize,
)

# A normal 4 x 64 tensor: about half its values are negative.
X = jax.random.normal(jax.random.key(0), (4, 64))
UINT_NAMES = ["uint1", "uint2", "uint4", "uint8"]


@pytest.mark.parametrize("name", UINT_NAMES)
def test_unsigned_formats_default_to_asymmetric_and_keep_negatives(name):
    config = QuantConfig(format=name, granularity=PerGroup(32, axis=1))
    assert config.symmetric is False
    q = quantize(X, config)
    assert q.zero_point is not None
    # Min/max bounds per group: every element, negative ones included, is within half a step
    # (before the fix, symmetric scales sent all 118 negatives to 0.0).
    scale = np.asarray(broadcast_blocks(q.scale_values(), X.shape))
    error = np.abs(np.asarray(q.dequantize()) - np.asarray(X))
    assert np.all(error <= scale / 2 * (1 + 1e-5) + 1e-7)


def test_signed_formats_keep_the_symmetric_default():
    for name in ("int8", "int4", "int1", "nf4", "fp8_e4m3fn", "mxfp4"):
        assert QuantConfig(format=name).symmetric is True


def test_explicit_symmetric_unsigned_refuses_negative_data():
    with pytest.raises(ValueError, match=r"'uint4' is unsigned.*symmetric=False"):
        quantize(X, "uint4", symmetric=True)
    with pytest.raises(ValueError, match="Fixed calibration's lo=-1.0 is negative"):
        QuantConfig(format="uint8", symmetric=True, calibration=Fixed(-1.0, 1.0))


def test_explicit_symmetric_unsigned_on_non_negative_data():
    relu = jnp.maximum(X, 0.0)
    q = quantize(relu, "uint8", symmetric=True, granularity=PerChannel((0,)))
    assert q.zero_point is None
    step = np.asarray(q.scale_values()).max()
    np.testing.assert_allclose(q.dequantize(), relu, atol=step / 2 + 1e-6)
    QuantConfig(format="uint8", symmetric=True, calibration=Fixed(0.0, 6.0))  # accepted


def test_int1_zero_group_decodes_to_zeros():
    x = X.at[:, :32].set(0.0)
    for config in (
        dict(granularity=PerGroup(32, axis=1)),
        dict(granularity=PerGroup(32, axis=1), symmetric=False),
        dict(granularity=PerChannel((0,))),
    ):
        q = quantize(x, "int1", **config)
        out = np.asarray(q.dequantize())
        assert np.all(np.isfinite(out))
        if "granularity" in config and isinstance(config["granularity"], PerGroup):
            np.testing.assert_array_equal(out[:, :32], 0.0)
            assert np.all(np.abs(out[:, 32:]) > 0)  # the other groups keep their ±scale
    np.testing.assert_array_equal(quantize(jnp.zeros((2, 8)), "int1").dequantize(), 0.0)
    jitted = jax.jit(lambda v: quantize(v, "int1", granularity=PerGroup(32, axis=1)).dequantize())
    np.testing.assert_array_equal(np.asarray(jitted(x))[:, :32], 0.0)


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0)])
def test_empty_array_is_a_clear_error(shape):
    with pytest.raises(ValueError, match=r"empty array of shape .*keep empty arrays in float"):
        quantize(jnp.zeros(shape), "int8")
    with pytest.raises(ValueError, match="empty array"):
        jax.jit(lambda v: quantize(v, "int4"))(jnp.zeros(shape))


@pytest.mark.parametrize("fill", [np.nan, np.inf])
def test_no_finite_value_is_refused(fill):
    x = jnp.full((4, 8), fill)
    with pytest.raises(ValueError, match="no finite value"):
        quantize(x, "int8")
    with pytest.raises(ValueError, match="no finite value"):
        qarray.check_values(x, QuantConfig(format="nf4"))


def test_nan_in_one_block_still_quantizes_the_others():
    # Partial NaN keeps the documented rule (NaN encodes to zero, other blocks untouched).
    x = X.at[0, :32].set(jnp.nan)
    q = quantize(x, "int8", granularity=PerGroup(32, axis=1))
    ref = quantize(X, "int8", granularity=PerGroup(32, axis=1))
    np.testing.assert_array_equal(np.asarray(q.dequantize())[1:], np.asarray(ref.dequantize())[1:])


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: PerGroup(0), "PerGroup.size=0"),
        (lambda: PerGroup(-32), "PerGroup.size=-32"),
        (lambda: PerGroup(32.0), "PerGroup.size=32.0"),
        (lambda: PerBlock((0, 32)), r"PerBlock.block=\(0, 32\)"),
        (lambda: PerBlock((-1, 4)), r"PerBlock.block=\(-1, 4\)"),
        (lambda: PerBlock(()), r"PerBlock.block=\(\)"),
        (lambda: PerChannel(axes=()), "PerChannel.axes"),
        (lambda: Percentile(150), "Percentile.q=150"),
        (lambda: Percentile(-1), "Percentile.q=-1"),
        (lambda: AbsMax(0.0), "AbsMax.clip=0.0"),
        (lambda: RMS(float("nan")), "RMS.multiplier=nan"),
        (lambda: Fixed(float("-inf"), 1.0), "finite numbers lo < hi"),
        (lambda: MSE(grid=()), "MSE.grid"),
        (lambda: parse_calibration("percentile,150"), r"'percentile,150': Percentile.q=150"),
        (lambda: parse_calibration("absmax,-1"), "AbsMax.clip=-1"),
    ],
)
def test_out_of_range_parameters_fail_at_construction(make, fragment):
    with pytest.raises(ValueError, match=fragment):
        make()
