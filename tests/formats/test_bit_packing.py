"""Packing: dense bit packing against a `np.packbits` bit-matrix reference, base-3 ternary
against a positional reference, jit-ability, padding, and `QArray.nbytes`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from formats_reference import pack_base3, pack_bits
from hypothesis import given
from hypothesis import strategies as st

from lowbit.formats import FORMATS, get_format, group_shape, pack, packed_length, unpack
from lowbit.qarray import PerChannel, PerGroup, QuantConfig, quantize

ROWS = 3
MAX_N = 41  # codes along the packed axis; odd lengths exercise the padding of the last group


@functools.cache
def _round_trip(bits: int, n: int):
    """Jitted pack then unpack along axis 1 of [ROWS, n] codes."""

    def run(codes):
        packed = pack(codes, bits, axis=1)
        return packed, unpack(packed, bits, n, axis=1)

    return jax.jit(run)


@pytest.mark.parametrize("bits", range(1, 9))
@given(n=st.integers(1, MAX_N), seed=st.integers(0, 2**32 - 1))
def test_pack_matches_bit_matrix_reference_and_round_trips(bits, n, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, (ROWS, n)).astype(np.uint8)
    packed, unpacked = _round_trip(bits, n)(codes)
    assert packed.dtype == jnp.uint8
    assert packed.shape == (ROWS, packed_length(n, bits))
    np.testing.assert_array_equal(np.asarray(packed), pack_bits(codes, bits))
    np.testing.assert_array_equal(np.asarray(unpacked), codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_packed_length_and_padding(bits):
    per_group, bytes_per_group = group_shape(bits)
    assert per_group * bits == bytes_per_group * 8  # groups fill whole bytes, nothing wasted
    for n in (1, per_group - 1, per_group, per_group + 1, 5 * per_group + 3):
        if n >= 1:
            assert packed_length(n, bits) == -(-n * bits // (8 * bytes_per_group)) * bytes_per_group
    # The padding of the last group is zero bits.
    codes = np.full((1, 1), 2**bits - 1, np.uint8)
    packed = np.asarray(pack(codes, bits, axis=1))
    assert packed[0, 0] == 2**bits - 1 and not packed[0, 1:].any()


def test_every_code_survives_packing_along_any_axis():
    # All 2**bits codes in a [2, 2**bits, 3] array, packed along each axis in turn.
    for bits in range(1, 9):
        codes = np.broadcast_to(np.arange(2**bits, dtype=np.uint8)[None, :, None], (2, 2**bits, 3))
        for axis in (0, 1, 2, -1):
            packed = pack(codes, bits, axis=axis)
            back = unpack(packed, bits, codes.shape[axis], axis=axis)
            np.testing.assert_array_equal(np.asarray(back), codes)


def test_unpack_rejects_wrong_length():
    with pytest.raises(ValueError, match="expected 3"):
        unpack(jnp.zeros((2,), jnp.uint8), 3, 8 + 1, axis=0)
    with pytest.raises(ValueError, match="bits must be an int in 1..8"):
        pack(jnp.zeros((4,), jnp.uint8), 9)
    with pytest.raises(ValueError, match="base-3"):
        get_format("ternary_b3").unpack(jnp.zeros((2,), jnp.uint8), 11, axis=0)


@functools.cache
def _base3_round_trip(n: int):
    fmt = get_format("ternary_b3")

    def run(trits):
        packed = fmt.pack(trits, 1)
        return packed, fmt.unpack(packed, n, 1)

    return jax.jit(run)


@given(n=st.integers(1, MAX_N), seed=st.integers(0, 2**32 - 1))
def test_base3_matches_reference_and_round_trips(n, seed):
    trits = np.random.default_rng(seed).integers(0, 3, (ROWS, n)).astype(np.uint8)
    packed, unpacked = _base3_round_trip(n)(trits)
    assert packed.shape == (ROWS, -(-n // 5))
    np.testing.assert_array_equal(np.asarray(packed), pack_base3(trits))
    np.testing.assert_array_equal(np.asarray(unpacked), trits)


def test_base3_every_byte_value():
    # All 243 five-trit groups decode and re-encode to themselves.
    fmt = get_format("ternary_b3")
    packed = np.arange(243, dtype=np.uint8)[None, :]
    trits = fmt.unpack(packed, 5 * 243, 1)
    assert int(jnp.max(trits)) == 2
    np.testing.assert_array_equal(np.asarray(fmt.pack(trits, 1)), packed)
    assert fmt.bits_per_value == 1.6 and get_format("ternary").bits_per_value == 2.0


def test_format_pack_round_trips_every_code():
    """Every format's own pack/unpack returns every valid code, in `code_dtype`."""
    for name, fmt in FORMATS.items():
        codes = fmt.codes()
        packed = fmt.pack(jnp.asarray(codes), axis=0)
        assert packed.dtype == jnp.uint8, name
        assert packed.shape == (fmt.packed_length(len(codes)),), name
        back = fmt.unpack(packed, len(codes), axis=0)
        assert back.dtype == fmt.code_dtype, name
        np.testing.assert_array_equal(np.asarray(back).view(np.uint8), codes.view(np.uint8))


@pytest.mark.parametrize(
    ("name", "shape", "config", "expected"),
    [
        # codes: rows x packed bytes; scale: one float32 per row (per-channel, last axis kept).
        ("int4", (6, 30), dict(granularity=PerChannel((0,))), 6 * 15 + 6 * 4),
        ("int3", (6, 30), dict(granularity=PerChannel((0,))), 6 * 12 + 6 * 4),
        ("uint5", (6, 30), dict(granularity=PerChannel((0,)), symmetric=False), 6 * 20 + 2 * 6 * 4),
        ("ternary_b3", (6, 30), dict(granularity=PerChannel((0,))), 6 * 6 + 6 * 4),
        ("nf4", (4, 64), dict(granularity=PerGroup(32, axis=1)), 4 * 32 + 4 * 2 * 4),
        ("int8", (4, 64), dict(granularity=PerGroup(32, axis=1)), 4 * 64 + 4 * 2 * 4),
        ("fp8_e4m3fn", (4, 64), dict(), 4 * 64 + 4),
        ("fp6_e2m3", (4, 64), dict(), 4 * 48 + 4),
        # MX: one E8M0 byte per 32 elements; NVFP4: one e4m3 byte per 16 plus a float32.
        ("mxfp4", (4, 64), dict(), 4 * 32 + 4 * 2),
        ("mxfp6_e3m2", (4, 64), dict(), 4 * 48 + 4 * 2),
        ("mxint8", (4, 64), dict(), 4 * 64 + 4 * 2),
        ("nvfp4", (4, 64), dict(), 4 * 32 + 4 * 4 + 4),
    ],
)
def test_qarray_nbytes_is_packed_codes_plus_scales(name, shape, config, expected):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    q = quantize(x, QuantConfig(format=name, **config))
    q.check()
    assert q.nbytes == expected
