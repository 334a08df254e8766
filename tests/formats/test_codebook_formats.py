"""NF4 (levels, nearest-with-ties-to-lower encode) and ternary (BitNet b1.58 with AbsMean)."""

import numpy as np
import pytest
from formats_reference import nearest_level, round_to_int
from formats_support import arrays, decoder, encoder, jit
from hypothesis import given

from lowbit.formats import CodebookFormat, TernaryFormat, get_format, normal_float_levels
from lowbit.qarray import AbsMean, PerGroup, QuantConfig, quantize

# QLoRA's published NF4 table (float32 values as printed by the reference implementation).
PUBLISHED_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


def test_nf4_levels_match_published_table():
    levels = np.array(normal_float_levels())
    assert np.max(np.abs(levels - PUBLISHED_NF4)) < 1e-7
    fmt = get_format("nf4")
    assert isinstance(fmt, CodebookFormat)
    np.testing.assert_array_equal(fmt.levels(), levels)
    assert (fmt.max_value, fmt.min_value, fmt.bits) == (1.0, -1.0, 4)
    assert levels[7] == 0.0


def _nf4_ties() -> np.ndarray:
    levels = get_format("nf4").levels()
    midpoints = (levels[1:] + levels[:-1]) / 2
    exact = midpoints[midpoints.astype(np.float32) == midpoints].astype(np.float32)
    near = midpoints.astype(np.float32)
    up, down = (np.nextafter(near, np.float32(s * np.inf)) for s in (1, -1))
    return np.concatenate([exact, near, up, down, levels.astype(np.float32)])


@given(x=arrays((64,), log2_range=(-6, 1)))
def test_nf4_encode_is_nearest_with_ties_to_lower(x):
    x = np.concatenate([x, _nf4_ties()])
    codes = np.asarray(encoder("nf4")(x))
    np.testing.assert_array_equal(codes, nearest_level(x, get_format("nf4").levels()))
    np.testing.assert_array_equal(
        np.asarray(decoder("nf4")(codes)), np.array(normal_float_levels(), np.float32)[codes]
    )


def test_nf4_saturates_and_nan_goes_to_zero():
    x = np.array([-5.0, 5.0, np.inf, -np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(np.asarray(encoder("nf4")(x)), [0, 15, 15, 0, 7])


def test_nf4_absmax_group_scale():
    x = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    config = QuantConfig(format="nf4", granularity=PerGroup(64, 1))
    scale, dequant = jit(lambda x: (lambda q: (q.scale, q.dequantize()))(quantize(x, config)))(x)
    amax = np.abs(x.reshape(4, 2, 64)).max(-1)
    np.testing.assert_allclose(np.asarray(scale), amax, rtol=0)
    # Error is at most half the widest NF4 gap (between -1 and -0.696...) times the scale.
    half_gap = np.max(np.diff(normal_float_levels())) / 2
    bound = np.repeat(amax, 64, axis=1) * half_gap * (1 + 1e-6)
    assert np.all(np.abs(np.asarray(dequant) - x) <= bound)


@pytest.mark.parametrize("name", ["ternary", "ternary_b3"])
@given(x=arrays((4, 40)))
def test_ternary_absmean_is_bitnet_b158(name, x):
    codes, scale, dequant = _ternary_quantize(name)(x)
    want_scale = np.abs(x.astype(np.float64)).mean()
    if want_scale == 0:
        want_scale = 1.0  # an all-zero tensor keeps scale 1 (decodes to exact zeros)
    np.testing.assert_allclose(float(np.asarray(scale).reshape(())), want_scale, rtol=1e-5)
    values = np.asarray(codes).astype(np.int64) - 1
    s = float(np.asarray(scale).reshape(()))
    y = x / np.float32(s)
    # Same rounding as the reference except where x / scale is within float32 error of a tie.
    want = round_to_int(y, -1, 1)
    near_tie = np.abs(np.abs(y) - 0.5) < 1e-5
    np.testing.assert_array_equal(values[~near_tie], want[~near_tie])
    np.testing.assert_allclose(np.asarray(dequant), values * np.float32(s), rtol=1e-6)


_TERNARY_CACHE = {}


def _ternary_quantize(name):
    if name not in _TERNARY_CACHE:

        def run(x):
            q = quantize(x, QuantConfig(format=name, calibration=AbsMean()))
            return q.unpacked_codes(), q.scale, q.dequantize()

        _TERNARY_CACHE[name] = jit(run)
    return _TERNARY_CACHE[name]


def test_ternary_codes_and_int_view():
    for name in ("ternary", "ternary_b3"):
        fmt = get_format(name)
        assert isinstance(fmt, TernaryFormat)
        assert (fmt.qmin, fmt.qmax, fmt.max_value) == (-1, 1, 1.0)
        np.testing.assert_array_equal(fmt.codes(), [0, 1, 2])
        np.testing.assert_array_equal(fmt.levels(), [-1.0, 0.0, 1.0])
    y = np.array([-7.0, -0.5, 0.5, 0.51, 1.5, np.nan], np.float32)  # ties to even: ±0.5 → 0
    codes = encoder("ternary")(y)
    np.testing.assert_array_equal(np.asarray(codes), [0, 1, 1, 2, 2, 1])
    np.testing.assert_array_equal(
        np.asarray(get_format("ternary").to_int(codes)), [-1, 0, 0, 1, 1, 0]
    )
