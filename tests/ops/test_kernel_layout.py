"""Prepared weights: the kernel layout replaces the codes, used by the kernel route with the
per-call result, the logical QArray recovered bit for bit, carried by transposes and casts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_helpers import EPS32, iter_eqns, jit_quantize, normal

from lowbit import kernels
from lowbit.engine import trace_report
from lowbit.ops import (
    PreparedQArray,
    _cpu_kernels,
    dot_general,
    dot_general_path,
    dot_general_reference,
    logical_weights,
    prepare_transposed,
    prepare_weight,
    prepare_weights,
    with_int8_activations,
)
from lowbit.qarray import DATA_FIELDS, MinMax, PerChannel, PerGroup, PerToken, QArray, QuantConfig

pytestmark = pytest.mark.skipif(
    not kernels.available() or jax.default_backend() != "cpu",
    reason="CPU kernels unavailable: " + kernels.status(),
)

K, N = 256, 264
DIMS = (((1,), (0,)), ((), ()))
DIMS_T = (((1,), (1,)), ((), ()))
CONFIGS = {
    "int8": (QuantConfig(format="int8", granularity=PerChannel((1,))), None),
    "int4_group_asym": (
        QuantConfig(
            format="int4", granularity=PerGroup(32, 0), symmetric=False, calibration=MinMax()
        ),
        None,
    ),
    "nf4_group": (QuantConfig(format="nf4", granularity=PerGroup(64, 0)), None),
    "fp8": (QuantConfig(format="fp8_e4m3fn", granularity=PerChannel((1,))), None),
    "int8_bf16_group": (
        QuantConfig(format="int8", granularity=PerGroup(32, 0), scale_dtype=jnp.bfloat16),
        None,
    ),
    "w8a8": (
        QuantConfig(format="int8", granularity=PerChannel((1,))),
        QuantConfig(format="int8", granularity=PerToken()),
    ),
}


def _weight(name: str) -> QArray:
    config, activation = CONFIGS[name]
    q = jit_quantize(normal(1, (K, N)), config)
    return dataclasses.replace(q, activation=activation)


@jax.jit
def _dot(x, q):
    return dot_general(x, q, DIMS)


def _primitive_names(fn, *args) -> set[str]:
    return {eqn.primitive.name for eqn in iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)}


def _assert_same_qarray(a: QArray, b: QArray) -> None:
    assert type(a) is type(b) is QArray
    for f in dataclasses.fields(QArray):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in DATA_FIELDS and x is not None:
            assert y is not None and x.dtype == y.dtype and x.shape == y.shape, f.name
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prepared_weight_replaces_the_codes_and_gives_the_per_call_result(name):
    q = _weight(name)
    prepared = prepare_weight(q, 0)
    assert isinstance(prepared, PreparedQArray) and prepared.axis == 0
    # Only the layout is held (plus nothing kept here): no codes beside it.
    leaves = jax.tree.leaves(prepared)
    assert all(not any(leaf is x for x in jax.tree.leaves(q)) for leaf in leaves)
    assert prepared.nbytes == q.nbytes and prepared.resident_nbytes <= 1.25 * q.nbytes
    _assert_same_qarray(prepared.logical(), q)
    x = normal(2, (5, K))
    assert dot_general_path(x, prepared, DIMS) == dot_general_path(x, q, DIMS)
    np.testing.assert_array_equal(np.asarray(_dot(x, prepared)), np.asarray(_dot(x, q)))
    # The per-call route repacks (padding to whole panels); the prepared one calls the kernel.
    assert "pad" in _primitive_names(_dot, x, q)
    assert "pad" not in _primitive_names(_dot, x, prepared)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("axis", [0, 1])
def test_a_weight_is_laid_out_from_its_transpose_as_from_itself(name, axis):
    """`prepare_transposed(q.T, axis)` (a file's [out, in] weight, not transposed first) is
    `prepare_weight(q, axis)`, leaf for leaf; where no kernel runs it, q itself."""
    q = _weight(name)
    want, got = prepare_weight(q, axis), prepare_transposed(q.T, axis)
    assert type(got) is type(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize(
    "fmt, shape", [("mxfp4", (256, 256)), ("nvfp4", (256, 256)), ("uint4", (256, 264))]
)
def test_block_scaled_and_zero_point_weights_come_back_exactly(fmt, shape):
    config = QuantConfig(format=fmt)
    if fmt == "uint4":
        config = QuantConfig(
            format=fmt, granularity=PerGroup(64, 0), symmetric=False, calibration=MinMax()
        )
    q = jit_quantize(normal(8, shape), config)
    axis = 0 if fmt == "uint4" else 1  # MX / NV blocks run along the last axis: [N, K]
    prepared = prepare_weight(q, axis)
    assert isinstance(prepared, PreparedQArray)
    _assert_same_qarray(prepared.logical(), q)
    x = normal(9, (2, shape[axis]))
    dims = DIMS if axis == 0 else DIMS_T
    np.testing.assert_allclose(
        np.asarray(dot_general(x, prepared, dims)),
        np.asarray(dot_general(x, q, dims)),
        rtol=1e-6,
        atol=1e-5,
    )


def test_row_scaled_weight_is_laid_out_for_x_at_w_transposed():
    # A tied embedding [vocab, dim] with one scale per row, used as the output projection.
    table = jit_quantize(
        normal(3, (N, K)), QuantConfig(format="int8", granularity=PerChannel((0,)))
    )
    prepared = prepare_weight(table, 1)
    assert prepared.axis == 1
    x = normal(4, (3, K))
    assert dot_general_path(x, prepared, DIMS_T) == "cpu_kernel_int8"
    out = jax.jit(lambda x, q: dot_general(x, q, DIMS_T))
    got = np.asarray(out(x, prepared))
    np.testing.assert_array_equal(got, np.asarray(out(x, table)))
    ref = np.asarray(dot_general_reference(x, table, DIMS_T))
    magnitude = np.abs(np.asarray(x)) @ np.abs(np.asarray(table.dequantize())).T
    np.testing.assert_array_less(np.abs(got - ref), (2 * K + 8) * EPS32 * magnitude + 1e-30)
    # Rows (an embedding lookup) come from the panels that hold them.
    ids = jnp.asarray([0, 7, 16, N - 1])
    np.testing.assert_array_equal(
        np.asarray(prepared.rows(ids).dequantize()), np.asarray(table.dequantize())[ids]
    )
    # For the other axis there is no kernel layout ([N, K] -> [K, N] with the scale along K).
    assert prepare_weight(table, 0) is table
    # Used another way (here x @ table with K = N rows), it becomes logical: same result.
    y = normal(5, (2, N))
    np.testing.assert_allclose(
        np.asarray(dot_general(y, prepared, DIMS)),
        np.asarray(dot_general(y, table, DIMS)),
        rtol=1e-6,
    )


def test_transpose_and_astype_keep_the_layout():
    prepared = prepare_weight(_weight("int8"), 0)
    assert prepared.T.weight is prepared.weight and prepared.T.axis == 1
    assert prepared.T.T.axis == 0 and prepared.T.shape == (N, K)
    assert prepared.astype(jnp.bfloat16).weight is prepared.weight
    _assert_same_qarray(prepared.T.logical(), prepared.logical().T)


def test_prepared_weights_survive_jit_and_tree_maps():
    params = {"a": _weight("int4_group_asym"), "b": jnp.ones(3)}
    prepared = prepare_weights(params, {(jax.tree_util.DictKey("a"),): 0})
    same = jax.jit(lambda p: p)(prepared)
    assert isinstance(same["a"], PreparedQArray) and same["a"].axis == 0
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(same)[0]]
    assert not any("codes" in p for p in paths)
    back = logical_weights(same)
    _assert_same_qarray(back["a"], params["a"])


def test_non_kernel_values_are_returned_unchanged():
    small = jit_quantize(normal(6, (16, 16)), QuantConfig(format="int8"))
    assert prepare_weight(small, 0) is small
    array = jnp.ones((K, N))
    assert prepare_weight(array, 0) is array
    stacked = jit_quantize(normal(7, (2, K, N)), QuantConfig(format="int8"))
    assert prepare_weight(stacked, 0) is stacked
    with pytest.raises(ValueError, match="axis"):
        prepare_weight(_weight("int8"), 2)


@pytest.mark.parametrize("fmt, twin", [("int4", "q4_0"), ("int8", "q8_0")])
@pytest.mark.parametrize("axis", [0, 1])
def test_groups_of_32_with_float16_scales_move_to_gguf_tiles_on_int8_activations(axis, fmt, twin):
    """A GGUF file's Q4_0 / Q8_0 tensor (int4 / int8, groups of 32 along K, float16 scales)
    runs on Q4_0's / Q8_0's tiles once int8 activations are asked for: the same logical
    weight, fewer bytes, the same products as its own layout's integer dots; float
    activations go back to its own layout."""
    config = QuantConfig(format=fmt, granularity=PerGroup(32, 0), scale_dtype=jnp.float16)
    q = jit_quantize(normal(1, (K, N)), config)
    if axis == 1:
        q = q.T  # [N, K]: stored as a GGUF file's rows
    int4 = prepare_weight(q, axis)
    assert int4.route.kind == fmt
    q4 = with_int8_activations({"w": int4})["w"]
    assert q4.route.kind == twin and q4.route.int8_activations
    assert q4.resident_nbytes < int4.resident_nbytes
    _assert_same_qarray(q4.logical(), q)
    ids = jnp.asarray([5, 0, N - 1, 17])
    np.testing.assert_array_equal(q4.rows(ids).dequantize(), int4.rows(ids).dequantize())
    # The same integer products: activations in blocks of 32, integer dots, float scales.
    int4_int8 = dataclasses.replace(
        int4, route=dataclasses.replace(int4.route, int8_activations=True)
    )
    dims = DIMS if axis == 0 else DIMS_T
    dot = jax.jit(lambda x, w: dot_general(x, w, dims))
    for m in (1, 8, _cpu_kernels.GEMM_MIN_ROWS):
        x = normal(3 + m, (m, K))
        np.testing.assert_allclose(dot(x, q4), dot(x, int4_int8), rtol=1e-5, atol=1e-5)
    back = with_int8_activations({"w": q4}, enabled=False)["w"]
    assert back.route == int4.route
    _assert_same_qarray(back.logical(), q)
    # Float32 scales are not the GGUF type's: its own layout stays.
    wide = prepare_weight(
        jit_quantize(normal(1, (K, N)), dataclasses.replace(config, scale_dtype=jnp.float32)), 0
    )
    assert with_int8_activations({"w": wide})["w"].route.kind == fmt


@pytest.mark.parametrize("name", ["int4_group_asym", "int8"])
def test_with_int8_activations_quantizes_every_row_count(name):
    prepared = prepare_weight(_weight(name), 0)
    tree = {"w": prepared, "bias": jnp.ones(3)}
    fast = with_int8_activations(tree)
    assert fast["w"].route.int8_activations and not prepared.route.int8_activations
    assert fast["w"].weight is prepared.weight  # the layout is shared, not copied
    assert fast["bias"] is tree["bias"]
    assert with_int8_activations(fast, enabled=False)["w"].route == prepared.route
    # The report tells which products took int8 activations and which kept float ones.
    supported = kernels.int8_activations_supported(prepared.route.kind)
    suffix = "+int8_act" if supported else ""
    assert fast["w"].route.path == f"cpu_kernel_{prepared.route.kind}{suffix}"
    assert prepared.route.path == f"cpu_kernel_{prepared.route.kind}"
    report = trace_report(lambda x, w: x @ w, normal(2, (4, K)), fast["w"])
    assert dict(report.quantized_ops) == {f"dot_general:{fast['w'].route.path}": 1}
    w_float = np.asarray(prepared.logical().dequantize(jnp.float32), np.float64)
    # One decode row, a decode batch, and a prefill (which would otherwise take the float GEMM
    # on the dequantized weight).
    for m in (1, 8, _cpu_kernels.GEMM_MIN_ROWS):
        x = normal(3 + m, (m, K))
        y = np.asarray(_dot(x, fast["w"]), np.float64)
        if not kernels.int8_activations_supported(prepared.route.kind):
            np.testing.assert_array_equal(y, np.asarray(_dot(x, prepared)))
            continue
        # Each row rounded to int8 per weight group (32 rows of K; per channel: one chunk of K).
        gs = prepared.weight.storage_group
        # float32 division, as the kernel's: in float64 a few near-ties round the other way.
        groups = np.asarray(x, np.float32).reshape(m, K // gs, gs)
        scale = np.abs(groups).max(-1, keepdims=True) / np.float32(127)
        xq = (np.round(groups / scale).astype(np.float64) * scale).reshape(m, K)
        np.testing.assert_allclose(y, xq @ w_float, rtol=1e-5, atol=1e-4, err_msg=f"M={m}")
        assert np.abs(y - np.asarray(x, np.float64) @ w_float).max() > 1e-3
