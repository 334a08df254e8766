"""GGUF block decoders: bit-identical to `gguf.quants.dequantize`."""

import gguf
import numpy as np
import pytest
from gguf_support import TYPES

from lowbit.gguf import BLOCK_TYPES, decode


@pytest.mark.parametrize("name", TYPES)
def test_decode_is_bit_identical_to_gguf_on_random_bytes(name):
    t = BLOCK_TYPES[name]
    raw = np.random.default_rng(1).integers(0, 256, (3, 2 * t.type_size), dtype=np.uint8)
    got = decode(name, raw)
    assert got.shape == (3, 2 * t.block_size) and got.dtype == np.float32
    if name == "Q8_K":  # gguf has no Q8_K decoder: d (float32) times int8 codes
        blocks = raw.reshape(3, 2, t.type_size)
        d = blocks[..., :4].copy().view(np.float32)
        ref = (d * blocks[..., 4:260].view(np.int8).astype(np.float32)).reshape(3, -1)
    else:
        with np.errstate(all="ignore"):
            ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    # Bit for bit (signed zeros, infinities); NaN where the reference has NaN (payloads vary).
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
