"""GGUF block formats: QArrays stored as GGML blocks, and their errors."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.formats import GGUF_BLOCK_FORMATS, get_format
from lowbit.gguf import BLOCK_TYPES, decode, encode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gguf"))
from gguf_support import weights  # noqa: E402

from lowbit.qarray import PerGroup, quantize


@pytest.mark.parametrize(
    "fmt",
    [f for f in GGUF_BLOCK_FORMATS if f.name in ("q4_k", "q6_k", "q8_k", "iq4_nl", "tq1_0")],
    ids=lambda f: f.name,
)
def test_qarray_of_block_format(fmt):
    t = BLOCK_TYPES[fmt.ggml_type]
    w = weights(6, 512)  # blocks along axis 1
    q = quantize(jnp.asarray(w), fmt.name, granularity=PerGroup(t.block_size, axis=1))
    assert q.packed_axis == 1 and q.codes.dtype == jnp.uint8
    assert q.nbytes == 6 * 512 // t.block_size * t.type_size  # exactly the GGUF bytes
    expected = decode(fmt.ggml_type, encode(fmt.ggml_type, w))
    np.testing.assert_array_equal(np.asarray(q.dequantize()), expected)
    # Transposed (blocks along axis 0, a Flax kernel), inside jit.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a.dequantize())(q.T)), expected.T)
    assert fmt.bits_per_value == t.type_size * 8 / t.block_size


def test_block_format_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(jnp.ones((100, 8)), "q4_k")
    with pytest.raises(ValueError, match="no element encoding"):
        get_format("q6_k").encode(jnp.ones(3))
