"""`dot_general` on CPU routes plain linear layers to the compiled kernels: results, paths,
gradients, vmap, and the end-to-end path through `lowbit.run`."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from ops_helpers import EPS32, jit_quantize, normal, summation_bound

import lowbit
from lowbit import kernels
from lowbit.ops import (
    KERNEL_PATHS,
    MIN_WEIGHT_ELEMENTS,
    PATHS,
    dot_general,
    dot_general_path,
    dot_general_reference,
    quantize_activation,
)
from lowbit.ops._dot_general import _forward
from lowbit.qarray import (
    AbsMax,
    Fixed,
    MinMax,
    PerChannel,
    PerGroup,
    PerToken,
    QuantConfig,
)

pytestmark = pytest.mark.skipif(
    not kernels.available() or jax.default_backend() != "cpu",
    reason="CPU kernels unavailable: " + kernels.status(),
)

# N not a multiple of the kernels' 16-column panels; K * N above the routing threshold.
K, N = 256, 264
DIMS = (((1,), (0,)), ((), ()))
DIMS_3D = (((2,), (0,)), ((), ()))
INT8_TOKEN = QuantConfig(format="int8", granularity=PerToken())

# name: (weight config, activation config, expected path)
WEIGHTS = {
    "int8": (QuantConfig(format="int8", granularity=PerChannel((1,))), None, "int8"),
    "int4_group": (QuantConfig(format="int4", granularity=PerGroup(32, 0)), None, "int4"),
    "int4_channel": (QuantConfig(format="int4", granularity=PerChannel((1,))), None, "int4"),
    "int4_group_asym": (
        QuantConfig(
            format="int4", granularity=PerGroup(32, 0), symmetric=False, calibration=MinMax()
        ),
        None,
        "uint4",
    ),
    "uint4_group_asym": (
        QuantConfig(
            format="uint4", granularity=PerGroup(64, 0), symmetric=False, calibration=MinMax()
        ),
        None,
        "uint4",
    ),
    "nf4_group": (QuantConfig(format="nf4", granularity=PerGroup(64, 0)), None, "nf4"),
    "fp8": (QuantConfig(format="fp8_e4m3fn", granularity=PerChannel((1,))), None, "fp8"),
    "w8a8": (QuantConfig(format="int8", granularity=PerChannel((1,))), INT8_TOKEN, "w8a8"),
}


def _weight(name: str, w: jax.Array | None = None):
    config, activation, _ = WEIGHTS[name]
    q = jit_quantize(normal(1, (K, N)) if w is None else w, config)
    return dataclasses.replace(q, activation=activation)


def _lhs(dtype):
    """The three lhs shapes each case runs: M = 1, M = 7 and [batch, seq, K]."""
    return (
        normal(2, (1, K), dtype),
        normal(3, (7, K), dtype),
        normal(4, (2, 3, K), dtype),
    )


@jax.jit
def _kernel_and_reference(xs, q):
    """Kernel outputs for each lhs; reference and magnitude for all their rows at once."""
    outs = [dot_general(x, q, (((x.ndim - 1,), (0,)), ((), ()))) for x in xs]
    rows = jnp.concatenate([x.reshape(-1, K) for x in xs])
    ref = dot_general_reference(rows, q, DIMS)
    # What the reference multiplies, for the error bound.
    x_side = rows
    if q.activation is not None:
        x_side = quantize_activation(rows, (1,), q.activation).dequantize()
    magnitude = jnp.dot(
        jnp.abs(x_side.astype(jnp.float32)),
        jnp.abs(q.dequantize(jnp.float32)),
        precision=lax.Precision.HIGHEST,
    )
    return outs, ref, magnitude


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_kernel_route_matches_reference(name, dtype):
    q = _weight(name)
    xs = _lhs(dtype)
    for x in xs:
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        assert dot_general_path(x, q, dims) == f"cpu_kernel_{WEIGHTS[name][2]}"
    outs, ref, magnitude = _kernel_and_reference(xs, q)
    for x, out in zip(xs, outs, strict=True):
        assert out.shape == (*x.shape[:-1], N) and out.dtype == dtype
    out = np.concatenate([np.asarray(o, np.float32).reshape(-1, N) for o in outs])
    ref, magnitude = np.asarray(ref, np.float32), np.asarray(magnitude)
    # Two float32 sums of K products in different orders (scales applied in the loop or after
    # it) differ by at most (2K + 8) eps sum |x||w|.
    bound = (2 * K + 8) * EPS32 * magnitude + 1e-30
    if dtype == jnp.bfloat16:
        # The reference rounds the dequantized weight (and activation) to bfloat16, and both
        # outputs are rounded to bfloat16: 2**-9 relative each.
        bound = bound + 2.0**-8 * (magnitude + np.abs(ref))
    np.testing.assert_array_less(np.abs(out - ref), bound)


@jax.jit
def _kernel_and_pure_jax_w8a8(x, q):
    # `_forward` is the pure-JAX product `dot_general` runs when no kernel applies.
    return dot_general(x, q, DIMS), _forward(x, q, DIMS, None, None, None)


def test_w8a8_activation_quantization_matches_the_kernel():
    # Row 0 has absmax 127, so its scale is exactly 1 and x / scale hits ties (0.5, 1.5, -2.5):
    # both quantizers must round half to even. Row 1 is all zeros (scale 1 on both paths).
    # With identical codes, int32 accumulation is exact and both apply the two scales in the
    # same order, so the results are bit-identical.
    ties = np.tile(np.array([0.5, 1.5, -2.5, 3.5, -0.5, 126.5], np.float32), K // 6 + 1)[:K]
    ties[0] = 127.0
    x = np.array(normal(5, (4, K)))
    x[0], x[1] = ties, 0.0
    q = _weight("w8a8")
    assert dot_general_path(jnp.asarray(x), q, DIMS) == "cpu_kernel_w8a8"
    out, pure = _kernel_and_pure_jax_w8a8(jnp.asarray(x), q)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pure))


def _spec(config, activation=None, bounds=None, shape=(K, N)):
    q = jax.eval_shape(lambda w: jit_quantize(w, config), jax.ShapeDtypeStruct(shape, jnp.float32))
    return dataclasses.replace(q, activation=activation, activation_bounds=bounds)


INT8_CHANNEL = QuantConfig(format="int8", granularity=PerChannel((1,)))
KEEPS_OLD_PATH = {
    "small_weight": (
        jnp.ones((3, 128)),
        _spec(INT8_CHANNEL, shape=(128, 128)),
        DIMS,
        "weight_only_epilogue",
    ),
    "int8_per_group": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="int8", granularity=PerGroup(32, 0))),
        DIMS,
        "weight_only_grouped",
    ),
    "fp8_per_group": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="fp8_e4m3fn", granularity=PerGroup(32, 0))),
        DIMS,
        "weight_only_grouped",
    ),
    "int4_two_d_blocks": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="int4", granularity=PerGroup(8, 1))),
        DIMS,
        "weight_only_epilogue",
    ),
    "mxfp4": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="mxfp4", granularity=PerGroup(32, 0))),
        DIMS,
        "weight_only_grouped",
    ),
    "attend_transposed_weight": (
        jnp.ones((3, N)),
        _spec(INT8_CHANNEL),
        (((1,), (1,)), ((), ())),
        "weight_only_epilogue",
    ),
    "weight_on_the_left": (
        jnp.ones((N, 3)),
        _spec(INT8_CHANNEL),
        (((1,), (0,)), ((), ())),
        "weight_only_epilogue",
    ),
    "float16_activations": (
        jnp.ones((3, K), jnp.float16),
        _spec(INT8_CHANNEL),
        DIMS,
        "weight_only_epilogue",
    ),
    "zero_tokens": (jnp.ones((0, K)), _spec(INT8_CHANNEL), DIMS, "weight_only_epilogue"),
    "w8a8_static_bounds": (
        jnp.ones((3, K)),
        _spec(
            INT8_CHANNEL,
            QuantConfig(format="int8", calibration=Fixed(-2.0, 2.0)),
            jnp.array([-2.0, 2.0]),
        ),
        DIMS,
        "int8_int32",
    ),
    "w8a8_clipped_activation": (
        jnp.ones((3, K)),
        _spec(
            INT8_CHANNEL,
            QuantConfig(format="int8", granularity=PerToken(), calibration=AbsMax(0.9)),
        ),
        DIMS,
        "int8_int32",
    ),
    "w8a8_asymmetric_activation": (
        jnp.ones((3, K)),
        _spec(
            INT8_CHANNEL,
            QuantConfig(
                format="uint8", granularity=PerToken(), symmetric=False, calibration=MinMax()
            ),
        ),
        DIMS,
        "int8_int32",
    ),
    "int4_weight_int8_activation": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="int4", granularity=PerGroup(32, 0)), INT8_TOKEN),
        DIMS,
        "int8_int32",
    ),
    "int8_asymmetric_weight": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="int8", granularity=PerChannel((1,)), symmetric=False)),
        DIMS,
        "weight_only_epilogue",
    ),
}


@pytest.mark.parametrize("case", sorted(KEEPS_OLD_PATH))
def test_unsupported_cases_keep_the_pure_jax_paths(case):
    x, q, dims, expected = KEEPS_OLD_PATH[case]
    assert dot_general_path(x, q, dims) == expected
    assert expected in PATHS and expected not in KERNEL_PATHS


def test_out_sharding_keeps_the_pure_jax_path_and_paths_are_listed():
    q = _spec(INT8_CHANNEL)
    x = jnp.ones((3, K))
    assert dot_general_path(x, q, DIMS) == "cpu_kernel_int8"
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert dot_general_path(x, q, DIMS, out_sharding=sharding) == "weight_only_epilogue"
    assert set(KERNEL_PATHS) <= set(PATHS)
    assert K * N >= MIN_WEIGHT_ELEMENTS > 128 * 128


@functools.partial(jax.jit, static_argnums=(2,))
def _grads(x, q, use_reference):
    fn = dot_general_reference if use_reference else dot_general
    cotangent = normal(6, (*x.shape[:-1], N))
    return jax.grad(lambda x: jnp.sum(fn(x, q, DIMS_3D) * cotangent))(x)


@pytest.mark.parametrize("name", ["int4_group", "w8a8"])
def test_gradient_wrt_lhs_matches_reference(name):
    q = _weight(name)
    x = normal(7, (2, 3, K))
    assert dot_general_path(x, q, DIMS_3D).startswith("cpu_kernel_")
    dx, ref = _grads(x, q, False), _grads(x, q, True)
    # dx = g . W^T on both sides (straight through the activation rounding for w8a8).
    w_abs = jnp.abs(q.dequantize())
    bound = summation_bound(jnp.abs(normal(6, (2, 3, N))), w_abs, (((2,), (1,)), ((), ())), N)
    np.testing.assert_array_less(np.abs(np.asarray(dx) - np.asarray(ref)), bound)


def test_vmap_over_activations_and_over_stacked_weights():
    q = _weight("int4_group")
    xs = normal(8, (3, 2, K))
    out = jax.jit(jax.vmap(lambda x: dot_general(x, q, DIMS), in_axes=0))(xs)
    ref = jnp.stack([dot_general_reference(x, q, DIMS) for x in xs])
    bound = summation_bound(jnp.abs(xs), jnp.abs(q.dequantize()), DIMS_3D, K)
    np.testing.assert_array_less(np.abs(np.asarray(out) - np.asarray(ref)), bound)
    # Two stacked int8 layers [2, K, N], one scale per layer and column.
    stacked = jit_quantize(normal(9, (2, K, N)), "int8", granularity=PerChannel((0, 2)))
    x = normal(10, (5, K))
    out = jax.jit(jax.vmap(lambda w: dot_general(x, w, DIMS)))(stacked)
    deq = stacked.dequantize()
    for layer in range(2):
        bound = summation_bound(jnp.abs(x), jnp.abs(deq[layer]), DIMS, K)
        np.testing.assert_array_less(np.abs(np.asarray(out[layer]) - x @ deq[layer]), bound)


class _MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(K, N, rngs=rngs)
        self.down = nnx.Linear(N, K, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


@pytest.mark.parametrize("recipe, kind", [("int8w", "int8"), ("int4w", "int4")])
def test_engine_report_shows_kernel_paths(recipe, kind):
    model = _MLP(rngs=nnx.Rngs(0))
    qmodel = lowbit.quantize_model(model, recipe)
    graphdef = qmodel.graphdef
    report = lowbit.EngineReport()
    fn = jax.jit(lowbit.run(lambda state, x: nnx.merge(graphdef, state)(x), report=report))
    x = normal(11, (4, K))
    out = fn(qmodel.state, x)
    assert report.quantized_ops == {f"dot_general:cpu_kernel_{kind}": 2}
    assert report.fallbacks == {}
    ref = qmodel.dequantized()(x)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-5


_DISABLED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from lowbit import kernels
from lowbit.ops import dot_general, dot_general_path, dot_general_reference
from lowbit.qarray import PerChannel, quantize
q = quantize(jax.random.normal(jax.random.key(1), ({k}, {n})), "int8", granularity=PerChannel((1,)))
x = jax.random.normal(jax.random.key(2), (3, {k}))
dims = (((1,), (0,)), ((), ()))
out = np.asarray(dot_general(x, q, dims))
np.testing.assert_allclose(out, dot_general_reference(x, q, dims), rtol=1e-4, atol=1e-4)
print(kernels.available(), dot_general_path(x, q, dims))
"""


def test_disable_switch_restores_the_pure_jax_paths():
    env = {**os.environ, "LOWBIT_DISABLE_KERNELS": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, "-c", _DISABLED_SCRIPT.format(k=K, n=N)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "weight_only_epilogue"]
