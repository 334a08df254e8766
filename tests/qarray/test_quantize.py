"""quantize / dequantize: granularities, calibrations, rounding, guards and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.qarray import (
    MSE,
    RMS,
    AbsMax,
    AbsMean,
    Fixed,
    MinMax,
    PerBlock,
    Percentile,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QuantConfig,
    amax_history_bounds,
    amax_history_init,
    amax_history_update,
    fake_quant,
    parse_calibration,
    quantize,
)


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (64, 128), jnp.float32)


@pytest.mark.parametrize(
    "granularity, scale_shape",
    [
        (PerTensor(), (1, 1)),
        (PerChannel(), (1, 128)),
        (PerChannel(axes=(0,)), (64, 1)),
        (PerGroup(32), (2, 128)),
        (PerGroup(64, axis=1), (64, 2)),
        (PerBlock((32, 64)), (2, 2)),
        (PerToken(), (64, 1)),
    ],
)
def test_granularity_scale_shapes(x, granularity, scale_shape):
    q = quantize(x, "int8", granularity=granularity).check()
    assert q.scale.shape == scale_shape
    step = np.asarray(q.scale_values())
    err = np.abs(np.asarray(q.dequantize()) - np.asarray(x))
    blocks = np.asarray(q.block_shape)
    expanded = np.kron(step, np.ones(blocks))
    assert np.all(err <= expanded / 2 + 1e-6)


def test_asymmetric_minmax_reaches_both_ends(x):
    y = x + 3.0  # all positive: asymmetric should use the whole grid
    q = quantize(y, "uint8", symmetric=False, calibration=MinMax(), granularity=PerChannel())
    codes = np.asarray(q.unpacked_codes())
    assert codes.min() == 0 and codes.max() == 255
    assert np.max(np.abs(np.asarray(q.dequantize()) - np.asarray(y))) <= float(q.scale.max())


@pytest.mark.parametrize(
    "calibration", [AbsMax(0.9), Percentile(99.0), RMS(3.0), MSE(), Fixed(-2.0, 2.0), AbsMean()]
)
def test_calibrations_give_finite_scales(x, calibration):
    q = quantize(x, "int4", granularity=PerGroup(32), calibration=calibration)
    assert np.all(np.isfinite(np.asarray(q.scale_values())))
    assert np.all(np.isfinite(np.asarray(q.dequantize())))


def test_mse_is_no_worse_than_absmax(x):
    heavy = x.at[0, :].multiply(20.0)  # outliers in one row of each group
    err = lambda cal: float(
        jnp.sum(
            (
                quantize(heavy, "int4", granularity=PerGroup(32), calibration=cal).dequantize()
                - heavy
            )
            ** 2
        )
    )
    assert err(MSE()) <= err(AbsMax()) + 1e-6


def test_fixed_bounds_clip(x):
    q = quantize(x * 10, "int8", calibration=Fixed(-1.0, 1.0))
    assert float(jnp.max(jnp.abs(q.dequantize()))) <= 1.0 + 1e-6


def test_zero_tensor_and_zero_blocks_are_exact():
    z = jnp.zeros((4, 64)).at[0, :32].set(1.0)
    for fmt in ("int8", "int4", "uint4"):
        q = quantize(z, fmt, granularity=PerGroup(32, axis=1), symmetric=fmt != "uint4")
        assert np.all(np.isfinite(np.asarray(q.scale_values())))
        np.testing.assert_array_equal(np.asarray(q.dequantize())[1:], 0.0)


def test_non_finite_inputs_do_not_poison_other_blocks():
    v = jnp.ones((2, 64)).at[0, 3].set(jnp.nan).at[0, 5].set(jnp.inf)
    q = quantize(v, "int8", granularity=PerChannel(axes=(0,)))
    scale = np.asarray(q.scale_values())
    assert np.all(np.isfinite(scale))
    out = np.asarray(q.dequantize())
    assert out[0, 3] == 0.0  # NaN encodes to zero
    assert out[0, 5] == pytest.approx(1.0, rel=1e-2)  # Inf saturates to the block's top
    np.testing.assert_allclose(out[1], 1.0, rtol=1e-2)


def test_stochastic_rounding_is_unbiased():
    v = jnp.full((1, 20000), 0.3)
    q = quantize(
        v, "int8", calibration=Fixed(-127.0, 127.0), rounding="stochastic", key=jax.random.key(0)
    )
    codes = np.asarray(q.unpacked_codes(), np.float64)
    assert set(np.unique(codes)) == {0.0, 1.0}
    assert abs(codes.mean() - 0.3) < 0.02


def test_stochastic_rounding_needs_key(x):
    with pytest.raises(ValueError, match="key"):
        quantize(x, "int8", rounding="stochastic")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(format="int5x"), "unknown format"),
        (dict(format="int4", granularity=PerGroup(48)), "group size 48"),
        (dict(format="int8", granularity=PerChannel(axes=(5,))), "out of range"),
        (dict(format="int8", rounding="up"), "rounding"),
        (dict(format="int8", scale_dtype=jnp.int32), "scale_dtype"),
    ],
)
def test_errors_name_the_argument(x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(x, **kwargs)


def test_non_float_input_is_rejected():
    with pytest.raises(ValueError, match="floating-point"):
        quantize(jnp.arange(8), "int8")


def test_fake_quant_forward_and_straight_through_gradient(x):
    config = QuantConfig(format="int4", granularity=PerGroup(32))
    np.testing.assert_array_equal(fake_quant(x, config), quantize(x, config).dequantize())
    grad = jax.grad(lambda v: jnp.sum(fake_quant(v, config) * 2.0))(x)
    np.testing.assert_array_equal(grad, 2.0)


def test_fake_quant_clip_gradient_zeroes_clipped_values(x):
    config = QuantConfig(format="int8", calibration=Fixed(-1.0, 1.0))
    grad = jax.grad(lambda v: jnp.sum(fake_quant(v, config, clip_gradient=True)))(x)
    outside = np.abs(np.asarray(x)) > 1.0 + 1e-3
    assert outside.any()
    assert np.all(np.asarray(grad)[outside] == 0.0)
    assert np.all(np.asarray(grad)[np.abs(np.asarray(x)) < 0.99] == 1.0)


def test_amax_history_gives_delayed_bounds(x):
    state = amax_history_init(4)
    state = amax_history_update(state, x)
    state = amax_history_update(state, 0.5 * x)
    lo, hi = amax_history_bounds(state)
    assert float(hi) == pytest.approx(float(jnp.max(jnp.abs(x))))
    q = quantize(2 * x, "int8", bounds=(lo, hi))
    assert float(jnp.max(jnp.abs(q.dequantize()))) <= float(hi) * 1.01


@pytest.mark.parametrize(
    "text, expected",
    [
        ("absmax", AbsMax()),
        ("absmax,0.9", AbsMax(0.9)),
        ("minmax", MinMax()),
        ("percentile,99.9", Percentile(99.9)),
        ("fixed,-6,6", Fixed(-6.0, 6.0)),
        ("fixed,4", Fixed(-4.0, 4.0)),
        ("mse", MSE()),
    ],
)
def test_parse_calibration(text, expected):
    assert parse_calibration(text) == expected


def test_parse_calibration_error_lists_forms():
    with pytest.raises(ValueError, match="accepted"):
        parse_calibration("absmax,a,b")


def test_config_is_hashable_and_static():
    a = QuantConfig(format="int4", granularity=PerGroup(32))
    b = QuantConfig(format="int4", granularity=PerGroup(32))
    assert hash(a) == hash(b) and a == b
