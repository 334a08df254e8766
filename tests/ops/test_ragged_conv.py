"""`ragged_dot` (MoE experts) and `conv_general_dilated` with quantized weights, and their QAT
twins."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ops_helpers import EPS32, int_dots, normal, weight

from lowbit.ops import (
    conv_general_dilated,
    conv_general_dilated_path,
    conv_general_dilated_reference,
    qat_conv_general_dilated,
    qat_ragged_dot_general,
    qat_weight,
    quantize_activation,
    ragged_dot,
    ragged_dot_general_path,
    ragged_dot_general_reference,
)
from lowbit.qarray import MinMax, PerChannel, PerGroup, PerTensor, PerToken, QuantConfig

INT8_TOKEN = QuantConfig(format="int8", granularity=PerToken())
UINT8_ASYM = QuantConfig(
    format="uint8", granularity=PerToken(), symmetric=False, calibration=MinMax()
)
EXPERT_CHANNEL = PerChannel((0, 2))
GROUP_SIZES = jnp.array([3, 0, 2, 2], jnp.int32)  # 7 of 8 rows used; expert 1 is empty

RAGGED = {
    "weight_only_int4": (
        QuantConfig(format="int4", granularity=EXPERT_CHANNEL),
        None,
        "weight_only_epilogue",
    ),
    "w8a8": (QuantConfig(format="int8", granularity=EXPERT_CHANNEL), INT8_TOKEN, "int8_int32"),
    "w8a8_asym": (
        QuantConfig(
            format="uint8", granularity=EXPERT_CHANNEL, symmetric=False, calibration=MinMax()
        ),
        UINT8_ASYM,
        "int8_int32",
    ),
    "grouped_reference": (
        QuantConfig(format="int8", granularity=PerGroup(4, 1)),
        None,
        "reference",
    ),
}


@functools.partial(jax.jit, static_argnums=(2,))
def _ragged_pair(x, w, name):
    config, activation, _ = RAGGED[name]
    q = weight(w, config, activation)
    return ragged_dot(x, q, GROUP_SIZES), ragged_dot_general_reference(x, q, GROUP_SIZES), q


@pytest.mark.parametrize("name", list(RAGGED))
def test_ragged_dot_matches_reference(name):
    x, w = normal(0, (8, 16)), normal(1, (4, 16, 5))
    config, activation, path = RAGGED[name]
    q = jax.eval_shape(lambda w: weight(w, config, activation), w)
    assert ragged_dot_general_path(x, q) == path
    out, ref, q = _ragged_pair(x, w, name)
    assert out.shape == (8, 5) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out[7], 0.0)  # row past sum(group_sizes)
    magnitude = lax.ragged_dot(jnp.abs(x), jnp.abs(q.dequantize()), GROUP_SIZES)
    # Activation rounding is shared with the reference; the rest is float summation order.
    if activation is not None:
        magnitude = magnitude * 2
    np.testing.assert_array_less(np.abs(out - ref), (2 * 16 + 8) * EPS32 * magnitude + 1e-30)
    if path == "int8_int32":
        jaxpr = jax.make_jaxpr(lambda x, q: ragged_dot(x, q, GROUP_SIZES))(x, q)
        assert [e.primitive.name for e in int_dots(jaxpr)] == ["ragged_dot_general"]


def test_ragged_gradients_qlora_and_qat():
    x, w = normal(0, (8, 16)), normal(1, (4, 16, 5))
    g = normal(2, (8, 5))
    q = weight(w, QuantConfig(format="int8", granularity=EXPERT_CHANNEL), INT8_TOKEN)
    qw = qat_weight(
        w, QuantConfig(format="int8", granularity=EXPERT_CHANNEL), activation=INT8_TOKEN
    )

    @jax.jit
    def run(x, v):
        dx_frozen = jax.vjp(lambda x: ragged_dot(x, q, GROUP_SIZES), x)[1](g)[0]
        qat = lambda x, v: qat_ragged_dot_general(x, dataclasses.replace(qw, value=v), GROUP_SIZES)
        out, vjp = jax.vjp(qat, x, v)
        return dx_frozen, out, ragged_dot(x, qw.served(), GROUP_SIZES), *vjp(g)

    dx_frozen, out, served, dx, dv = run(x, qw.value)
    deq = q.dequantize()
    expect_dx = lax.ragged_dot(g, jnp.swapaxes(deq, 1, 2), GROUP_SIZES)
    np.testing.assert_allclose(dx_frozen, expect_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out, served)
    np.testing.assert_allclose(dx, expect_dx, rtol=1e-5, atol=1e-6)
    xq = np.asarray(quantize_activation(x, (1,), INT8_TOKEN).dequantize())
    g_np = np.asarray(g)
    ends = np.cumsum(np.asarray(GROUP_SIZES))
    starts = ends - np.asarray(GROUP_SIZES)
    for e in range(4):
        rows = slice(int(starts[e]), int(ends[e]))
        np.testing.assert_allclose(dv[e], xq[rows].T @ g_np[rows], rtol=1e-5, atol=1e-6)


def test_ragged_quantized_backward_int8():
    x, w, g = normal(0, (8, 16)), normal(1, (4, 16, 5)), normal(2, (8, 5))
    qw = qat_weight(
        w,
        QuantConfig(format="int8", granularity=EXPERT_CHANNEL),
        gradient=QuantConfig(format="int8", granularity=PerToken()),
    )

    def grads(x, v):
        qat = lambda x, v: qat_ragged_dot_general(x, dataclasses.replace(qw, value=v), GROUP_SIZES)
        return jax.vjp(qat, x, v)[1](g)

    jaxpr = jax.make_jaxpr(grads)(x, qw.value)
    assert len(int_dots(jaxpr)) == 2  # d x and d value, both int8 x int8 -> int32
    dx, dv = jax.jit(grads)(x, qw.value)
    deq = qw.qarray.dequantize()
    expect_dx = lax.ragged_dot(g, jnp.swapaxes(deq, 1, 2), GROUP_SIZES)
    # Two int8 roundings per product (half a step of the row / column maximum each).
    tol = 2 * 0.5 / 127 * 1.01
    mag_dx = lax.ragged_dot(
        jnp.abs(g).max(1, keepdims=True) * jnp.ones_like(g),
        jnp.abs(jnp.swapaxes(deq, 1, 2)).max(1, keepdims=True)
        * jnp.ones_like(jnp.swapaxes(deq, 1, 2)),
        GROUP_SIZES,
    )
    np.testing.assert_array_less(np.abs(dx - expect_dx), tol * mag_dx + 1e-6)
    ends = np.cumsum(np.asarray(GROUP_SIZES))
    starts = ends - np.asarray(GROUP_SIZES)
    x_np, g_np = np.asarray(x), np.asarray(g)
    for e in range(4):
        rows = slice(int(starts[e]), int(ends[e]))
        exact = x_np[rows].T @ g_np[rows]
        mag = (rows.stop - rows.start) * np.abs(x_np).max(0)[:, None] * np.abs(g_np).max(0)[None]
        np.testing.assert_array_less(np.abs(dv[e] - exact), tol * mag + 1e-6)


CONV = dict(window_strides=(1, 2), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
CONV_MODES = {
    "weight_only": (None, "weight_only_epilogue"),
    "w8a8_per_example": (INT8_TOKEN, "int8_int32"),
    "w8a8_asym_per_tensor": (
        QuantConfig(format="uint8", granularity=PerTensor(), symmetric=False, calibration=MinMax()),
        "int8_int32",
    ),
}


@functools.partial(jax.jit, static_argnums=(2,))
def _conv_pair(x, w, mode):
    q = weight(w, QuantConfig(format="int8", granularity=PerChannel((3,))), CONV_MODES[mode][0])
    return (
        conv_general_dilated(x, q, **CONV),
        conv_general_dilated_reference(x, q, **CONV),
        q.dequantize(),
    )


@pytest.mark.parametrize("mode", list(CONV_MODES))
def test_conv_matches_reference(mode):
    x, w = normal(0, (2, 5, 6, 3)), normal(1, (3, 3, 3, 4))
    activation, path = CONV_MODES[mode]
    q = jax.eval_shape(
        lambda w: weight(w, QuantConfig(format="int8", granularity=PerChannel((3,))), activation), w
    )
    assert conv_general_dilated_path(x, q, **CONV) == path
    out, ref, deq = _conv_pair(x, w, mode)
    assert out.shape == lax.conv_general_dilated(x, w, **CONV).shape
    magnitude = lax.conv_general_dilated(jnp.abs(x), jnp.abs(deq), **CONV)
    bound = (2 * 27 + 8) * EPS32 * magnitude * (1 if activation is None else 2)
    np.testing.assert_array_less(np.abs(out - ref), bound + 1e-30)
    if path == "int8_int32":
        jaxpr = jax.make_jaxpr(lambda x, q: conv_general_dilated(x, q, **CONV))(
            x, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), q)
        )
        names = [e.primitive.name for e in int_dots(jaxpr)]
        # Asymmetric activations add the tap-count convolution of the zero point.
        assert names == ["conv_general_dilated"] * (2 if "asym" in mode else 1)


def test_conv_qat_and_input_gradient():
    x, w = normal(0, (2, 5, 6, 3)), normal(1, (3, 3, 3, 4))
    g = normal(2, lax.conv_general_dilated(x, w, **CONV).shape)
    qw = qat_weight(
        w, QuantConfig(format="int8", granularity=PerChannel((3,))), activation=INT8_TOKEN
    )
    # The equation params the engine passes, as the float program records them.
    eqn = jax.make_jaxpr(lambda x, w: lax.conv_general_dilated(x, w, **CONV))(x, w).eqns[-1]
    params = dict(eqn.params)

    @jax.jit
    def run(x, v):
        qat = lambda x, v: qat_conv_general_dilated(x, dataclasses.replace(qw, value=v), **params)
        out, vjp = jax.vjp(qat, x, v)
        frozen = jax.vjp(lambda x: conv_general_dilated(x, qw.served(), **params), x)[1](g)[0]
        return out, conv_general_dilated(x, qw.served(), **params), frozen, *vjp(g)

    out, served, frozen, dx, dv = run(x, qw.value)
    np.testing.assert_array_equal(out, served)
    deq = qw.qarray.dequantize()
    fn = lambda x, w: lax.conv_general_dilated(x, w, **CONV)
    expect_dx = jax.vjp(lambda x: fn(x, deq), x)[1](g)[0]
    np.testing.assert_allclose(dx, expect_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(frozen, expect_dx, rtol=1e-5, atol=1e-5)
    assert dv.shape == w.shape and np.all(np.isfinite(dv))
    with pytest.raises(ValueError, match="gradient=None"):
        qat_conv_general_dilated(x, qat_weight(w, "int8", gradient=INT8_TOKEN), **params)
