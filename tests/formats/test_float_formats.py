"""Float formats are bit-identical to `ml_dtypes` casts (with saturation), both directions."""

import ml_dtypes
import numpy as np
import pytest
from formats_support import arrays, decoder, encoder, special_floats
from hypothesis import given

from lowbit.formats import FloatFormat, get_format

FLOAT_NAMES = [
    "fp8_e4m3fn",
    "fp8_e5m2",
    "fp8_e4m3fnuz",
    "fp8_e5m2fnuz",
    "fp6_e2m3",
    "fp6_e3m2",
    "fp4_e2m1",
]
REFERENCE = {
    "fp8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
    "fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "fp8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "fp6_e2m3": ml_dtypes.float6_e2m3fn,
    "fp6_e3m2": ml_dtypes.float6_e3m2fn,
    "fp4_e2m1": ml_dtypes.float4_e2m1fn,
}
SAMPLE = 32


def _patterns(codes) -> np.ndarray:
    return np.asarray(codes).view(np.uint8)


def _reference_codes(name, x) -> np.ndarray:
    fmt = get_format(name)
    clipped = np.clip(np.asarray(x, np.float32), fmt.min_value, fmt.max_value)
    return clipped.astype(REFERENCE[name]).view(np.uint8)


def _all_patterns(fmt) -> np.ndarray:
    return np.arange(2**fmt.bits, dtype=np.uint16).astype(np.uint8)


@pytest.mark.parametrize("name", FLOAT_NAMES)
@given(bulk=arrays((SAMPLE,), log2_range=(-24, 20)), special=special_floats())
def test_encode_matches_saturated_ml_dtypes_cast(name, bulk, special):
    x = np.concatenate([bulk, special])
    np.testing.assert_array_equal(_patterns(encoder(name)(x)), _reference_codes(name, x))


@pytest.mark.parametrize("name", FLOAT_NAMES)
def test_encode_ties_and_boundaries_match_ml_dtypes(name):
    fmt = get_format(name)
    levels = fmt.levels().astype(np.float32)
    midpoints = ((levels[1:].astype(np.float64) + levels[:-1]) / 2).astype(np.float32)
    # Exact midpoints (ties to even), their float32 neighbours, and the levels themselves.
    x = np.concatenate(
        [
            levels,
            midpoints,
            np.nextafter(midpoints, np.float32(np.inf)),
            np.nextafter(midpoints, np.float32(-np.inf)),
            np.array([fmt.max_value * 1.0625, np.inf, -np.inf, -0.0, 0.0, 1e-30], np.float32),
        ]
    ).astype(np.float32)
    np.testing.assert_array_equal(_patterns(encoder(name)(x)), _reference_codes(name, x))


@pytest.mark.parametrize("name", FLOAT_NAMES)
def test_decode_every_code_matches_ml_dtypes(name):
    fmt = get_format(name)
    patterns = _all_patterns(fmt)
    codes = patterns.view(fmt.code_dtype) if fmt.bits == 8 else patterns
    got = np.asarray(decoder(name)(codes))
    want = patterns.view(REFERENCE[name]).astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    # Bit patterns, so +0 and -0 (and ±Inf) must agree too.
    np.testing.assert_array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])


@pytest.mark.parametrize("name", FLOAT_NAMES)
def test_max_and_code_dtype(name):
    fmt = get_format(name)
    assert isinstance(fmt, FloatFormat)
    assert fmt.max_value == float(ml_dtypes.finfo(REFERENCE[name]).max)
    assert fmt.min_value == -fmt.max_value
    assert fmt.levels()[-1] == fmt.max_value
    expected = np.dtype(REFERENCE[name]) if fmt.bits == 8 else np.dtype(np.uint8)
    assert np.dtype(fmt.code_dtype) == expected
    assert encoder(name)(np.ones(3, np.float32)).dtype == expected


@pytest.mark.parametrize("name", FLOAT_NAMES)
def test_nan_and_infinity(name):
    fmt = get_format(name)
    codes = encoder(name)(np.array([np.nan, np.inf, -np.inf], np.float32))
    values = np.asarray(decoder(name)(codes))
    np.testing.assert_array_equal(values[1:], [fmt.max_value, -fmt.max_value])
    if fmt.nan_code is None:
        # No NaN in the format: NaN becomes +0 (not -0, which the raw cast gives).
        assert _patterns(codes)[0] == 0
    else:
        assert _patterns(codes)[0] == fmt.nan_code
        assert np.isnan(values[0])
        assert np.isnan(np.array([fmt.nan_code], np.uint8).view(REFERENCE[name]).astype(float))


def test_negative_zero_kept_except_fnuz():
    x = np.array([-0.0, -1e-9, 0.0], np.float32)
    np.testing.assert_array_equal(_patterns(encoder("fp8_e4m3fn")(x)), [0x80, 0x80, 0])
    np.testing.assert_array_equal(_patterns(encoder("fp4_e2m1")(x)), [0x8, 0x8, 0])
    np.testing.assert_array_equal(_patterns(encoder("fp8_e4m3fnuz")(x)), [0, 0, 0])


def test_bfloat16_input_is_encoded_exactly():
    x = np.array([1.5, -3.0, 1e-5, 3e4], ml_dtypes.bfloat16)
    want = x.astype(np.float32).astype(ml_dtypes.float8_e5m2).view(np.uint8)
    np.testing.assert_array_equal(_patterns(encoder("fp8_e5m2")(x)), want)
