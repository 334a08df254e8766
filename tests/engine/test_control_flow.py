"""Quantized values through scan (xs, consts, carry), while, cond/switch and shard_map."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import all_eqns, jit_dequantize, jit_quantize
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lowbit.engine import EngineFallbackError, EngineReport, interpret, trace_report
from lowbit.ops import qat_weight
from lowbit.qarray import PerChannel, PerGroup, PerTensor, QArray, QuantConfig

_K = jax.random.split(jax.random.PRNGKey(2), 3)
STACK = jax.random.normal(_K[0], (3, 16, 16)) / 4
W = jax.random.normal(_K[1], (16, 16)) / 4
X = jax.random.normal(_K[2], (4, 16))

Q_STACK = jit_quantize(STACK, "int4", PerGroup(8, axis=1))  # scale [3, 2, 16]: one per layer
Q_STACK_SHARED = jit_quantize(STACK, "int8", PerTensor())  # scale [1, 1, 1]: shared by layers
Q_W = jit_quantize(W, "int8", PerChannel((-1,)))
W_DEQ = jit_dequantize(Q_W)


def scan_layers(stack, w, x):
    def body(h, layer):
        return jnp.tanh(h @ layer) @ w, jnp.sum(h)  # `w` is a scan const

    h, sums = jax.lax.scan(body, x, stack)
    return h, sums


def carry_weight(w, x):
    def body(carry, _):
        h, weight = carry
        return (jnp.tanh(h @ weight), weight), None  # the weight rides in the carry

    (h, weight), _ = jax.lax.scan(body, (x, w), None, length=3)
    return h, weight


def while_model(w, x):
    def cond(state):
        i, h, _ = state
        return (i < 4) & (jnp.max(jnp.abs(h)) < 1e3)

    def body(state):
        i, h, weight = state
        return i + 1, jnp.tanh(h @ weight) @ w.T, weight

    return jax.lax.while_loop(cond, body, (0, x, w))[1]


def cond_model(w, x, flag):
    return jax.lax.cond(flag, lambda w, x: x @ w, lambda w, x: x @ w.T * 2, w, x)


def switch_model(w, x, index):
    return jax.lax.switch(index, [lambda w, x: x @ w, lambda w, x: -(x @ w), lambda w, x: x], w, x)


def _check(fn, args, deq_args, expected_dots):
    report = EngineReport()
    out = jax.jit(interpret(fn, strict=True, report=report))(*args)
    ref = jax.jit(fn)(*deq_args)
    assert report.fallbacks == {} and report.materialized == 0
    assert sum(report.quantized_ops.values()) == expected_dots
    is_q = lambda v: isinstance(v, QArray)
    for got, want in zip(jax.tree.leaves(out, is_leaf=is_q), jax.tree.leaves(ref), strict=True):
        got = jit_dequantize(got)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    return out


@pytest.mark.parametrize("stack", [Q_STACK, Q_STACK_SHARED], ids=["per_layer", "shared"])
def test_scan_over_stacked_quantized_layers(stack):
    _check(scan_layers, (stack, Q_W, X), jit_dequantize((stack, Q_W, X)), 2)


def test_quantized_weight_in_scan_carry_stays_packed():
    h, weight = _check(carry_weight, (Q_W, X), (W_DEQ, X), 1)
    assert isinstance(weight, QArray) and weight.codes.dtype == jnp.int8


def test_carry_that_changes_type_is_dequantized_once_and_counted():
    def doubling(w, x):
        return jax.lax.scan(lambda c, _: (c * 2, None), w, None, length=2)[0] @ x.T

    report = trace_report(doubling, Q_W, X)
    assert report.fallbacks == {"scan": 1}
    with pytest.raises(EngineFallbackError, match="scan"):
        trace_report(doubling, Q_W, X, strict=True)


def test_while_loop_with_quantized_const_and_carry():
    _check(while_model, (Q_W, X), (W_DEQ, X), 2)


@pytest.mark.parametrize("flag", [True, False])
def test_cond_with_quantized_operands(flag):
    _check(cond_model, (Q_W, X, flag), (W_DEQ, X, flag), 2)


def test_switch_branches_disagreeing_on_outputs_dequantize_only_the_output():
    def pick(w, index):
        return jax.lax.switch(index, [lambda w: w, lambda w: w * 2], w)

    report = EngineReport()
    out = jax.jit(interpret(pick, report=report))(Q_W, 0)
    np.testing.assert_allclose(out, W_DEQ, rtol=1e-6)
    assert report.fallbacks["mul"] == 1 and report.fallbacks["cond"] == 1
    _check(switch_model, (Q_W, X, 1), (W_DEQ, X, 1), 2)


_MESH = Mesh(np.array(jax.devices()[:4]), ("x",))


def _sharded_matmul(w, x, w_spec):
    body = lambda w, x: jnp.tanh(x @ w)
    return jax.shard_map(body, mesh=_MESH, in_specs=(w_spec, P()), out_specs=P(None, "x"))(w, x)


@pytest.mark.parametrize("qname", ["int8_channel", "int4_group"])
def test_shard_map_shards_codes_and_scales_together(qname):
    w = Q_W if qname == "int8_channel" else jit_quantize(W, "int4", PerGroup(8, axis=0))
    fn = lambda w, x: _sharded_matmul(w, x, P(None, "x"))  # output channels over 4 devices
    _check(fn, (w, X), (jit_dequantize(w), X), 1)
    jaxpr = jax.make_jaxpr(interpret(fn))(w, X)
    (eqn,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "shard_map"]
    entering = {(v.aval.shape, v.aval.dtype) for v in eqn.invars}
    assert (w.codes.shape, w.codes.dtype) in entering  # codes enter packed
    assert (W.shape, W.dtype) not in entering  # and no float copy of the weight


def test_shard_map_splitting_blocks_falls_back_counted():
    w = jit_quantize(W, "int4", PerGroup(8, axis=0))  # blocks of 8 rows; 4 shards of 4 rows
    body = lambda w, x: jax.lax.psum(x @ w, "x")  # contraction split over 4 devices
    fn = lambda w, x: jax.shard_map(
        body, mesh=_MESH, in_specs=(P("x", None), P(None, "x")), out_specs=P()
    )(w, x)
    report = EngineReport()
    out = jax.jit(interpret(fn, report=report))(w, X)
    assert report.fallbacks == {"shard_map": 1}
    assert "whole blocks" in report.fallback_details[0]
    np.testing.assert_allclose(out, X @ jit_dequantize(w), rtol=1e-4, atol=1e-4)


def test_qat_weights_through_scan_and_transpose():
    config = QuantConfig(format="int4", granularity=PerGroup(8, axis=2))  # per layer and row

    def apply(stack, x):
        body = lambda h, layer: (jnp.tanh(h @ layer.T), None)
        return jax.lax.scan(body, x, stack)[0]

    def loss(value, x):
        stack = qat_weight(value, config)
        return jnp.sum(interpret(apply, strict=True)(stack, x) ** 2)

    def fake_quant_loss(value, x):  # the same forward values, straight-through gradient
        return jnp.sum(apply(qat_weight(value, config).dequantize(), x) ** 2)

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(STACK, X)
    want = jax.jit(jax.value_and_grad(fake_quant_loss, argnums=(0, 1)))(STACK, X)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    report = trace_report(apply, qat_weight(STACK, config), X, strict=True)
    assert report.quantized_ops == {"dot_general:qat": 1}
    assert report.layout_ops == {"transpose": 1}


@pytest.mark.parametrize("per_layer", [True, False], ids=["per_layer", "shared"])
def test_scan_over_stacked_weights_carries_their_input_scale(per_layer):
    scale = jnp.linspace(0.5, 2.0, 16, dtype=jnp.float32).reshape(1, 16, 1)
    if per_layer:
        scale = scale * jnp.arange(1.0, 4.0).reshape(3, 1, 1)
    q = dataclasses.replace(Q_STACK, input_scale=scale).check()

    def apply(stack, x):
        return jax.lax.scan(lambda h, layer: (jnp.tanh(h @ layer), None), x, stack)[0]

    report = EngineReport()
    out = jax.jit(interpret(apply, strict=True, report=report))(q, X)
    np.testing.assert_allclose(out, apply(jit_dequantize(q), X), rtol=1e-4, atol=1e-5)
    assert report.fallbacks == {}
