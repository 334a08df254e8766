"""Packing: dense bit packing against a `np.packbits` bit-matrix reference, base-3 ternary
against a positional reference, jit-ability, padding, and `QArray.nbytes`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from formats_reference import pack_base3, pack_base3_inverse, pack_bits
from formats_support import jit
from hypothesis import given
from hypothesis import strategies as st

from lowbit.formats import (
    FORMATS,
    GGUFBlockFormat,
    get_format,
    group_shape,
    pack,
    packed_length,
    unpack,
)
from lowbit.qarray import PerChannel, PerGroup, QuantConfig, quantize

ROWS = 8
MAX_N = 41
# Group sizes are 1, 2, 4 or 8 codes: lengths 41 and 38 (and ROWS = 8 along axis 0) leave a
# last group with 1, 2 (or 6) and 0 spare codes, so the padding is exercised both ways for every
# width; 8 ROWS x 41 hold all 256 8-bit codes.
LENGTHS = (38, 41)


@functools.cache
def _round_trips(bits: int):
    """Jitted: codes [ROWS, MAX_N] → per prefix length n, (packed, unpacked) along axis 1,
    and packed along axis 0 (a non-last axis, length ROWS). One compile per width."""

    def run(codes):
        out = []
        for n in LENGTHS:
            packed = pack(codes[:, :n], bits, axis=1)
            out.append((packed, unpack(packed, bits, n, axis=1)))
        packed_rows = pack(codes, bits, axis=0)
        return out, packed_rows, unpack(packed_rows, bits, ROWS, axis=0)

    return jit(run)


def _check_round_trips(bits, codes):
    results, packed_rows, unpacked_rows = _round_trips(bits)(codes)
    for n, (packed, unpacked) in zip(LENGTHS, results, strict=True):
        assert packed.dtype == jnp.uint8
        assert packed.shape == (ROWS, packed_length(n, bits))
        np.testing.assert_array_equal(np.asarray(packed), pack_bits(codes[:, :n], bits))
        np.testing.assert_array_equal(np.asarray(unpacked), codes[:, :n])
    np.testing.assert_array_equal(np.asarray(packed_rows), pack_bits(codes.T, bits).T)
    np.testing.assert_array_equal(np.asarray(unpacked_rows), codes)


@pytest.mark.parametrize("bits", range(1, 9))
@given(seed=st.integers(0, 2**32 - 1))
def test_pack_matches_bit_matrix_reference_and_round_trips(bits, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, (ROWS, MAX_N)).astype(np.uint8)
    _check_round_trips(bits, codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_every_code_survives_packing(bits):
    codes = np.resize(np.arange(2**bits, dtype=np.uint8), (ROWS, MAX_N))
    _check_round_trips(bits, codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_packed_length_and_padding(bits):
    per_group, bytes_per_group = group_shape(bits)
    assert per_group * bits == bytes_per_group * 8  # groups fill whole bytes, nothing wasted
    for n in (1, per_group + 1, 5 * per_group + 3):
        assert packed_length(n, bits) == -(-n // per_group) * bytes_per_group
        assert packed_length(n, bits) * 8 - n * bits < 8 * bytes_per_group
    # The padding of the last group is zero bits.
    codes = np.full((ROWS, MAX_N), 2**bits - 1, np.uint8)
    packed = np.asarray(_round_trips(bits)(codes)[0][1][0])  # n = 41
    tail_bits = np.unpackbits(packed[0], bitorder="little")[41 * bits :]
    assert not tail_bits.any()


def test_unpack_rejects_wrong_length():
    with pytest.raises(ValueError, match="expected 6 for 9 codes"):
        unpack(jnp.zeros((2,), jnp.uint8), 3, 8 + 1, axis=0)
    with pytest.raises(ValueError, match="bits must be an int in 1..8"):
        pack(jnp.zeros((4,), jnp.uint8), 9)
    with pytest.raises(ValueError, match="base-3"):
        get_format("ternary_b3").unpack(jnp.zeros((2,), jnp.uint8), 11, axis=0)


@functools.cache
def _base3_round_trips():
    fmt = get_format("ternary_b3")

    def run(trits):
        out = []
        for n in LENGTHS:
            packed = fmt.pack(trits[:, :n], 1)
            out.append((packed, fmt.unpack(packed, n, 1)))
        return out

    return jit(run)


@given(seed=st.integers(0, 2**32 - 1))
def test_base3_matches_reference_and_round_trips(seed):
    trits = np.random.default_rng(seed).integers(0, 3, (ROWS, MAX_N)).astype(np.uint8)
    for n, (packed, unpacked) in zip(LENGTHS, _base3_round_trips()(trits), strict=True):
        assert packed.shape == (ROWS, -(-n // 5))
        np.testing.assert_array_equal(np.asarray(packed), pack_base3(trits[:, :n]))
        np.testing.assert_array_equal(np.asarray(unpacked), trits[:, :n])


def test_base3_every_byte_value():
    # All 243 five-trit groups decode and re-encode to themselves.
    fmt = get_format("ternary_b3")
    packed = np.arange(243, dtype=np.uint8)[None, :]
    trits = jit(lambda p: fmt.unpack(p, 5 * 243, 1))(packed)
    np.testing.assert_array_equal(np.asarray(trits), pack_base3_inverse(packed))
    np.testing.assert_array_equal(pack_base3(np.asarray(trits)), packed)
    assert fmt.bits_per_value == 1.6 and get_format("ternary").bits_per_value == 2.0


def _storage_kind(fmt):
    # Formats with the same kind share pack/unpack behaviour (block formats use their element's).
    return (fmt.bits, np.dtype(fmt.code_dtype).name, getattr(fmt, "storage", "bits"))


@pytest.mark.parametrize(
    "name",
    sorted(
        {
            _storage_kind(f): n
            for n, f in sorted(FORMATS.items())
            if not isinstance(f, GGUFBlockFormat)  # block storage: tests/formats/test_gguf.py
        }.values()
    ),
)
def test_format_pack_round_trips_every_code(name):
    """Each format's own pack/unpack returns every valid code, in `code_dtype`."""
    fmt = get_format(name)
    codes = fmt.codes()

    def run(c):
        packed = fmt.pack(c, 0)
        return packed, fmt.unpack(packed, len(codes), 0)

    packed, back = jit(run)(codes)
    assert packed.dtype == jnp.uint8
    assert packed.shape == (fmt.packed_length(len(codes)),)
    assert back.dtype == fmt.code_dtype
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
    # Shapes and dtypes are all nbytes needs: evaluate abstractly, nothing is compiled.
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    q = jax.eval_shape(lambda x: quantize(x, QuantConfig(format=name, **config)), x)
    q.check()
    assert q.nbytes == expected
