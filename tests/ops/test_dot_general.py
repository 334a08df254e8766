"""`dot_general` on QArrays vs the dequantize-then-dot reference, paths, jaxprs, exactness."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ops_helpers import (
    EPS32,
    int_dots,
    iter_eqns,
    jit_quantize,
    normal,
    summation_bound,
    weight,
)

from lowbit.ops import dot_general, dot_general_path, dot_general_reference, quantize_activation
from lowbit.qarray import (
    AbsMax,
    Fixed,
    MinMax,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QArray,
    QuantConfig,
    quantize,
)


@pytest.fixture(autouse=True)
def _float32_products():
    # The error bounds below are for float32 sums. On a GPU the default precision of a float32
    # dot is TF32 (TPU: bfloat16 passes), in the quantized paths and the reference alike; the
    # bounds hold there only at "highest". On a CPU this is the default already.
    with jax.default_matmul_precision("highest"):
        yield


INT8_TOKEN = QuantConfig(format="int8", granularity=PerToken())
UINT8_ASYM = QuantConfig(
    format="uint8", granularity=PerToken(), symmetric=False, calibration=MinMax()
)
INT4_TOKEN = QuantConfig(format="int4", granularity=PerToken())

# name: (x shape, w shape, dimension numbers, weight is lhs, per-channel tile, grouped tile)
CASES = {
    "linear": ((3, 16), (16, 6), (((1,), (0,)), ((), ())), False, PerChannel((1,)), PerGroup(8, 0)),
    "attend": ((3, 16), (6, 16), (((1,), (1,)), ((), ())), False, PerChannel((0,)), PerGroup(4, 1)),
    "weight_lhs": (
        (3, 16),
        (16, 6),
        (((0,), (1,)), ((), ())),
        True,
        PerChannel((1,)),
        PerGroup(8, 0),
    ),
    "qkv_einsum": (
        (2, 3, 16),
        (16, 2, 4),
        (((2,), (0,)), ((), ())),
        False,
        PerChannel((1, 2)),
        PerGroup(8, 0),
    ),
    "out_einsum": (
        (2, 3, 2, 4),
        (2, 4, 16),
        (((2, 3), (0, 1)), ((), ())),
        False,
        PerChannel((2,)),
        PerGroup(2, 1),
    ),
    "batched": (
        (2, 3, 16),
        (2, 16, 5),
        (((2,), (1,)), ((0,), (0,))),
        False,
        PerChannel((0, 2)),
        PerGroup(8, 1),
    ),
}

WEIGHTS = {
    "int8_channel": lambda case: QuantConfig(format="int8", granularity=case[4]),
    "int4_group": lambda case: QuantConfig(format="int4", granularity=case[5]),
    "uint4_group_asym": lambda case: QuantConfig(
        format="uint4", granularity=case[5], symmetric=False, calibration=MinMax()
    ),
}

MODES = {
    "weight_only": (None, None),
    "int8_dynamic": (INT8_TOKEN, None),
    "uint8_asym_dynamic": (UINT8_ASYM, None),
    "int8_static": (
        QuantConfig(format="int8", calibration=Fixed(-2.5, 2.5)),
        jnp.array([-2.5, 2.5], jnp.float32),
    ),
}


# Each dimension-number case runs every weight mode and every activation mode at least once,
# without the full cross product (every combination is one compile).
COMBOS = [
    ("int8_channel", "weight_only"),
    ("int4_group", "weight_only"),
    ("int4_group", "int8_dynamic"),
    ("uint4_group_asym", "uint8_asym_dynamic"),
    ("int8_channel", "int8_static"),
]


def _operands(case, q, x):
    w_is_lhs = case[3]
    return (q, x) if w_is_lhs else (x, q)


def _expected_path(mode: str, weight_name: str) -> str:
    if mode == "weight_only":
        return "weight_only_epilogue" if weight_name == "int8_channel" else "weight_only_grouped"
    return "int8_int32"


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _fast_and_reference(x, w, case_name, weight_name, mode):
    case = CASES[case_name]
    dims = case[2]
    activation, bounds = MODES[mode]
    q = weight(w, WEIGHTS[weight_name](case), activation, bounds)
    lhs, rhs = _operands(case, q, x)
    out = dot_general(lhs, rhs, dims)
    ref = dot_general_reference(lhs, rhs, dims)
    # The bound needs the magnitudes of what the reference multiplies.
    (lc, rc), _ = dims
    x_side = (
        x
        if activation is None
        else quantize_activation(x, rc if case[3] else lc, activation, bounds).dequantize()
    )
    l_abs, r_abs = (jnp.abs(a) for a in _operands(case, q.dequantize(), x_side))
    magnitude = lax.dot_general(l_abs, r_abs, dims, precision=lax.Precision.HIGHEST)
    return out, ref, magnitude


# Every case meets weight-only and an integer activation mode; every combination meets
# several cases (each pair is one compile, so not the full cross product).
CASE_COMBOS = [
    (case, *COMBOS[(i + j) % len(COMBOS)])
    for i, case in enumerate(CASES)
    for j in (0, 2, 3 + i % 2)
]


@pytest.mark.parametrize("case_name, weight_name, mode", CASE_COMBOS)
def test_matches_reference(case_name, weight_name, mode):
    case = CASES[case_name]
    x_shape, w_shape, dims = case[:3]
    x, w = normal(0, x_shape), normal(1, w_shape)
    activation, bounds = MODES[mode]
    q = jax.eval_shape(lambda w: weight(w, WEIGHTS[weight_name](case), activation, bounds), w)
    lhs, rhs = _operands(case, q, x)
    assert dot_general_path(lhs, rhs, dims) == _expected_path(mode, weight_name)
    out, ref, magnitude = _fast_and_reference(x, w, case_name, weight_name, mode)
    assert out.shape == lax.dot_general(*_operands(case, w, x), dims).shape
    assert out.dtype == jnp.float32
    (lc, rc), _ = dims
    contracted = int(np.prod([x_shape[a] for a in (rc if case[3] else lc)]))
    bound = (2 * contracted + 8) * EPS32 * np.asarray(magnitude) + 1e-30
    np.testing.assert_array_less(np.abs(np.asarray(out) - np.asarray(ref)), bound)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _both(lhs, rhs, dims, reference_type=None):
    """(fast, reference, the float operand as the reference sees it) in one compile."""
    out = dot_general(lhs, rhs, dims)
    ref = dot_general_reference(lhs, rhs, dims, preferred_element_type=reference_type)
    (lc, _), _ = dims
    x = lhs
    if isinstance(rhs, QArray) and rhs.activation is not None:
        x = quantize_activation(lhs, lc, rhs.activation, rhs.activation_bounds).dequantize()
    return out, ref, x


def test_integer_path_is_exact():
    # Scales of 1 (Fixed(-127, 127) with int8) make every product an integer: the int32
    # accumulation must then equal the exact integer product (|sum| < 2**24, exact in f32).
    rng = np.random.default_rng(0)
    xi = rng.integers(-127, 128, size=(4, 96)).astype(np.float32)
    wi = rng.integers(-127, 128, size=(96, 5)).astype(np.float32)
    one = QuantConfig(format="int8", calibration=Fixed(-127.0, 127.0))
    qx, qw = quantize(jnp.asarray(xi), one), quantize(jnp.asarray(wi), one)
    dims = (((1,), (0,)), ((), ()))
    assert dot_general_path(qx, qw, dims) == "int8_int32"
    out = np.asarray(jax.jit(lambda a, b: dot_general(a, b, dims))(qx, qw))
    np.testing.assert_array_equal(out, (xi.astype(np.int64) @ wi.astype(np.int64)))


def test_asymmetric_both_sides_exact_integer_part():
    # uint8 activations with zero points meet uint4 asymmetric weights: with integral zero
    # points and unit scales every correction term is an integer, so the result is exact.
    rng = np.random.default_rng(1)
    xi = rng.integers(0, 256, size=(3, 40)).astype(np.float32)
    wi = rng.integers(0, 16, size=(40, 4)).astype(np.float32)
    qx = quantize(
        jnp.asarray(xi - 100.0),
        "uint8",
        symmetric=False,
        bounds=(jnp.float32(-100.0), jnp.float32(155.0)),
    )
    qw = quantize(
        jnp.asarray(wi - 7.0),
        "uint4",
        symmetric=False,
        pack=False,
        bounds=(jnp.float32(-7.0), jnp.float32(8.0)),
    )
    dims = (((1,), (0,)), ((), ()))
    out = np.asarray(jax.jit(lambda a, b: dot_general(a, b, dims))(qx, qw))
    expect = (xi - 100.0).astype(np.int64) @ (wi - 7.0).astype(np.int64)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(out, expect)
    else:
        # XLA's GPU compiler divides by a constant as a product with its reciprocal, so the
        # unit scale comes out as 1 - 2**-24 and the zero point as 100.00002 there.
        np.testing.assert_allclose(out, expect, rtol=4e-7, atol=1e-3)


def test_w4a8_int8_dot_in_jaxpr():
    x, w = normal(0, (3, 32)), normal(1, (32, 8))
    q = weight(w, QuantConfig(format="int4", granularity=PerGroup(16, 0)), INT8_TOKEN)
    assert q.packed_axis is not None
    dims = (((1,), (0,)), ((), ()))
    jaxpr = jax.make_jaxpr(lambda x, q: dot_general(x, q, dims))(x, q)
    dots = int_dots(jaxpr)
    assert len(dots) == 1
    # The group axis became a batch axis: [groups, tokens, out].
    assert dots[0].outvars[0].aval.shape == (2, 3, 8)
    out, ref, xq = _both(x, q, dims)
    bound = summation_bound(jnp.abs(xq), jnp.abs(q.dequantize()), dims, 32)
    np.testing.assert_array_less(np.abs(out - ref), bound)


@pytest.mark.parametrize("act_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("grouped", [False, True])
def test_weight_only_never_materializes_float_weight(act_dtype, grouped):
    x, w = normal(0, (3, 32), act_dtype), normal(1, (32, 8))
    granularity = PerGroup(8, 0) if grouped else PerChannel((1,))
    q = weight(w, QuantConfig(format="int4", granularity=granularity))
    dims = (((1,), (0,)), ((), ()))
    jaxpr = jax.make_jaxpr(lambda x, q: dot_general(x, q, dims))(x, q)
    weight_sized = 32 * 8
    for eqn in iter_eqns(jaxpr):
        for var in eqn.outvars:
            aval = var.aval
            if int(np.prod(aval.shape)) >= weight_sized and aval.shape != (3, 8):
                assert not jnp.issubdtype(aval.dtype, jnp.floating), (
                    f"{eqn.primitive.name} makes a weight-sized float array {aval}"
                )
    assert jax.eval_shape(lambda x, q: dot_general(x, q, dims), x, q).dtype == act_dtype


def test_fp8_path():
    x, w = normal(0, (3, 32)), normal(1, (32, 8))
    fp8 = QuantConfig(format="fp8_e4m3fn", granularity=PerToken())
    q = weight(w, QuantConfig(format="fp8_e4m3fn", granularity=PerChannel((1,))), fp8)
    dims = (((1,), (0,)), ((), ()))
    assert dot_general_path(x, q, dims) == "fp8_f32"
    jaxpr = jax.make_jaxpr(lambda x, q: dot_general(x, q, dims))(x, q)
    # One implementation per platform (the CUDA one multiplies a K-major copy of the weight):
    # each holds one fp8 dot accumulating in float32.
    (eqn,) = [e for e in iter_eqns(jaxpr) if e.primitive.name == "lowbit_by_platform"]
    assert eqn.params["platforms"] == ("cuda",)
    for implementation in (eqn.params["default"], *eqn.params["branches"]):
        fp8_dots = [
            e
            for e in iter_eqns(implementation)
            if e.primitive.name == "dot_general"
            and all(v.aval.dtype == jnp.float8_e4m3fn for v in e.invars)
        ]
        assert len(fp8_dots) == 1 and fp8_dots[0].params["preferred_element_type"] == jnp.float32
    out, ref, xq = _both(x, q, dims)
    bound = summation_bound(jnp.abs(xq), jnp.abs(q.dequantize()), dims, 32)
    np.testing.assert_array_less(np.abs(out - ref), bound)


@pytest.mark.parametrize(
    "fmt, granularity, expected",
    [
        ("nf4", PerGroup(16, 0), "weight_only_grouped"),
        ("mxfp4", PerGroup(32, 0), "weight_only_grouped"),
        ("fp8_e4m3fn", PerChannel((1,)), "weight_only_epilogue"),
    ],
)
def test_other_formats_weight_only(fmt, granularity, expected):
    x, w = normal(0, (3, 64)), normal(1, (64, 8))
    q = weight(w, QuantConfig(format=fmt, granularity=granularity))
    dims = (((1,), (0,)), ((), ()))
    assert dot_general_path(x, q, dims) == expected
    out, ref, _ = _both(x, q, dims)
    bound = summation_bound(jnp.abs(x), jnp.abs(q.dequantize()), dims, 64)
    np.testing.assert_array_less(np.abs(out - ref), bound)


def test_int4_activations_and_bf16_output():
    x, w = normal(0, (4, 16), jnp.bfloat16), normal(1, (16, 6))
    q = weight(w, QuantConfig(format="int8", granularity=PerChannel((1,))), INT4_TOKEN)
    dims = (((1,), (0,)), ((), ()))
    assert dot_general_path(x, q, dims) == "int8_int32"
    out, ref, xq = _both(x, q, dims, jnp.float32)
    assert out.dtype == jnp.bfloat16
    # The reference dequantizes the activation to bfloat16 (each element rounded, 2**-8
    # relative) and the output is rounded to bfloat16 once more.
    magnitude = jnp.abs(xq.astype(jnp.float32)) @ jnp.abs(q.dequantize())
    np.testing.assert_array_less(
        np.abs(np.asarray(out, np.float32) - ref), 2.0**-8 * (magnitude + np.abs(ref)) + 1e-6
    )
    out32 = jax.eval_shape(
        lambda x, q: dot_general(x, q, dims, preferred_element_type=jnp.float32), x, q
    )
    assert out32.dtype == jnp.float32


def test_grouped_clipped_int4_activations():
    # w4a4's activations: one scale per 32 features of a token, each range clipped to 0.9 of
    # its absmax. Groups matching the weight's make an integer product per group.
    x, w = normal(0, (3, 64)), normal(1, (64, 8))
    act = QuantConfig(format="int4", granularity=PerGroup(32, -1), calibration=AbsMax(clip=0.9))
    q = weight(w, QuantConfig(format="int4", granularity=PerGroup(32, 0)), act)
    dims = (((1,), (0,)), ((), ()))
    out, ref, xq = _both(x, q, dims)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # Each group's largest value lands on the clipped top code: 7 steps of 0.9 * absmax / 7.
    groups = np.abs(np.asarray(x)).reshape(3, 2, 32).max(-1)
    got = np.abs(np.asarray(xq)).reshape(3, 2, 32).max(-1)
    np.testing.assert_allclose(got, 0.9 * groups, rtol=1e-5)


def test_both_qarrays_and_unsupported_layout_falls_back():
    x, w = normal(0, (3, 16)), normal(1, (16, 6))
    dims = (((1,), (0,)), ((), ()))
    qx = jit_quantize(x, "int8", granularity=PerChannel((0,)))
    qw = jit_quantize(w, "int8", granularity=PerChannel((1,)))
    assert dot_general_path(qx, qw, dims) == "int8_int32"
    out, ref, _ = _both(qx, qw, dims)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # Groups of 4 on one side and 6 on the other do not nest: reference.
    x12, w12 = normal(2, (3, 12)), normal(3, (12, 6))
    qx12 = jit_quantize(x12, "int8", granularity=PerGroup(4, 1))
    qw12 = jit_quantize(w12, "int8", granularity=PerGroup(6, 0))
    assert dot_general_path(qx12, qw12, dims) == "reference"
    out, ref, _ = _both(qx12, qw12, dims)
    np.testing.assert_array_equal(out, ref)


def test_per_tensor_activation_granularity_and_errors():
    x, w = normal(0, (3, 16)), normal(1, (16, 6))
    dims = (((1,), (0,)), ((), ()))
    per_tensor = QuantConfig(format="int8", granularity=PerTensor())
    q = weight(w, QuantConfig(format="int8", granularity=PerChannel((1,))), per_tensor)
    out, ref, _ = _both(x, q, dims)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    bad = weight(w, "int8", QuantConfig(format="int8", granularity=PerChannel((0,))))
    with pytest.raises(ValueError, match="activation granularity"):
        dot_general(x, bad, dims)
    with pytest.raises(ValueError, match="pair lhs axis"):
        dot_general(x, q, (((0,), (0,)), ((), ())))
    with pytest.raises(TypeError, match="float array or a QArray"):
        dot_general(jnp.ones((3, 16), jnp.int32), q, dims)


def test_jit_and_int8_dot_for_w8a8():
    x, w = normal(0, (2, 3, 16)), normal(1, (16, 2, 4))
    q = weight(w, QuantConfig(format="int8", granularity=PerChannel((1, 2))), UINT8_ASYM)
    dims = (((2,), (0,)), ((), ()))
    assert len(int_dots(jax.make_jaxpr(lambda x, q: dot_general(x, q, dims))(x, q))) == 1
    out, ref, _ = _both(x, q, dims)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
