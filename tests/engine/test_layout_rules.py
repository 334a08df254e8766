"""Layout ops on packed values are exact: interpreting them equals the float op on the
dequantized array, bit for bit, and they never dequantize (strict mode passes)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import all_eqns, jit_quantize

from lowbit.engine import EngineFallbackError, EngineReport, interpret, trace_report
from lowbit.qarray import PerBlock, PerChannel, PerGroup, PerTensor, QArray

_W = jax.random.normal(jax.random.PRNGKey(0), (4, 6, 16), jnp.float32)

QARRAYS = {
    "int8_tensor": jit_quantize(_W, "int8", PerTensor()),
    "int4_group": jit_quantize(_W, "int4", PerGroup(4, axis=-1)),
    "uint4_asym": jit_quantize(_W, "uint4", PerChannel((0, 1)), symmetric=False),
    "int3_block": jit_quantize(_W, "int3", PerBlock((2, 8))),
}

OPS = {
    "transpose": lambda w: jnp.transpose(w, (2, 0, 1)),
    "merge_leading": lambda w: w.reshape(24, 16),
    "split_leading": lambda w: w.reshape(2, 2, 6, 16),
    "expand_squeeze": lambda w: jnp.squeeze(jnp.expand_dims(w, 1), 1)[None],
    "broadcast": lambda w: jnp.broadcast_to(w, (3, 4, 6, 16)),
    "slice_rows": lambda w: w[2:4],
    "slice_cols": lambda w: w[:, :, 8:16],
    "slice_odd_cols": lambda w: w[:, :, 1:3],
    "dynamic_slice_layer": lambda w: jax.lax.dynamic_index_in_dim(w, jnp.int32(3), 0, False),
    "astype": lambda w: w.astype(jnp.bfloat16),
}

# Slices that split a byte group of packed codes must fall back (packed along the last axis).
_SPLITS_BYTES = "slice_odd_cols"


def _all_ops(w):
    return {name: fn(w) for name, fn in OPS.items() if name != _SPLITS_BYTES}


# One compiled program per QArray for all ops (interpreted, then dequantized) and one reference.
def _interpreted(q):
    outs = interpret(_all_ops, strict=True)(q)
    assert all(
        isinstance(out, QArray) and out.codes.dtype == q.codes.dtype for out in outs.values()
    )
    return {name: out.check().dequantize() for name, out in outs.items()}


_RUN = jax.jit(_interpreted)
_REF = jax.jit(lambda q: _all_ops(q.dequantize()))


@pytest.mark.parametrize("qname", sorted(QARRAYS))
def test_layout_ops_are_exact_and_stay_packed(qname):
    q = QARRAYS[qname]
    expected = _REF(q)
    out = _RUN(q)
    for name in expected:
        np.testing.assert_array_equal(
            np.asarray(out[name], np.float32), np.asarray(expected[name], np.float32), err_msg=name
        )


@pytest.mark.parametrize("qname", sorted(QARRAYS))
def test_slice_splitting_byte_groups_falls_back(qname):
    q = QARRAYS[qname]
    fn = OPS[_SPLITS_BYTES]
    report = trace_report(fn, q)
    if q.packed_axis == 2:
        assert report.fallbacks == {"slice": 1}
        assert "byte groups" in report.fallback_details[0]
        with pytest.raises(EngineFallbackError, match="slice"):
            trace_report(fn, q, strict=True)
    else:
        assert report.fallbacks == {}
        assert report.layout_ops == {"slice": 1}


def test_reshape_that_splits_blocks_falls_back_and_is_counted():
    q = QARRAYS["int4_group"]  # blocks of 4 along the last axis, packed there
    report = EngineReport()
    fn = lambda w: w.reshape(4, 6, 2, 8)[..., 1:3]
    out, expected = jax.jit(lambda q: (interpret(fn, report=report)(q), fn(q.dequantize())))(q)
    np.testing.assert_array_equal(out, expected)
    assert report.fallbacks == {"slice": 1}
    assert report.materialized == 1
    assert report.layout_ops == {"reshape": 1}


def _take_both(q, ids):
    rows = interpret(lambda e, i: jnp.take(e, i, axis=0), strict=True)(q, ids)
    return rows, jnp.take(q.dequantize(), ids, axis=0)


_TAKE = jax.jit(_take_both)


@pytest.mark.parametrize("qname", ["int8_tensor", "int4_group", "uint4_asym"])
def test_embedding_gather_out_of_range_ids_match_jnp_take(qname):
    q = QARRAYS[qname]
    ids = jnp.array([[0, 3, -1], [4, 100, -5]], jnp.int32)
    values, expected = _TAKE(q, ids)
    # Rows 4, 100 and -5 are out of range: NaN rows, exactly as the float take.
    values = np.asarray(values)
    # Only the gathered rows are dequantized, never the table.
    jaxpr = jax.make_jaxpr(interpret(lambda e, i: jnp.take(e, i, axis=0)))(q, ids)
    shapes = [v.aval.shape for e in all_eqns(jaxpr) for v in e.outvars]
    assert q.shape not in shapes
    assert np.isnan(values[1]).all()
    assert not np.isnan(values[0]).any()
    np.testing.assert_array_equal(values, np.asarray(expected))


def test_gather_clip_mode_clamps_rows():
    q = QARRAYS["int4_group"]
    ids = jnp.array([-3, 1, 9], jnp.int32)
    take = lambda e, i: jnp.take(e, i, axis=0, mode="clip")
    out, expected = jax.jit(
        lambda q, i: (interpret(take, strict=True)(q, i), take(q.dequantize(), i))
    )(q, ids)
    np.testing.assert_array_equal(out, expected)


# A weight with an input scale (SmoothQuant's in-op scale) varying along some axes: every
# layout op carries it, so the result still stands for the same float array.
_INPUT_SCALES = {
    "axis1": jnp.linspace(0.5, 2.0, 6, dtype=jnp.float32).reshape(1, 6, 1),
    "axes01": jnp.linspace(0.5, 2.0, 24, dtype=jnp.float32).reshape(4, 6, 1),
}

# `i` is a traced int32 argument (2), for slices at a traced offset.
_SCALED_OPS = {
    "transpose": lambda w, i: jnp.transpose(w, (2, 0, 1)),
    "merge_leading": lambda w, i: w.reshape(24, 16),
    "merge_trailing": lambda w, i: w.reshape(4, 96),
    "split_leading": lambda w, i: w.reshape(2, 2, 6, 16),
    "expand_squeeze": lambda w, i: jnp.squeeze(jnp.expand_dims(w, 1), 1)[None],
    "broadcast": lambda w, i: jnp.broadcast_to(w, (3, 4, 6, 16)),
    "slice_rows": lambda w, i: w[1:3],
    "slice_middle": lambda w, i: w[:, 2:5],
    "dynamic_slice_layer": lambda w, i: jax.lax.dynamic_index_in_dim(w, jnp.int32(3), 0, False),
    "dynamic_slice_traced": lambda w, i: jax.lax.dynamic_slice_in_dim(w, i, 3, 1),
}


@pytest.mark.parametrize("scale_name", sorted(_INPUT_SCALES))
@pytest.mark.parametrize("op", sorted(_SCALED_OPS))
def test_layout_ops_carry_the_input_scale(op, scale_name):
    q = QARRAYS["int8_tensor"]
    q = dataclasses.replace(q, input_scale=_INPUT_SCALES[scale_name]).check()
    fn, i = _SCALED_OPS[op], jnp.int32(2)
    report = EngineReport()
    out = jax.jit(interpret(fn, strict=True, report=report))(q, i)
    assert isinstance(out, QArray) and out.input_scale is not None
    out.check()
    assert report.fallbacks == {}
    np.testing.assert_array_equal(
        np.asarray(out.dequantize()), np.asarray(fn(q.dequantize(), i)), err_msg=op
    )


def test_embedding_gather_carries_the_input_scale():
    q = dataclasses.replace(QARRAYS["int4_group"], input_scale=_INPUT_SCALES["axis1"]).check()
    ids = jnp.array([[0, 3, 1], [2, 2, 0]], jnp.int32)
    values, expected = _TAKE(q, ids)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(expected))
    # A scale that varies along the gathered axis is not carried: dequantized, counted.
    q = dataclasses.replace(q, input_scale=_INPUT_SCALES["axes01"]).check()
    report = trace_report(lambda e, i: jnp.take(e, i, axis=0), q, ids)
    assert report.fallbacks == {"gather": 1}
    assert "input_scale varies" in report.fallback_details[0]
