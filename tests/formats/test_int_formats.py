"""Integer formats: encode against a NumPy rounding reference, and the half-step error bound
through `lowbit.qarray.quantize` at every granularity."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from formats_reference import round_to_int
from formats_support import arrays, decoder, encoder, jit
from hypothesis import given

from lowbit.formats import IntFormat, get_format
from lowbit.qarray import (
    AbsMax,
    MinMax,
    PerBlock,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QuantConfig,
    broadcast_blocks,
    quantize,
)

INT_NAMES = [f"int{n}" for n in range(1, 9)] + [f"uint{n}" for n in range(1, 9)]
SHAPE = (4, 32)
GRANULARITIES = {
    "per_tensor": PerTensor(),
    "per_channel": PerChannel(axes=(1,)),  # one scale per column
    "per_group": PerGroup(8, axis=1),
    "per_block": PerBlock((2, 8)),
    "per_token": PerToken(),
}


@functools.cache
def _quantize_all(name):
    """Jitted: (x, y) → ([granularity, (dequantized, scale, zero point), *x.shape], encode(y),
    decode(encode(y))); one compile per format."""
    fmt = get_format(name)
    calibration, symmetric = (AbsMax(), True) if fmt.is_signed else (MinMax(), False)

    def run(x, y):
        out = []
        for granularity in GRANULARITIES.values():
            config = QuantConfig(
                format=name,
                granularity=granularity,
                calibration=calibration,
                symmetric=symmetric,
                pack=False,  # packing has its own tests; unpacked keeps the compile small
            )
            q = quantize(x, config)
            scale = broadcast_blocks(q.scale_values(), x.shape)
            zero = jnp.zeros_like(x) if q.zero_point is None else q.zero_point
            out.append(jnp.stack([q.dequantize(), scale, broadcast_blocks(zero, x.shape)]))
        codes = fmt.encode(y)
        return jnp.stack(out), codes, fmt.decode(codes)

    return jit(run)


def _check_encode_against_numpy(name, y, codes, values):
    fmt = get_format(name)
    codes, values = np.asarray(codes), np.asarray(values)
    assert codes.dtype == fmt.code_dtype
    if fmt.is_signed and fmt.bits == 1:
        np.testing.assert_array_equal(values, np.where(y < 0, -1.0, 1.0))
        return
    want = round_to_int(y, fmt.qmin, fmt.qmax)
    np.testing.assert_array_equal(values, want)
    # Bit patterns: two's complement truncated to `bits` (8-bit codes are int8/uint8 proper).
    patterns = codes.view(np.uint8).astype(np.int64)
    np.testing.assert_array_equal(patterns, want % 2**fmt.bits)


# One hypothesis test per width does both checks on each example (the per-example overhead of
# hypothesis is most of the cost): encode of the raw values against NumPy rounding (magnitudes
# up to 2**8 saturate every width; the "halves" kind puts exact ties at scales >= 2**4), then the
# half-step bound through `quantize` at every granularity.
@pytest.mark.parametrize("name", INT_NAMES)
@given(x=arrays(SHAPE))
def test_encode_and_quantize_error_within_half_step(name, x):
    y = x.reshape(-1)
    results, codes, values = _quantize_all(name)(x, y)
    _check_encode_against_numpy(name, y, codes, values)
    fmt = get_format(name)
    levels = fmt.levels()
    half_step = np.max(np.diff(levels)) / 2  # 0.5, except binary int1: levels ±1, so 1
    for key, (dequant, scale, zero) in zip(GRANULARITIES, np.asarray(results, float), strict=True):
        if 0.0 in levels:
            assert np.all(scale > 0), key
        else:
            # int1 (±1, no zero level): an all-zero block gets scale 0 so it decodes to zeros.
            assert np.all((scale > 0) | ((scale == 0) & (x == 0) & (dequant == 0))), key
            scale = np.where(scale > 0, scale, 1.0)
        y = x / scale + zero
        lo, hi = (-fmt.max_value, fmt.max_value) if fmt.is_signed else (levels[0], levels[-1])
        # Signed: AbsMax maps each block's |x| max to max_value; unsigned: MinMax maps
        # [min, max] onto [0, qmax]. Either way every element lies inside (up to float32
        # rounding of the scale).
        margin = 1e-5 * max(abs(lo), abs(hi))
        assert np.all((y >= lo - margin) & (y <= hi + margin)), key
        # float32 rounding in x / scale and code * scale adds a few ulps of |x|.
        slack = 4 * np.finfo(np.float32).eps * (np.abs(x) + scale * np.abs(levels).max())
        error = np.abs(x - dequant)
        assert np.all(error <= half_step * scale + slack), (key, float(error.max()))


@pytest.mark.parametrize("name", INT_NAMES)
def test_qmin_qmax_and_levels(name):
    fmt = get_format(name)
    assert isinstance(fmt, IntFormat)
    if fmt.bits == 1 and fmt.is_signed:
        assert (fmt.qmin, fmt.qmax) == (-1, 1)
        np.testing.assert_array_equal(fmt.levels(), [-1.0, 1.0])
        return
    n = 2**fmt.bits
    want = np.arange(-(n // 2), n // 2) if fmt.is_signed else np.arange(n)
    np.testing.assert_array_equal(fmt.levels(), want)
    assert (fmt.qmin, fmt.qmax) == (want[0], want[-1])
    assert fmt.max_value == want[-1] and fmt.min_value == want[0]


def test_int1_is_binary_sign():
    # Zero and NaN map to +1: there is no zero level in a binary format.
    x = np.array([-3.0, -1e-30, 0.0, -0.0, 2.0, np.nan], np.float32)
    codes = encoder("int1")(x)
    np.testing.assert_array_equal(np.asarray(codes), [0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(decoder("int1")(codes)), [-1, -1, 1, 1, 1, 1])
    fmt = get_format("int1")
    np.testing.assert_array_equal(np.asarray(fmt.to_int(codes)), [-1, -1, 1, 1, 1, 1])


def test_nan_encodes_to_zero_and_inf_saturates():
    x = np.array([np.nan, np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(np.asarray(decoder("int4")(encoder("int4")(x))), [0, 7, -8])
    np.testing.assert_array_equal(np.asarray(decoder("uint8")(encoder("uint8")(x))), [0, 255, 0])


@pytest.mark.parametrize("name", INT_NAMES)
def test_to_int_from_int_inverse(name):
    fmt = get_format(name)
    q = fmt.levels().astype(np.int32)  # int1 has no 0: its integers are ±1
    np.testing.assert_array_equal(jit(lambda q: fmt.to_int(fmt.from_int(q)))(q), q)


def test_mxint8_element_is_fixed_point():
    fmt = get_format("mxint8")
    codes = np.arange(-128, 128, dtype=np.int8)
    np.testing.assert_array_equal(np.asarray(decoder("mxint8")(codes)), codes / 64.0)
    assert (fmt.min_value, fmt.max_value) == (-2.0, 1.984375)
    y = np.array([1.0 / 128, 3.0 / 128, -1.9921875, 5.0, np.nan], np.float32)  # ties to even
    np.testing.assert_array_equal(np.asarray(encoder("mxint8")(y)), [0, 2, -128, 127, 0])
