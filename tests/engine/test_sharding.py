"""Quantized params sharded over 8 simulated devices: codes and scales are sharded together and
the compiled program never all-gathers a float weight."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from engine_helpers import jit_dequantize, jit_quantize
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lowbit.engine import interpret
from lowbit.qarray import PerGroup

_K = jax.random.split(jax.random.PRNGKey(3), 3)
W1 = jax.random.normal(_K[0], (64, 128)) / 8
W2 = jax.random.normal(_K[1], (128, 64)) / 8
X = jax.random.normal(_K[2], (4, 64))


def model(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def test_sharded_quantized_weights_are_not_all_gathered_as_float():
    granularity = PerGroup(16, axis=0)  # int4 codes packed along the sharded axis, grouped scales
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()), ("model",))
    fmt = "int4"
    params = {"w1": jit_quantize(W1, fmt, granularity), "w2": jit_quantize(W2, fmt, granularity)}
    params = jax.device_put(params, NamedSharding(mesh, P(None, "model")))
    # Scales are sharded with their codes (both along the output axis of w1).
    w1 = params["w1"]
    assert w1.codes.sharding.spec == w1.scale.sharding.spec == P(None, "model")
    assert len(w1.scale.addressable_shards) == 8
    assert w1.scale.addressable_shards[0].data.shape[1] == 128 // 8

    run = jax.jit(interpret(model, strict=True))
    hlo = run.lower(params, X).compile().as_text()
    weight_shapes = {"64,128", "128,64"}
    for line in hlo.splitlines():
        if "all-gather" not in line:
            continue
        for _dtype, dims in re.findall(r"(f32|bf16|f16)\[([\d,]+)\]", line):
            assert dims not in weight_shapes, line
    out = run(params, X)
    deq = jit_dequantize(params)
    np.testing.assert_allclose(out, model(deq, X), rtol=1e-4, atol=1e-4)
