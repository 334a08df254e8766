"""PTQ: quantize_params / quantize_model / run on NNX, Linen and plain functions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from api_models import LinenMLP, init, linear
from flax import nnx

import lowbit
from lowbit.api import param_uses, quantize, quantize_model, quantize_params, run
from lowbit.engine import EngineReport, trace_report
from lowbit.formats import get_format
from lowbit.qarray import PerChannel, QArray, QuantConfig
from lowbit.recipes import Recipe, Rule, preset, preset_names


def rel_error(y, ref):
    return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))


def _bound(recipe):
    """Relative output error bound from the weight format's resolution.

    A b-bit absmax grid has step ~ 2 * 3 sigma / 2**b over Gaussian-like weights, so a relative
    RMS error ~ step / sqrt(12) / sigma: ~1% at 8 bits, ~15% at 4 bits; float formats with m
    mantissa bits have a relative error ~ 2**-(m+1). Bounds take ~2x margin (errors of two layers
    add) and cover activation quantization of the same width.
    """
    fmt = get_format(recipe.rules[1].weight.format)
    if fmt.name.startswith("fp8"):
        return 0.08
    return 0.03 if fmt.bits >= 8 else 0.35 if fmt.bits >= 4 else 0.7


PRESETS = [
    n
    for n in preset_names()
    if n not in ("intmp", "float") and all(r.algorithm is None for r in preset(n).rules)
]
ALGORITHM_PRESETS = [
    n
    for n in preset_names()
    if n != "intmp" and any(r.algorithm for r in preset(n).rules) and preset(n).rotate is None
]


def test_a_rotating_preset_is_refused_on_a_params_tree(mlp):
    # A rotation needs a decoder (lowbit.serving.rotated_model); never silently dropped.
    with pytest.raises(ValueError, match="rotate='hadamard'.*rotate it first"):
        quantize_model(mlp, "int4w_g64_rot_gptq")


@pytest.mark.parametrize("name", ALGORITHM_PRESETS)
def test_algorithm_presets_run_their_algorithm_or_ask_for_data(name, mlp):
    # Never silently rounded to nearest: a data-free algorithm runs, the others ask for data.
    if any(r.algorithm is not None and r.algorithm.needs_data for r in preset(name).rules):
        with pytest.raises(
            ValueError, match=r"rule \d+ \(path=.*needs calibration data.*calibration="
        ):
            quantize_model(mlp, name)
        return
    report = lowbit.algorithms.AlgorithmReport()
    quantize_model(mlp, name, report=report)
    assert report.applied and all(what.startswith("hqq") for what in report.applied.values())


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_quantizes_an_nnx_mlp(name, mlp, mlp_input, mlp_output):
    qmodel = quantize_model(mlp, name)
    kernels = [layer.kernel for layer in qmodel.state["layers"].values()]
    assert all(isinstance(k.get_value(), QArray) for k in kernels)
    biases = [layer.bias for layer in qmodel.state["layers"].values()]
    assert not any(isinstance(b.get_value(), QArray) for b in biases)
    y, ref = qmodel(mlp_input), mlp_output
    assert y.shape == ref.shape and y.dtype == ref.dtype
    error = rel_error(y, ref)
    assert 0 < error < _bound(preset(name)), error
    if preset(name).rules[1].activation is None:
        # Weight-only: exactly the float model on the dequantized weights, up to f32 rounding.
        assert rel_error(y, qmodel.dequantized()(mlp_input)) < 1e-5


def test_quantize_model_nnx_strict_jit_and_int8_dots(mlp, mlp_input):
    qmodel = quantize_model(mlp, "int8", strict=True)
    graphdef, state = qmodel.graphdef, qmodel.state
    fn = lambda s, x: nnx.merge(graphdef, s)(x)
    report = trace_report(fn, state, mlp_input, strict=True)
    assert report.num_fallbacks == 0 and report.materialized == 0
    assert report.num_quantized_ops == 2
    # w8a8: the matmuls in the jaxpr read int8 operands on both sides.
    jaxpr = jax.make_jaxpr(run(fn))(state, mlp_input)
    int8_dots = [
        e
        for e in _eqns(jaxpr.jaxpr)
        if e.primitive.name == "dot_general" and all(v.aval.dtype == jnp.int8 for v in e.invars)
    ]
    assert len(int8_dots) == 2
    # A quantized model is an NNX module: it goes through nnx.jit and jax.jit as a value.
    assert isinstance(qmodel, nnx.Module)
    y = jax.jit(lambda m, x: m(x))(qmodel, mlp_input)
    np.testing.assert_array_equal(y, qmodel(mlp_input))
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(qmodel, mlp_input), y)
    # The original module is untouched.
    assert not isinstance(mlp.layers[0].kernel.get_value(), QArray)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_quantize_params_plain_function_packs_and_dispatch():
    w = jax.random.normal(jax.random.key(0), (64, 32))
    params = {"dense": {"kernel": w, "bias": jnp.zeros(32)}}
    qparams = quantize(params, "int4w_g64")
    kernel = qparams["dense"]["kernel"]
    assert kernel.packed_axis is not None and kernel.codes.dtype == jnp.uint8
    assert kernel.nbytes < w.nbytes / 6  # 4-bit codes + one f32 scale per 64 weights
    x = jax.random.normal(jax.random.key(1), (4, 64))
    fn = lambda p, x: x @ p["dense"]["kernel"] + p["dense"]["bias"]
    y = jax.jit(run(fn))(qparams, x)
    np.testing.assert_allclose(y, x @ kernel.dequantize(), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="lowbit.qarray.quantize"):
        quantize(w, QuantConfig(format="int8"))


def test_quantize_params_raises_on_shapes_it_cannot_take():
    params = {"a": {"kernel": jnp.ones((96, 8))}, "b": {"kernel": jnp.ones((64, 8))}}
    with pytest.raises(ValueError, match=r"a/kernel \(96, 8\): rule 1: group size 64"):
        quantize_params(params, "int4w_g64")
    keep = Recipe(rules=(Rule(path="a/.*"), *preset("int4w_g64").rules))
    qparams = quantize_params(params, keep)
    assert isinstance(qparams["b"]["kernel"], QArray) and qparams["a"]["kernel"].shape == (96, 8)


def test_ops_filter_keeps_gather_only_embedding():
    vocab = jax.random.normal(jax.random.key(3), (50, 64))
    fn = lambda p, ids: jnp.take(p["embedding"], ids, axis=0) @ p["head"]["kernel"]
    params = {"embedding": vocab, "head": {"kernel": jnp.ones((64, 10))}}
    ids = jnp.arange(6)
    uses = param_uses(fn, params, ids)
    assert uses == {"embedding": {"gather"}, "head/kernel": {"dot_general"}}
    int8 = QuantConfig(format="int8", granularity=PerChannel((-1,)))
    recipe = Recipe(rules=(Rule(path=".*", weight=int8, ops=("dot_general",)),))
    qparams = quantize_params(params, recipe, uses=uses)
    assert not isinstance(qparams["embedding"], QArray)
    assert isinstance(qparams["head"]["kernel"], QArray)
    report = recipe.report(params, uses)
    assert "feeds only gather" in report["embedding"].reason


def test_linen_both_forms(mlp_input):
    module = LinenMLP()
    variables = jax.jit(module.init)(jax.random.key(0), mlp_input)
    ref = module.apply(variables, mlp_input)
    qmodel = quantize_model(module, "int8w", params=variables)
    apply_fn, qparams = qmodel
    assert isinstance(qparams["params"]["Dense_0"]["kernel"], QArray)
    y = apply_fn(qparams, mlp_input)
    np.testing.assert_array_equal(y, qmodel(mlp_input))
    np.testing.assert_array_equal(apply_fn(qparams, mlp_input, negate=True), -y)
    assert 0 < rel_error(y, ref) < 0.03
    with pytest.raises(TypeError, match="params=variables"):
        quantize_model(module, "int8w")


def test_transformer_block_w8a8_strict(block):
    x = jax.random.normal(jax.random.key(4), (2, 8, 64))
    qmodel = quantize_model(block, "int8", strict=True)
    graphdef = qmodel.graphdef
    report = trace_report(lambda s, x: nnx.merge(graphdef, s)(x), qmodel.state, x, strict=True)
    assert report.num_fallbacks == 0
    assert report.num_quantized_ops == 7  # q, k, v, o, gate, up, down
    ref = nnx.jit(lambda m, x: m(x))(block, x)
    y = qmodel(x)
    # The residual carries x exactly; the quantized branches add ~1% error each.
    assert 0 < rel_error(y, ref) < 0.03


def test_stacked_weights_in_scan_get_per_layer_scales():
    layers, dim = 3, 32
    w = (
        jax.random.normal(jax.random.key(5), (layers, dim, dim))
        * jnp.array([1.0, 10.0, 0.1])[:, None, None]
    )
    params = {"stack": {"kernel": w}}

    def fn(p, x):
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, p["stack"]["kernel"])[0]

    int8 = QuantConfig(format="int8")  # per-tensor: becomes one scale per layer when stacked
    recipe = Recipe(rules=(Rule(path=".*kernel", weight=int8, stacked_axes=1),))
    qparams = quantize_params(params, recipe)
    kernel = qparams["stack"]["kernel"]
    assert kernel.scale.shape == (layers, 1, 1)
    np.testing.assert_allclose(
        kernel.scale[:, 0, 0], jnp.max(jnp.abs(w), axis=(1, 2)) / 127, rtol=1e-6
    )
    x = jax.random.normal(jax.random.key(6), (4, dim))
    report = EngineReport()
    y = jax.jit(run(fn, strict=True, report=report))(qparams, x)
    assert report.num_fallbacks == 0
    assert rel_error(y, fn(params, x)) < 0.03


class TiedLM(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(100, 64, embedding_init=init, rngs=rngs)
        self.proj = linear(64, 64, rngs=rngs)

    def __call__(self, ids):
        return self.embed.attend(jax.nn.gelu(self.proj(self.embed(ids))))


def test_tied_embedding_lookup_and_attend_stay_packed():
    model = TiedLM(rngs=nnx.Rngs(0))
    ids = jnp.arange(12).reshape(2, 6)
    qmodel = quantize_model(model, "int8", strict=True)
    embedding = qmodel.state["embed"]["embedding"].get_value()
    assert embedding.scale.shape == (100, 1)  # one scale per row: lookups gather whole rows
    fn = lambda s, ids: nnx.merge(qmodel.graphdef, s)(ids)
    assert param_uses(fn, nnx.split(model)[1], ids)["embed/embedding"] == {"gather", "dot_general"}
    report = trace_report(fn, qmodel.state, ids, strict=True)
    assert report.num_fallbacks == 0 and report.num_quantized_ops == 2
    assert 0 < rel_error(qmodel(ids), nnx.jit(lambda m, x: m(x))(model, ids)) < 0.03


def test_prepare_replaces_codes_by_layouts_where_a_kernel_runs():
    from lowbit import kernels
    from lowbit.ops import PreparedQArray

    params = {"big": {"kernel": jnp.ones((256, 512))}, "small": {"kernel": jnp.ones((8, 8))}}
    q = quantize_params(params, "int8w")
    assert isinstance(q["big"]["kernel"], QArray)  # quantize_params is logical only
    x = jnp.linspace(-1, 1, 256).reshape(1, 256)
    fn = lambda p, x: x @ p["big"]["kernel"] + jnp.sum(p["small"]["kernel"])
    served = lowbit.prepare(q, fn, x)
    assert isinstance(served["small"]["kernel"], QArray)  # too small for a kernel
    has_kernels = kernels.available() and jax.default_backend() == "cpu"
    assert isinstance(served["big"]["kernel"], PreparedQArray) == has_kernels
    np.testing.assert_array_equal(np.asarray(run(fn)(served, x)), np.asarray(run(fn)(q, x)))


class _RawParams(nnx.Module):
    """Matmul weights as raw Params whose names no preset pattern knows."""

    def __init__(self, *, rngs):
        self.qkv = nnx.Param(init(rngs.params(), (64, 96)))
        self.w = nnx.Param(init(rngs.params(), (32, 96)))  # [out, in]: used as x @ w.T

    def __call__(self, x):
        return (x @ self.qkv[...]) @ self.w[...].T


def test_presets_find_raw_param_weights_by_use_given_example_inputs():
    model = _RawParams(rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 64))
    with pytest.warns(UserWarning, match="quantizes none"):
        plain = quantize_model(model, "int8")
    assert not any(isinstance(v, QArray) for v in jax.tree.leaves(plain.state, is_leaf=_is_q))
    qmodel = quantize_model(model, "int8", example_args=(x,))
    state = nnx.to_pure_dict(qmodel.state)
    for name in ("qkv", "w"):
        assert _is_q(state[name]), name
    # `w` is an [out, in] weight (contracted over axis 1): per-channel scales per row.
    w = state["w"]
    w = w.logical() if hasattr(w, "logical") else w
    assert w.scale.shape == (32, 1)
    assert 0 < rel_error(qmodel(x), model(x)) < 0.05


def _is_q(x):
    from lowbit.ops import PreparedQArray

    return isinstance(x, QArray | PreparedQArray)


def test_quantize_matching_no_parameter_warns_or_raises():
    w = jnp.ones((64, 64))
    with pytest.warns(UserWarning, match="quantizes none of the 1 parameters"):
        out = lowbit.quantize({"w": w}, "int8_weight_only")
    assert out["w"] is w
    with pytest.raises(ValueError, match="quantizes none"):
        lowbit.quantize({"w": w}, "int8_weight_only", strict=True)
    # The float recipe matches everything on purpose: no warning.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowbit.quantize({"w": w}, "float")
