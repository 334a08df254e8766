"""Gradients: frozen QArray weights (QLoRA) and QAT straight-through / quantized backward."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ops_helpers import int_dots, iter_eqns, normal, summation_bound, weight

from lowbit.ops import (
    QatWeight,
    dot_general,
    qat_dot_general,
    qat_weight,
    quantize_activation,
)
from lowbit.qarray import MinMax, PerChannel, PerGroup, PerToken, QuantConfig

LINEAR = (((1,), (0,)), ((), ()))
ATTEND = (((1,), (1,)), ((), ()))
INT8_TOKEN = QuantConfig(format="int8", granularity=PerToken())


@functools.partial(jax.jit, static_argnums=(2,))
def _qlora_grads(x, q, dims):
    """Gradients of a LoRA-adapted loss through a frozen QArray, and of the float reference."""
    a, b = normal(5, (x.shape[-1], 2)), normal(6, (2, 6))
    target = normal(7, (x.shape[0], 6))

    def loss(x, a, b, w):
        base = dot_general(x, w, dims)
        return jnp.sum((base + (x @ a) @ b - target) ** 2)

    deq = q.dequantize()
    # The reference sees the same forward value (quantized), and the weight as dequantized.
    fwd = dot_general(x, q, dims)

    def ref_loss(x, a, b):
        base = lax.dot_general(x, deq, dims)
        base = base + lax.stop_gradient(fwd - base)
        return jnp.sum((base + (x @ a) @ b - target) ** 2)

    grads = jax.grad(loss, argnums=(0, 1, 2))(x, a, b, q)
    ref = jax.grad(ref_loss, argnums=(0, 1, 2))(x, a, b)
    return grads, ref


@pytest.mark.parametrize(
    "config, activation, dims",
    [
        (QuantConfig(format="int4", granularity=PerGroup(8, 0)), None, LINEAR),
        (QuantConfig(format="int8", granularity=PerChannel((1,))), INT8_TOKEN, LINEAR),
        (
            QuantConfig(
                format="uint8", granularity=PerChannel((0,)), symmetric=False, calibration=MinMax()
            ),
            None,
            ATTEND,
        ),
    ],
)
def test_qlora_gradients_match_float_reference(config, activation, dims):
    x = normal(0, (4, 16))
    w_shape = (16, 6) if dims == LINEAR else (6, 16)
    q = weight(normal(1, w_shape), config, activation)
    grads, ref = _qlora_grads(x, q, dims)
    for g, r in zip(grads, ref, strict=True):
        scale = float(jnp.max(jnp.abs(r)))
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * scale)


def _qat(activation=None, gradient=None, shape=(16, 6)):
    w = normal(1, shape)
    config = QuantConfig(format="int8", granularity=PerChannel((1,)))
    return qat_weight(w, config, activation=activation, gradient=gradient)


@jax.jit
def _qat_grads(x, qw, g):
    out, vjp = jax.vjp(
        lambda x, v: qat_dot_general(x, dataclasses.replace(qw, value=v), LINEAR), x, qw.value
    )
    dx, dv = vjp(g)
    return out, dx, dv


def test_qat_forward_is_served_forward_and_ste_backward():
    x, g = normal(0, (4, 16)), normal(2, (4, 6))
    qw = _qat(activation=INT8_TOKEN)
    out, dx, dv = _qat_grads(x, qw, g)
    served = jax.jit(lambda x, q: dot_general(x, q, LINEAR))(x, qw.served())
    np.testing.assert_array_equal(out, served)
    # d x = g . dequantized weight^T; d value = fake-quantized x^T . g.
    xq = np.asarray(quantize_activation(x, (1,), INT8_TOKEN).dequantize())
    g, w = np.asarray(g), np.asarray(qw.qarray.dequantize())
    np.testing.assert_allclose(dx, g @ w.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dv, xq.T @ g, rtol=1e-5, atol=1e-6)


def test_qat_grad_pytree_and_integer_leaves():
    x = normal(0, (4, 16))
    qw = _qat()
    grads = jax.grad(lambda qw: qat_dot_general(x, qw, LINEAR).sum(), allow_int=True)(qw)
    assert isinstance(grads, QatWeight)
    np.testing.assert_allclose(grads.value, jnp.broadcast_to(x.sum(0)[:, None], (16, 6)), rtol=1e-5)
    assert grads.qarray.codes.dtype == jax.dtypes.float0
    assert not np.any(np.asarray(grads.qarray.scale))


def test_qat_weight_as_lhs():
    x, g = normal(0, (4, 16)), normal(2, (6, 4))
    qw = _qat()
    dims = (((0,), (1,)), ((), ()))

    @jax.jit
    def run(x, v):
        return jax.vjp(
            lambda x, v: qat_dot_general(dataclasses.replace(qw, value=v), x, dims), x, v
        )[1](g)

    dx, dv = run(x, qw.value)
    np.testing.assert_allclose(dx, g.T @ qw.qarray.dequantize().T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dv, x.T @ g.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantized_backward_int8(rounding):
    x, g = normal(0, (8, 16)), normal(2, (8, 6))
    gradient = QuantConfig(format="int8", granularity=PerToken(), rounding=rounding)
    qw = _qat(gradient=gradient)
    jaxpr = jax.make_jaxpr(_qat_grads)(x, qw, g)
    # Forward weight-only, backward: two int8 x int8 -> int32 products.
    assert len(int_dots(jaxpr)) == 2
    _, dx, dv = _qat_grads(x, qw, g)
    w = qw.qarray.dequantize()
    # Each operand of a backward product is off by at most one grid step (stochastic) or half a
    # step (nearest) of its row: |err| <= sum |a| db + |b| da + da db.
    steps = 1.0 if rounding == "stochastic" else 0.5
    dg = steps * jnp.max(jnp.abs(g), axis=1, keepdims=True) / 127
    dw_rows = 0.5 * jnp.max(jnp.abs(w), axis=1, keepdims=True) / 127
    dg_full, dw_full = jnp.broadcast_to(dg, g.shape), jnp.broadcast_to(dw_rows, w.shape)
    dx_bound = jnp.abs(g) @ dw_full.T + dg_full @ jnp.abs(w).T + dg_full @ dw_full.T
    np.testing.assert_array_less(np.abs(dx - g @ w.T), dx_bound + 1e-6)
    dx_cols = 0.5 * jnp.max(jnp.abs(x), axis=0, keepdims=True) / 127
    dg_cols = steps * jnp.max(jnp.abs(g), axis=0, keepdims=True) / 127
    dv_bound = (
        jnp.abs(x).T @ jnp.broadcast_to(dg_cols, g.shape)
        + jnp.broadcast_to(dx_cols, x.shape).T @ jnp.abs(g)
        + jnp.broadcast_to(dx_cols, x.shape).T @ (jnp.broadcast_to(dg_cols, g.shape))
    )
    np.testing.assert_array_less(np.abs(dv - x.T @ g), dv_bound + 1e-6)
    if rounding == "stochastic":
        # Deterministic for the same step, different when the cotangent changes.
        _, dx2, _ = _qat_grads(x, qw, g)
        np.testing.assert_array_equal(dx, dx2)
        _, dx3, _ = _qat_grads(x, qw, 2 * g)
        assert not np.array_equal(np.asarray(2 * dx), np.asarray(dx3))


def test_quantized_backward_fp8_e5m2():
    x, g = normal(0, (8, 16)), normal(2, (8, 6))
    gradient = QuantConfig(format="fp8_e5m2", granularity=PerToken())
    qw = _qat(gradient=gradient)
    jaxpr = jax.make_jaxpr(_qat_grads)(x, qw, g)
    fp8 = [
        e
        for e in iter_eqns(jaxpr)
        if e.primitive.name == "dot_general"
        and {v.aval.dtype for v in e.invars}
        == {jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.float8_e4m3fn)}
    ]
    assert len(fp8) == 2
    _, dx, dv = _qat_grads(x, qw, g)
    w = qw.qarray.dequantize()
    # e5m2 keeps 2 mantissa bits (relative error <= 2**-3), e4m3 3 bits (<= 2**-4) per element.
    bound = (2.0**-3 + 2.0**-4 + 2.0**-7) * (jnp.abs(g) @ jnp.abs(w).T)
    np.testing.assert_array_less(np.abs(dx - g @ w.T), bound + 1e-6)
    bound_v = (2.0**-3 + 2.0**-4 + 2.0**-7) * (jnp.abs(x).T @ jnp.abs(g))
    np.testing.assert_array_less(np.abs(dv - x.T @ g), bound_v + 1e-6)


def test_qat_errors():
    qw = _qat()
    with pytest.raises(TypeError, match="one QatWeight"):
        qat_dot_general(qw, qw, LINEAR)
    with pytest.raises(TypeError, match="QuantConfig or None"):
        qat_weight(normal(1, (4, 4)), "int8", gradient="int8")


def test_summation_bound_helper_is_tight_enough():
    # The helper's bound must not be vacuous: a real product's error is far below it, and
    # an error of one percent is far above it.
    x, w = normal(0, (3, 16)), normal(1, (16, 4))
    bound = summation_bound(jnp.abs(x), jnp.abs(w), LINEAR, 16)
    assert np.all(bound < 1e-2 * np.abs(np.asarray(x @ w)).max())
