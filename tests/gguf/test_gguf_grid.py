"""The GGUF grids' parameter layout and float16 fields (their exactness is tested with the
fake quantizer, `tests/qarray/test_gguf_fake_quant.py`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.gguf import BLOCK_TYPES, GRIDS, grid_of, round_fp16


def test_parameter_shapes():
    assert grid_of("Q4_K").param_shapes((3, 2, 256)) == {
        "d": (3, 2),
        "dmin": (3, 2),
        "scale": (3, 2, 8),
        "min": (3, 2, 8),
    }
    assert grid_of("Q6_K").param_shapes((2, 256)) == {"d": (2,), "scale": (2, 16)}
    assert grid_of("Q4_1").param_shapes((5, 32)) == {"d": (5,), "m": (5,)}


@pytest.mark.parametrize("name", tuple(GRIDS))
def test_grid_matches_its_block_type(name):
    g, t = GRIDS[name], BLOCK_TYPES[name]
    assert g.block_size == t.block_size
    assert t.block_size % g.sub_size == 0
    assert list(g.values) == sorted(g.values)


def test_float16_fields_saturate():
    x = jnp.asarray([1e6, -1e6, 1.0 / 3], jnp.float32)
    np.testing.assert_array_equal(round_fp16(x), [65504.0, -65504.0, np.float16(1.0 / 3)])


def test_types_without_a_grid_raise():
    with pytest.raises(ValueError, match="Q4_K"):
        grid_of("TQ2_0")
