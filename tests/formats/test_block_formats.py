"""MX (E8M0 scales) and NVFP4 (e4m3 block scales + float32 tensor scale) against a plain NumPy
reference of the scale selection and element rounding."""

import functools

import ml_dtypes
import numpy as np
import pytest
from formats_reference import mx_quantize, nvfp4_check, round_to_int
from formats_support import arrays, jit
from hypothesis import given

from lowbit.formats import BlockFormat, get_format
from lowbit.qarray import PerGroup, QuantConfig, quantize

MX = {
    "mxfp8_e4m3": ml_dtypes.float8_e4m3fn,
    "mxfp8_e5m2": ml_dtypes.float8_e5m2,
    "mxfp6_e2m3": ml_dtypes.float6_e2m3fn,
    "mxfp6_e3m2": ml_dtypes.float6_e3m2fn,
    "mxfp4": ml_dtypes.float4_e2m1fn,
    "mxint8": None,
}
SHAPE = (3, 64)  # two MX blocks / four NVFP4 blocks per row


def _cast(name):
    dtype = MX[name]
    if dtype is None:  # mxint8: k / 64, ties to even, restricted to ±127/64
        return lambda y: round_to_int(y * 64, -127, 127) / 64.0
    return lambda y: y.astype(np.float32).astype(dtype).astype(np.float64)


@functools.cache
def _quantize(name):
    def run(x):
        q = quantize(x, QuantConfig(format=name))
        return q.scale, q.tensor_scale, q.dequantize(), q.unpacked_codes()

    return jit(run)


@pytest.mark.parametrize("name", sorted(MX))
@given(x=arrays(SHAPE, log2_range=(-40, 40)))
def test_mx_scales_and_values_match_reference(name, x):
    fmt = get_format(name)
    stored, tensor_scale, dequant, _ = _quantize(name)(x)
    exponent, want, amax = mx_quantize(x, 32, fmt.max_value, _cast(name))
    assert tensor_scale is None
    stored = np.asarray(stored)
    assert stored.dtype == np.uint8 and stored.shape == (SHAPE[0], SHAPE[1] // 32)
    nonzero = amax > 0
    np.testing.assert_array_equal(stored.astype(np.int64)[nonzero] - 127, exponent[nonzero])
    np.testing.assert_array_equal(np.asarray(dequant, np.float64), want)


@given(x=arrays(SHAPE, log2_range=(-20, 20)))
def test_nvfp4_scales_and_values_match_reference(x):
    block, tensor_scale, dequant, codes = _quantize("nvfp4")(x)
    assert np.asarray(tensor_scale).shape == (1, 1)
    block = np.asarray(block)
    assert block.dtype == ml_dtypes.float8_e4m3fn and block.shape == (SHAPE[0], SHAPE[1] // 16)
    nvfp4_check(x, tensor_scale, block, codes, dequant)


def test_block_format_fields():
    for name in MX:
        fmt = get_format(name)
        assert isinstance(fmt, BlockFormat)
        assert (fmt.block_size, fmt.scale_encoding) == (32, "e8m0")
    nvfp4 = get_format("nvfp4")
    assert (nvfp4.block_size, nvfp4.scale_encoding, nvfp4.element.name) == (16, "e4m3", "fp4_e2m1")
    assert get_format("mxfp4").element is get_format("fp4_e2m1")
    assert get_format("mxfp8_e4m3").element is get_format("fp8_e4m3fn")
    # Element emax (floor(log2(max))) as tabulated in OCP MX v1.0.
    emax = {n: int(np.floor(np.log2(get_format(n).max_value))) for n in MX}
    assert emax == {
        "mxfp8_e4m3": 8,
        "mxfp8_e5m2": 15,
        "mxfp6_e2m3": 2,
        "mxfp6_e3m2": 4,
        "mxfp4": 2,
        "mxint8": 0,
    }


def test_block_format_rejects_wrong_group_size():
    with pytest.raises(ValueError, match="group size is fixed at 32"):
        quantize(np.ones((2, 64), np.float32), "mxfp4", granularity=PerGroup(16, axis=1))


def test_mx_zero_block_decodes_to_zero():
    x = np.zeros(SHAPE, np.float32)
    x[0, 40] = 3.0  # second block of row 0 non-zero, the rest exact zeros
    _, _, dequant, codes = _quantize("mxfp4")(x)
    np.testing.assert_array_equal(np.asarray(dequant), x)
