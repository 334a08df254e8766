"""GGUF block encoders: llama.cpp's reference quantizers, round trips and errors."""

import gguf
import numpy as np
import pytest
from gguf_support import BYTE_STABLE, GGUF_ENCODES, TYPES, weights

from lowbit.gguf import BLOCK_TYPES, decode, encode


@pytest.mark.parametrize("name", GGUF_ENCODES)
def test_simple_encoders_match_gguf_byte_for_byte(name):
    x = weights(4, 512)
    np.testing.assert_array_equal(
        encode(name, x), gguf.quants.quantize(x, gguf.GGMLQuantizationType[name])
    )


@pytest.mark.parametrize("name", TYPES)
def test_encode_round_trip(name):
    t = BLOCK_TYPES[name]
    x = weights(6, 512)
    blocks = encode(name, x)
    assert blocks.shape == (6, 512 // t.block_size * t.type_size) and blocks.dtype == np.uint8
    y = decode(name, blocks)
    assert np.isfinite(y).all()
    assert np.all(y[0] == 0)  # a zero row stays zero, no NaN scales
    again = encode(name, y)
    np.testing.assert_array_equal(decode(name, again), y)
    if name in BYTE_STABLE:  # the zero row may flip the sign of a zero scale
        np.testing.assert_array_equal(again[1:], blocks[1:])


def test_error_shrinks_with_bits():
    x = weights(6, 512, seed=3)  # the round-trip test's shape: compiled encoders are reused
    err = {  # Gaussian rows only (3:)
        n: float(np.sqrt(np.mean((decode(n, encode(n, x)) - x)[3:] ** 2) / np.mean(x[3:] ** 2)))
        for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")
    }
    values = list(err.values())
    assert values == sorted(values, reverse=True), err
    # Reference points on Gaussian rows (llama.cpp's quantizers give about the same).
    assert err["Q4_K"] < 0.11 and err["Q6_K"] < 0.03 and err["Q8_K"] < 0.01, err


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 256"):
        encode("Q4_K", np.zeros((2, 576), np.float32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode("Q8_0", np.full((1, 32), np.nan, np.float32))
    with pytest.raises(ValueError, match="unknown GGUF block type 'Q7_K'"):
        encode("Q7_K", np.zeros((1, 256), np.float32))
