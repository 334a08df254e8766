"""Flax NNX models run unmodified through the engine: Linear, Einsum attention projections,
tied Embed/attend, jax.jit inside `__call__`, layers stacked with nnx.scan and nnx.remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import all_eqns, jit_dequantize, jit_quantize
from flax import nnx

from lowbit.engine import EngineReport, interpret
from lowbit.qarray import PerChannel, PerGroup, QArray

VOCAB, D, LAYERS = 64, 16, 3


@jax.jit  # a jit inside the model's __call__, over plain arrays
def _ffn(x, up_kernel, up_bias, down_kernel, down_bias):
    return jax.nn.gelu(x @ up_kernel + up_bias) @ down_kernel + down_bias


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.q = nnx.Einsum("btd,dnh->btnh", (D, 2, D // 2), rngs=rngs)
        self.o = nnx.Einsum("btnh,nhd->btd", (2, D // 2, D), rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.o(jax.nn.softmax(self.q(x), axis=-1))
        return x + _ffn(
            x, self.up.kernel[...], self.up.bias[...], self.down.kernel[...], self.down.bias[...]
        )


class TinyLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)

    def __call__(self, ids):
        x = self.embed(ids)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def step(x, block):
            return block(x)

        return self.embed.attend(step(x, self.blocks))


GRAPHDEF, STATE = nnx.split(TinyLM(nnx.Rngs(0)))
# One out-of-range id (VOCAB): its logits are NaN, as nnx.Embed's jnp.take gives in float.
IDS = jnp.array([[1, 5, 9, 63], [0, VOCAB, 7, 2]], jnp.int32)


def forward(state, ids):
    return nnx.merge(GRAPHDEF, state)(ids)


def _granularity(path, leaf, bits):
    name = jax.tree_util.keystr(path)
    if "embedding" in name:
        return PerChannel((0,)) if bits == 8 else PerGroup(8, axis=1)
    if "'o'" in name or bits == 8:
        return PerChannel((0, leaf.ndim - 1))  # per layer and output channel
    return PerGroup(8, axis=1)  # groups along the contraction axis of [layer, in, ...]


def quantize_state(state, fmt):
    bits = 8 if fmt == "int8" else 4

    def one(path, leaf):
        if "bias" in jax.tree_util.keystr(path):
            return leaf
        return jit_quantize(leaf, fmt, _granularity(path, leaf, bits))

    return jax.tree_util.tree_map_with_path(one, state)


_FLOAT = jax.jit(forward)
_REPORT = EngineReport()
_QUANT = jax.jit(interpret(forward, strict=True, report=_REPORT))


@pytest.mark.parametrize(("fmt", "bound"), [("int8", 0.02), ("int4", 0.15)])
def test_tiny_lm_matches_float_model(fmt, bound):
    qstate = quantize_state(STATE, fmt)
    assert (
        sum(
            isinstance(v, QArray)
            for v in jax.tree.leaves(qstate, is_leaf=lambda v: isinstance(v, QArray))
        )
        == 5
    )
    ref = _FLOAT(STATE, IDS)
    out = _QUANT(qstate, IDS)
    assert _REPORT.fallbacks == {} and _REPORT.materialized == 0
    # Per layer: q, o, up, down; plus the tied `attend`.
    assert sum(_REPORT.quantized_ops.values()) == 5
    assert _REPORT.layout_ops["gather"] == 1
    nan_rows = np.isnan(np.asarray(ref)).any(-1)
    assert nan_rows.tolist() == [[False] * 4, [False, True, False, False]]
    np.testing.assert_array_equal(np.isnan(np.asarray(out)), np.isnan(np.asarray(ref)))
    ok = ~nan_rows
    rel = np.linalg.norm(out[ok] - ref[ok]) / np.linalg.norm(ref[ok])
    assert rel < bound
    # Same program as the float model on dequantized weights, up to float rounding.
    deq = _FLOAT(jit_dequantize(qstate), IDS)
    np.testing.assert_allclose(out[ok], deq[ok], rtol=1e-4, atol=1e-4)


def test_stacked_weights_stay_packed_in_the_scan():
    qstate = quantize_state(STATE, "int4")
    jaxpr = jax.make_jaxpr(interpret(forward))(qstate, IDS)
    scans = [e for e in all_eqns(jaxpr) if e.primitive.name == "scan"]
    assert len(scans) == 1
    xs_dtypes = [v.aval.dtype for v in scans[0].invars]
    assert jnp.dtype(jnp.uint8) in xs_dtypes  # packed int4 codes are scanned over as bytes
    kernel_shapes = {leaf.shape for leaf in jax.tree.leaves(STATE["blocks"]) if leaf.ndim >= 3}
    floats = {v.aval.shape for v in scans[0].invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
    assert len(kernel_shapes) == 4 and not kernel_shapes & floats
