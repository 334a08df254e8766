"""Layout ops on packed values are exact: interpreting them equals the float op on the
dequantized array, bit for bit, and they never dequantize (strict mode passes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.engine import EngineFallbackError, EngineReport, interpret
from lowbit.qarray import PerBlock, PerChannel, PerGroup, PerTensor, quantize

_W = jax.random.normal(jax.random.PRNGKey(0), (4, 6, 16), jnp.float32)

QARRAYS = {
    "int8_channel": quantize(_W, "int8", granularity=PerChannel((-1,))),
    "int8_tensor": quantize(_W, "int8", granularity=PerTensor()),
    "int4_group": quantize(_W, "int4", granularity=PerGroup(4, axis=-1)),
    "int4_group_axis1": quantize(_W, "int4", granularity=PerGroup(2, axis=1)),
    "uint4_asym": quantize(_W, "uint4", granularity=PerChannel((0, 1)), symmetric=False),
    "int3_block": quantize(_W, "int3", granularity=PerBlock((2, 8))),
}

OPS = {
    "transpose": lambda w: jnp.transpose(w, (2, 0, 1)),
    "T": lambda w: w.T,
    "merge_leading": lambda w: w.reshape(24, 16),
    "split_leading": lambda w: w.reshape(2, 2, 6, 16),
    "expand_squeeze": lambda w: jnp.squeeze(jnp.expand_dims(w, 1), 1)[None],
    "broadcast": lambda w: jnp.broadcast_to(w, (3, 4, 6, 16)),
    "slice_rows": lambda w: w[2:4],
    "slice_cols": lambda w: w[:, :, 8:16],
    "dynamic_slice_layer": lambda w: jax.lax.dynamic_index_in_dim(w, jnp.int32(3), 0, False),
    "astype": lambda w: w.astype(jnp.bfloat16),
}

_RUN = {name: jax.jit(interpret(fn, strict=True)) for name, fn in OPS.items()}
_REF = {name: jax.jit(fn) for name, fn in OPS.items()}

# (qarray, op) pairs that cannot keep whole blocks / byte groups: they must fall back.
_UNSUPPORTED = {
    ("int4_group", "slice_cols"): False,
    ("int8_tensor", "slice_rows"): True,
    ("int8_tensor", "slice_cols"): True,
    ("int8_tensor", "dynamic_slice_layer"): True,
    ("int3_block", "slice_rows"): False,
    ("int3_block", "slice_cols"): True,
    ("int3_block", "dynamic_slice_layer"): True,
    ("int4_group_axis1", "dynamic_slice_layer"): False,
    ("uint4_asym", "dynamic_slice_layer"): False,
}


@pytest.mark.parametrize("qname", sorted(QARRAYS))
@pytest.mark.parametrize("op", sorted(OPS))
def test_layout_op_is_exact(qname, op):
    q = QARRAYS[qname]
    expected = _REF[op](q.dequantize())
    if _UNSUPPORTED.get((qname, op), False):
        with pytest.raises(EngineFallbackError, match="strict"):
            _RUN[op](q)
        out = interpret(OPS[op])(q)
    else:
        out = _RUN[op](q)
        assert out.check() is out
        out = out.dequantize()
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_reshape_that_splits_blocks_falls_back_and_is_counted():
    q = QARRAYS["int4_group"]  # blocks of 4 along the last axis, packed there
    report = EngineReport()
    out = interpret(lambda w: w.reshape(4, 6, 2, 8)[..., 1:3], report=report)(q)
    np.testing.assert_array_equal(out, q.dequantize().reshape(4, 6, 2, 8)[..., 1:3])
    assert report.fallbacks == {"slice": 1}
    assert report.materialized == 1
    assert report.layout_ops == {"reshape": 1}


@pytest.mark.parametrize("qname", ["int8_channel", "int4_group", "int4_group_axis1", "uint4_asym"])
def test_embedding_gather_out_of_range_ids_match_jnp_take(qname):
    q = QARRAYS[qname]
    table = jax.tree.map(lambda a: a, q)
    ids = jnp.array([[0, 3, -1], [4, 100, -5]], jnp.int32)
    out = jax.jit(interpret(lambda e, i: jnp.take(e, i, axis=0), strict=True))(table, ids)
    expected = jnp.take(q.dequantize(), ids, axis=0)
    assert isinstance(out, type(q))
    # Rows 4, 100 and -5 are out of range: NaN rows, exactly as the float take.
    values = np.asarray(out.dequantize())
    assert np.isnan(values[1]).all()
    assert not np.isnan(values[0]).any()
    np.testing.assert_array_equal(values, np.asarray(expected))


def test_gather_clip_mode_clamps_rows():
    q = QARRAYS["int4_group"]
    ids = jnp.array([-3, 1, 9], jnp.int32)
    take = lambda e, i: jnp.take(e, i, axis=0, mode="clip")
    out = interpret(take, strict=True)(q, ids)
    np.testing.assert_array_equal(out.dequantize(), take(q.dequantize(), ids))
