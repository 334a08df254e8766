"""Plain NumPy reference implementations, written independently of `lowbit.formats`.

Each function follows the definition directly (bit matrices, float64 arithmetic, `ml_dtypes`
casts) rather than the library's tricks, so agreement is evidence of correctness.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0


def round_to_int(y: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """Nearest integer, ties to even (np.rint), saturated to [qmin, qmax], as int64."""
    return np.clip(np.rint(np.asarray(y, np.float64)), qmin, qmax).astype(np.int64)


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Dense little-endian packing along the last axis via an explicit bit matrix.

    Code i occupies stream bits [i*bits, (i+1)*bits), least significant bit first; the stream
    is zero-padded to whole groups of lcm(bits, 8) bits and cut into bytes.
    """
    codes = np.asarray(codes, np.uint8)
    lead, n = codes.shape[:-1], codes.shape[-1]
    bit_matrix = np.unpackbits(codes[..., None], axis=-1, bitorder="little")[..., :bits]
    stream = bit_matrix.reshape(*lead, n * bits)
    group_bits = math.lcm(bits, 8)
    pad = -(n * bits) % group_bits
    stream = np.concatenate([stream, np.zeros((*lead, pad), np.uint8)], axis=-1)
    return np.packbits(stream.reshape(*lead, -1, 8), axis=-1, bitorder="little")[..., 0]


def pack_base3(trits: np.ndarray) -> np.ndarray:
    """Five trits a byte along the last axis, first trit least significant, zero-padded."""
    trits = np.asarray(trits, np.int64)
    lead, n = trits.shape[:-1], trits.shape[-1]
    padded = np.concatenate([trits, np.zeros((*lead, -n % 5), np.int64)], axis=-1)
    groups = padded.reshape(*lead, -1, 5)
    return (groups @ np.array([1, 3, 9, 27, 81])).astype(np.uint8)


def pack_base3_inverse(packed: np.ndarray) -> np.ndarray:
    """Base-3 digits of each byte, least significant first: [..., m] → [..., 5 m]."""
    digits = [(packed.astype(np.int64) // 3**i) % 3 for i in range(5)]
    return np.stack(digits, axis=-1).reshape(*packed.shape[:-1], -1).astype(np.uint8)


def nearest_level(y: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Index of the nearest level; exact halfway ties take the lower index."""
    y = np.asarray(y, np.float64)[..., None]
    distance = np.abs(y - np.asarray(levels, np.float64))
    return np.argmin(distance, axis=-1)  # argmin returns the first (lower) index on ties


def blocks(x: np.ndarray, block: int) -> np.ndarray:
    """[rows, n] → [rows, n // block, block]."""
    return x.reshape(x.shape[0], -1, block)


def mx_quantize(x: np.ndarray, block: int, element_max: float, cast) -> tuple:
    """OCP MX v1.0 along the last axis of a 2-D array.

    Args:
      x: [rows, n] float32.
      block: block size (32).
      element_max: largest element magnitude (6, 7.5, 28, 448, 57344, 127/64).
      cast: elementwise rounding of float64 values already clipped to ±element_max.
    Returns:
      (exponents [rows, n // block] int64 in [-127, 127] for non-zero blocks, dequantized
      [rows, n] float64, amax [rows, n // block]).
    """
    xb = blocks(np.asarray(x, np.float64), block)
    amax = np.abs(xb).max(axis=-1)
    emax = math.floor(math.log2(element_max))
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(amax)) - emax
    exponent = np.clip(np.where(amax > 0, exponent, -127), -127, 127).astype(np.int64)
    scale = np.exp2(exponent.astype(np.float64))[..., None]
    values = cast(np.clip(xb / scale, -element_max, element_max)) * scale
    return exponent, values.reshape(x.shape), amax


def nvfp4_check(x, tensor_scale, block, codes, dequant, rel: float = 2.0**-21) -> None:
    """Checks an NVFP4 quantization of `x` ([rows, n] float32, blocks of 16 along the last axis).

    Reference: tensor_scale T = amax(x) / (6 * 448); block scale s = e4m3(amax(block) / 6 / T);
    elements e = e2m1(clip(x / (s T), ±6)); dequantized = e * s * T. XLA rewrites a division by
    a broadcast scalar as a multiplication by its reciprocal (not correctly rounded), so each
    rounding may see its input perturbed by a few float32 ulps: a stored value must equal the
    rounding of the exact input scaled by (1 - rel) or by (1 + rel).
    """
    x = np.asarray(x, np.float64)
    xb = blocks(x, 16)
    amax = np.abs(xb).max(axis=-1)
    t = float(np.asarray(tensor_scale).reshape(()))
    want_t = amax.max() / (6.0 * E4M3_MAX) if amax.max() > 0 else 1.0
    assert abs(t - want_t) <= rel * want_t, (t, want_t)

    def either(cast, v, got, what):
        lo, hi = cast(v * (1 - rel)), cast(v * (1 + rel))
        ok = (got == lo) | (got == hi)
        assert ok.all(), (what, got[~ok], v[~ok])

    e4m3 = lambda v: np.clip(v, 0, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    block = np.asarray(block).astype(np.float64)
    either(e4m3, amax / 6.0 / t, block, "block scale")
    scale = np.where(block > 0, block, 1.0) * t
    e2m1 = lambda v: np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    elements = np.asarray(codes, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    either(e2m1, xb / scale[..., None], elements.reshape(xb.shape), "elements")
    # Dequantization: element times (block scale times tensor scale), each product in float32.
    scale32 = np.where(block > 0, block, 1.0).astype(np.float32) * np.float32(t)
    want = elements.astype(np.float32).reshape(xb.shape) * scale32[..., None]
    np.testing.assert_array_equal(np.asarray(dequant), want.reshape(x.shape))
