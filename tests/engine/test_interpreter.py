"""`interpret` on plain functions: quantized matmuls, fallbacks, strict mode, reports, gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import all_eqns, jit_dequantize, jit_quantize

import lowbit.qarray
from lowbit.engine import EngineFallbackError, EngineReport, interpret, trace_report
from lowbit.ops import _accelerated, qat_weight
from lowbit.qarray import PerChannel, PerGroup, PerToken, QArray, QuantConfig

_KEYS = jax.random.split(jax.random.PRNGKey(0), 4)
W1 = jax.random.normal(_KEYS[0], (32, 64)) / np.sqrt(32)
W2 = jax.random.normal(_KEYS[1], (64, 32)) / np.sqrt(64)
X = jax.random.normal(_KEYS[2], (8, 32))
W8A8 = QuantConfig(format="int8", granularity=PerToken())


def mlp(params, x):
    @jax.jit  # jit inside the model: the engine follows weights into it
    def up(h):
        return jax.nn.gelu(h @ params["w1"])

    return up(x) @ params["w2"] + params["b"]


FLOAT = {"w1": W1, "w2": W2, "b": jnp.full((32,), 0.1)}


def _quantized(fmt, granularity, activation=None):
    return {
        "w1": jit_quantize(W1, fmt, granularity, activation=activation),
        "w2": jit_quantize(W2, fmt, granularity, activation=activation),
        "b": FLOAT["b"],
    }


PARAMS = {
    "int8_channel": _quantized("int8", PerChannel((-1,))),
    "int4_group": _quantized("int4", PerGroup(16, axis=0)),
    "w8a8": _quantized("int8", PerChannel((-1,)), activation=W8A8),
}
# Relative error bounds: 8-bit per-channel ~ 2**-8 relative per weight (accumulated over a
# 2-layer MLP stays well under 2%); 4-bit groups of 16 ~ 1/15 of each group's range per weight.
BOUNDS = {"int8_channel": 0.02, "int4_group": 0.15, "w8a8": 0.03}

_MLP = jax.jit(interpret(mlp, strict=True))
_FLOAT_MLP = jax.jit(mlp)


def _rel_err(out, ref):
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_mlp_matches_float_within_quantization_error(name):
    ref = _FLOAT_MLP(FLOAT, X)
    out = _MLP(PARAMS[name], X)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _rel_err(out, ref) < BOUNDS[name]
    # The quantized model is the float model on the dequantized weights, up to float rounding
    # (and, for w8a8, the per-token activation rounding).
    deq = jit_dequantize(PARAMS[name])
    assert _rel_err(out, _FLOAT_MLP(deq, X)) < (0.02 if name == "w8a8" else 1e-5)


def test_report_counts_quantized_dots_and_no_fallbacks():
    report = trace_report(mlp, PARAMS["w8a8"], X, strict=True)
    assert report.quantized_ops == {"dot_general:int8_int32": 2}
    assert report.fallbacks == {} and report.materialized == 0
    report = trace_report(mlp, PARAMS["int4_group"], X)
    assert report.quantized_ops == {"dot_general:weight_only_grouped": 2}


def test_report_counts_products_a_gpu_kernel_leaves_to_xla(monkeypatch):
    """A weight the CUDA kernel cannot tile (N = 40) is counted with the kernel's reason;
    nothing is dequantized on the platform that traced it."""
    monkeypatch.setattr(_accelerated, "GPU_MIN_WEIGHT_ELEMENTS", 0)  # a shape reason, not size
    w = lowbit.qarray.quantize(jnp.ones((64, 40)), "int4", granularity=PerGroup(32, 0))
    report = EngineReport()
    fn = jax.jit(interpret(lambda x, w: x @ w, report=report))
    fn(jnp.ones((2, 64)), w)
    [(why, count)] = report.declined.items()
    assert why.startswith("cuda: pallas: ") and "N=40" in why and count == 1
    assert report.num_fallbacks == 0 and "kernels not taken" in report.summary()


def test_w8a8_jaxpr_has_int8_dots():
    jaxpr = jax.make_jaxpr(interpret(mlp))(PARAMS["w8a8"], X)
    int8_dots = [
        e
        for e in all_eqns(jaxpr)
        if e.primitive.name == "dot_general" and all(v.aval.dtype == jnp.int8 for v in e.invars)
    ]
    assert len(int8_dots) == 2
    assert all(e.outvars[0].aval.dtype == jnp.int32 for e in int8_dots)


@pytest.mark.parametrize("name", ["int8_channel", "int4_group"])
def test_weight_only_never_materializes_a_float_weight(name):
    jaxpr = jax.make_jaxpr(interpret(mlp))(PARAMS[name], X)
    weight_shapes = {W1.shape, W2.shape, W1.T.shape, W2.T.shape}
    for eqn in all_eqns(jaxpr):
        for var in eqn.outvars:
            aval = var.aval
            floating = jnp.issubdtype(aval.dtype, jnp.floating)
            assert not (floating and tuple(aval.shape) in weight_shapes), (eqn.primitive, aval)
    # Integer codes are converted only group-wise (4-bit) or not at all (8-bit): the stored
    # int8 codes feed the dot directly.
    if name == "int8_channel":
        dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
        assert {v.aval.dtype for e in dots for v in e.invars} >= {jnp.dtype(jnp.int8)}


def _cumsum_model(params, x):
    return jnp.cumsum(params["w1"], axis=0).sum() + x @ params["w1"]


def test_fallback_is_counted_and_dequantizes():
    report = EngineReport()
    out = jax.jit(interpret(_cumsum_model, report=report))(PARAMS["int8_channel"], X)
    assert report.fallbacks == {"cumsum": 1}
    assert report.materialized == 1
    assert report.quantized_ops == {"dot_general:weight_only_epilogue": 1}
    assert "test_interpreter.py" in report.fallback_details[0]
    deq = jit_dequantize({"w1": PARAMS["int8_channel"]["w1"]})
    np.testing.assert_allclose(out, _cumsum_model(deq, X), rtol=1e-5, atol=1e-4)


def test_strict_mode_names_primitive_value_and_location():
    with pytest.raises(EngineFallbackError) as info:
        trace_report(_cumsum_model, PARAMS["int4_group"], X, strict=True)
    err = info.value
    assert err.primitive == "cumsum"
    assert "int4" in err.value and "(32, 64)" in err.value
    assert "test_interpreter.py" in err.location and "_cumsum_model" in err.location
    assert "cumsum" in str(err) and "strict" in str(err)


def test_report_is_reset_per_trace_and_kwargs_and_static_leaves_work():
    report = EngineReport()

    def fn(x, *, params, scale, name):
        assert isinstance(scale, float) and name == "static"  # Python leaves stay Python
        return scale * mlp(params, x)

    run = interpret(fn, report=report)
    for _ in range(2):
        out = jax.eval_shape(
            lambda x, p: run(x, params=p, scale=2.0, name="static"), X, PARAMS["int8_channel"]
        )
        assert report.quantized_ops == {"dot_general:weight_only_epilogue": 2}
    assert out.shape == (8, 32)


def test_quantized_outputs_stay_quantized():
    q = PARAMS["int4_group"]["w1"]
    out = interpret(lambda w: {"t": w.T, "r": w.reshape(2, 16, 64)})(q)
    assert isinstance(out["t"], QArray) and out["t"].shape == (64, 32)
    assert isinstance(out["r"], QArray) and out["r"].block_shape == (1, 16, 1)


def _lora_loss(frozen, lora, x):
    h = x @ frozen["w1"] + (x @ lora["a"]) @ lora["b"]
    return jnp.sum(jnp.tanh(h @ frozen["w2"]) ** 2)


_LORA = {"a": 0.1 * jax.random.normal(_KEYS[3], (32, 4)), "b": jnp.ones((4, 64)) * 0.05}
_LORA_GRAD = jax.jit(jax.grad(interpret(_lora_loss), argnums=(1, 2)))
_FLOAT_LORA_GRAD = jax.jit(jax.grad(_lora_loss, argnums=(1, 2)))


@pytest.mark.parametrize("name", ["int8_channel", "int4_group"])
def test_gradients_wrt_float_inputs_match_dequantized_model(name):
    frozen = {k: PARAMS[name][k] for k in ("w1", "w2")}
    deq = jit_dequantize(frozen)
    grads = _LORA_GRAD(frozen, _LORA, X)
    expected = _FLOAT_LORA_GRAD(deq, _LORA, X)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5)


def test_qat_weight_gradient_flows_to_value_through_transpose():
    config = QuantConfig(format="int8", granularity=PerChannel((0,)))

    def loss(value, x):
        w = qat_weight(value, config)
        return jnp.sum(interpret(lambda w, x: jnp.tanh(x @ w.T), strict=True)(w, x) ** 2)

    def reference(value, x):
        w = qat_weight(value, config).dequantize()  # fake quant with a straight-through grad
        return jnp.sum(jnp.tanh(x @ w.T) ** 2)

    value = W1.T  # [64, 32], per-channel along the rows = output channels after .T
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(value, X)
    want = jax.jit(jax.grad(reference, argnums=(0, 1)))(value, X)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_interpret_rejects_non_callables():
    with pytest.raises(TypeError, match="callable"):
        interpret(PARAMS)


def test_astype_keeps_weights_packed():
    q = dataclasses.replace(PARAMS["int8_channel"]["w1"])
    report = trace_report(lambda w, x: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16), q, X)
    assert report.layout_ops == {"convert_element_type": 1} and report.fallbacks == {}


def test_docstring_example_runs():
    example = [
        line.strip()[4:]
        for line in interpret.__doc__.split("Example:")[1].splitlines()
        if line.strip().startswith(">>> ")
    ]
    namespace = {
        "jax": jax,
        "lowbit": lowbit,
        "PerChannel": PerChannel,
        "interpret": interpret,
        "w": W1,
        "x": X,
    }
    exec("\n".join(example), namespace)  # noqa: S102 - the docstring's own example
    np.testing.assert_allclose(namespace["y"], X @ W1, rtol=0.02, atol=0.05)
