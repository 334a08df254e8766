"""Flax Linen models through the engine: Dense MLP, nn.scan + nn.remat stacks, a conv net, an
MoE layer with `jax.lax.ragged_dot`, and a `jax.custom_vjp` activation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import jit_dequantize, jit_quantize
from flax import linen as nn

from lowbit.engine import EngineReport, interpret
from lowbit.qarray import PerChannel, PerGroup, QArray


@jax.custom_vjp
def clipped_relu(x):
    return jnp.clip(x, 0.0, 6.0)


def _clipped_relu_fwd(x):
    return clipped_relu(x), x


def _clipped_relu_bwd(x, g):
    return (jnp.where((x > 0) & (x < 6), g, 0.1 * g),)  # deliberately not the true derivative


clipped_relu.defvjp(_clipped_relu_fwd, _clipped_relu_bwd)


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(x.shape[-1])(clipped_relu(nn.Dense(2 * x.shape[-1])(x))), None


class ScannedMLP(nn.Module):
    layers: int = 3

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            nn.remat(Layer),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = stack()(nn.Dense(16)(x), None)
        return nn.Dense(8)(x)


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
        return nn.Dense(4)(x.reshape(x.shape[0], -1))


class MoE(nn.Module):
    experts: int = 4
    hidden: int = 16

    @nn.compact
    def __call__(self, x, group_sizes):
        init = nn.initializers.lecun_normal()
        w_in = self.param("w_in", init, (self.experts, x.shape[-1], self.hidden))
        w_out = self.param("w_out", init, (self.experts, self.hidden, x.shape[-1]))
        h = jax.nn.silu(jax.lax.ragged_dot(x, w_in, group_sizes))
        return jax.lax.ragged_dot(h, w_out, group_sizes)


def _quantize_params(params, fmt):
    def one(path, leaf):
        name = jax.tree_util.keystr(path)
        if "bias" in name:
            return leaf
        if "Conv" in name:  # [h, w, in, out]: one scale per output channel
            return jit_quantize(leaf, fmt, PerChannel((-1,)))
        # Per output channel (and per layer / expert of stacked kernels); int4 experts too,
        # as ragged_dot with grouped scales is a dequantizing reference path in lowbit.ops.
        if fmt == "int8" or "w_" in name:
            return jit_quantize(leaf, "int8", PerChannel((*range(leaf.ndim - 2), leaf.ndim - 1)))
        return jit_quantize(leaf, "int4", PerGroup(8, axis=leaf.ndim - 2))

    return jax.tree_util.tree_map_with_path(one, params)


_KEY = jax.random.PRNGKey(1)
MODELS = {
    "scanned_mlp": (ScannedMLP(), (jax.random.normal(_KEY, (4, 8)),)),
    "conv": (ConvNet(), (jax.random.normal(_KEY, (2, 8, 8, 3)),)),
    "moe": (MoE(), (jax.random.normal(_KEY, (10, 8)), jnp.array([3, 0, 5, 2], jnp.int32))),
}
EXPECTED_OPS = {  # quantized ops per trace (scan bodies are traced once)
    "scanned_mlp": {"dot_general": 4},
    "conv": {"conv_general_dilated": 2, "dot_general": 1},
    "moe": {"ragged_dot_general": 2},
}
PARAMS = {name: model.init(_KEY, *args) for name, (model, args) in MODELS.items()}


# int8 per channel: ~0.3% RMS error per weight. int4 per output channel: step amax/7, RMS
# error step/sqrt(12) ~ 12% of the weights' RMS per layer for these tiny random layers, so
# through three layers the output error stays under ~40%. The tight check is the comparison
# with the float model on the dequantized weights below.
CASES = [(name, "int8", 0.02) for name in sorted(MODELS)] + [("conv", "int4", 0.4)]


@pytest.mark.parametrize(("name", "fmt", "bound"), CASES)
def test_linen_model_matches_float(name, fmt, bound):
    model, args = MODELS[name]
    qparams = _quantize_params(PARAMS[name], fmt)
    report = EngineReport()
    apply = jax.jit(interpret(model.apply, strict=True, report=report))
    out = apply(qparams, *args)
    ref = jax.jit(model.apply)(PARAMS[name], *args)
    assert report.fallbacks == {} and report.materialized == 0
    counts = {}
    for key, n in report.quantized_ops.items():
        counts[key.split(":")[0]] = counts.get(key.split(":")[0], 0) + n
    assert counts == EXPECTED_OPS[name]
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < bound
    deq = jax.jit(model.apply)(jit_dequantize(qparams), *args)
    np.testing.assert_allclose(out, deq, rtol=2e-4, atol=2e-4)


def test_custom_vjp_activation_keeps_its_backward_rule():
    model, (x,) = MODELS["scanned_mlp"]
    qparams = _quantize_params(PARAMS["scanned_mlp"], "int8")
    deq = jit_dequantize(qparams)
    loss = lambda apply, p, x: jnp.sum(apply(p, x) ** 2)
    got = jax.jit(jax.grad(lambda x: loss(interpret(model.apply), qparams, x)))(x)
    want = jax.jit(jax.grad(lambda x: loss(model.apply, deq, x)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
    n_quantized = sum(
        isinstance(v, QArray)
        for v in jax.tree.leaves(qparams, is_leaf=lambda v: isinstance(v, QArray))
    )
    assert n_quantized == 4  # both Dense layers of the scanned stack, and the two outer ones
