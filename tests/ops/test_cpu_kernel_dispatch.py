"""`dot_general` on CPU routes plain linear layers to the compiled kernels: results, paths,
gradients, vmap, and the end-to-end path through `lowbit.run`."""

from __future__ import annotations

import dataclasses
import functools

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
    PreparedQArray,
    _dot_path,
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
    QArray,
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
    "mxfp4": (QuantConfig(format="mxfp4", granularity=PerGroup(32, 0)), None, "fp4"),
    "nvfp4": (QuantConfig(format="nvfp4", granularity=PerGroup(16, 0)), None, "fp4"),
    "fp4_channel": (QuantConfig(format="fp4_e2m1", granularity=PerChannel((1,))), None, "fp4"),
    "fp8": (QuantConfig(format="fp8_e4m3fn", granularity=PerChannel((1,))), None, "fp8"),
    "fp8_group": (QuantConfig(format="fp8_e4m3fn", granularity=PerGroup(32, 0)), None, "fp8"),
    "int8_group": (QuantConfig(format="int8", granularity=PerGroup(32, 0)), None, "int8"),
    "w8a8": (QuantConfig(format="int8", granularity=PerChannel((1,))), INT8_TOKEN, "w8a8"),
    "w4a8_group": (QuantConfig(format="int4", granularity=PerGroup(32, 0)), INT8_TOKEN, "w4a8"),
    "w4a8_channel": (
        QuantConfig(format="int4", granularity=PerChannel((1,))),
        INT8_TOKEN,
        "w4a8",
    ),
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
def _kernel_and_reference(xs_by_dtype, q):
    return [_one_dtype(xs, q) for xs in xs_by_dtype]


def _one_dtype(xs, q):
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


DTYPES = (jnp.float32, jnp.bfloat16)


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_kernel_route_matches_reference(name):
    q = _weight(name)
    xs_by_dtype = [_lhs(dtype) for dtype in DTYPES]
    for x in (x for xs in xs_by_dtype for x in xs):
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        assert dot_general_path(x, q, dims) == f"cpu_kernel_{WEIGHTS[name][2]}"
    results = _kernel_and_reference(xs_by_dtype, q)
    for dtype, xs, result in zip(DTYPES, xs_by_dtype, results, strict=True):
        _check_against_reference(dtype, xs, *result)


def _check_against_reference(dtype, xs, outs, ref, magnitude):
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
    return dot_general(x, q, DIMS), _forward(x, q, DIMS, None, None, None, None)


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
# name: (lhs, rhs, dimension numbers) that must not reach a kernel.
KEEPS_OLD_PATH = {
    "small_weight": (
        jnp.ones((3, 128)),
        _spec(INT8_CHANNEL, shape=(128, 128)),
        DIMS,
    ),
    "int4_two_d_blocks": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="int4", granularity=PerGroup(8, 1))),
        DIMS,
    ),
    "mxfp4_blocks_along_n": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="mxfp4", granularity=PerGroup(32, 1)), shape=(K, 256)),
        DIMS,
    ),
    "attend_transposed_weight": (
        jnp.ones((3, N)),
        _spec(INT8_CHANNEL),
        (((1,), (1,)), ((), ())),
    ),
    "weight_on_the_left": (_spec(INT8_CHANNEL), jnp.ones((N, 3)), (((1,), (0,)), ((), ()))),
    "float16_activations": (
        jnp.ones((3, K), jnp.float16),
        _spec(INT8_CHANNEL),
        DIMS,
    ),
    "zero_tokens": (jnp.ones((0, K)), _spec(INT8_CHANNEL), DIMS),
    "w8a8_static_bounds": (
        jnp.ones((3, K)),
        _spec(
            INT8_CHANNEL,
            QuantConfig(format="int8", calibration=Fixed(-2.0, 2.0)),
            jnp.array([-2.0, 2.0]),
        ),
        DIMS,
    ),
    "w8a8_clipped_activation": (
        jnp.ones((3, K)),
        _spec(
            INT8_CHANNEL,
            QuantConfig(format="int8", granularity=PerToken(), calibration=AbsMax(0.9)),
        ),
        DIMS,
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
    ),
    "asymmetric_int4_weight_int8_activation": (
        jnp.ones((3, K)),
        _spec(
            QuantConfig(
                format="int4", granularity=PerGroup(32, 0), symmetric=False, calibration=MinMax()
            ),
            INT8_TOKEN,
        ),
        DIMS,
    ),
    "w4a8_groups_not_a_multiple_of_8": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="int4", granularity=PerGroup(4, 0)), INT8_TOKEN),
        DIMS,
    ),
    "int4_weight_int4_activation": (
        jnp.ones((3, K)),
        _spec(
            QuantConfig(format="int4", granularity=PerGroup(32, 0)),
            QuantConfig(format="int4", granularity=PerToken()),
        ),
        DIMS,
    ),
    "w8a8_bfloat16_activation_scales": (
        jnp.ones((3, K)),
        _spec(
            INT8_CHANNEL,
            QuantConfig(format="int8", granularity=PerToken(), scale_dtype=jnp.bfloat16),
        ),
        DIMS,
    ),
    "stacked_weights_with_batch_axes": (
        jnp.ones((2, 3, K)),
        _spec(QuantConfig(format="int8", granularity=PerChannel((0, 2))), shape=(2, K, N)),
        (((2,), (1,)), ((0,), (0,))),
    ),
    "int8_asymmetric_weight": (
        jnp.ones((3, K)),
        _spec(QuantConfig(format="int8", granularity=PerChannel((1,)), symmetric=False)),
        DIMS,
    ),
}


@pytest.mark.parametrize("case", sorted(KEEPS_OLD_PATH))
def test_unsupported_cases_keep_the_pure_jax_paths(case):
    lhs, rhs, dims = KEEPS_OLD_PATH[case]
    path = dot_general_path(lhs, rhs, dims)
    assert path not in KERNEL_PATHS
    assert path == _dot_path.plan(lhs, rhs, dims).path


def test_out_sharding_keeps_the_pure_jax_path_and_paths_are_listed():
    q = _spec(INT8_CHANNEL)
    x = jnp.ones((3, K))
    assert dot_general_path(x, q, DIMS) == "cpu_kernel_int8"
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert dot_general_path(x, q, DIMS, out_sharding=sharding) == "weight_only_epilogue"
    assert set(KERNEL_PATHS) <= set(PATHS)
    assert K * N >= MIN_WEIGHT_ELEMENTS > 128 * 128


@jax.jit
def _grads(x, q, cotangent):
    """(gradient through the kernel route, reference gradient of the weight-only product)."""
    weight_only = dataclasses.replace(q, activation=None)
    loss = lambda fn, w: lambda x: jnp.sum(fn(x, w, DIMS_3D) * cotangent)
    return jax.grad(loss(dot_general, q))(x), jax.grad(loss(dot_general_reference, weight_only))(x)


@pytest.mark.parametrize("name", ["int4_group", "w8a8", "w4a8_group"])
def test_gradient_wrt_lhs_matches_reference(name):
    q = _weight(name)
    x, cotangent = normal(7, (2, 3, K)), normal(6, (2, 3, N))
    assert dot_general_path(x, q, DIMS_3D).startswith("cpu_kernel_")
    dx, ref = _grads(x, q, cotangent)
    # dx = g . W^T on both sides (straight through the activation rounding for w8a8).
    transposed = (((2,), (1,)), ((), ()))
    bound = summation_bound(jnp.abs(cotangent), jnp.abs(q.dequantize()), transposed, N)
    np.testing.assert_array_less(np.abs(np.asarray(dx) - np.asarray(ref)), bound)


@jax.jit
def _vmapped(xs, q, x, stacked):
    """vmap over activations (kernel route and reference), and over stacked weights."""
    over_x = jax.vmap(lambda x: (dot_general(x, q, DIMS), dot_general_reference(x, q, DIMS)))
    over_w = jax.vmap(lambda w: (dot_general(x, w, DIMS), x @ w.dequantize()))
    return over_x(xs), over_w(stacked), q.dequantize(), stacked.dequantize()


def test_vmap_over_activations_and_over_stacked_weights():
    q = _weight("int4_group")
    xs, x = normal(8, (3, 2, K)), normal(10, (5, K))
    # Two int8 layers stacked into one QArray [2, K, N] (scale [2, 1, N]).
    layers = (_weight("int8"), _weight("int8", normal(9, (K, N))))
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)
    assert stacked.shape == (2, K, N)
    assert dot_general_path(xs[0], q, DIMS) == "cpu_kernel_int4"
    (out, ref), (out_w, ref_w), deq, deq_w = _vmapped(xs, q, x, stacked)
    bound = summation_bound(jnp.abs(xs), jnp.abs(deq), DIMS_3D, K)
    np.testing.assert_array_less(np.abs(np.asarray(out) - np.asarray(ref)), bound)
    for layer in range(2):
        bound = summation_bound(jnp.abs(x), jnp.abs(deq_w[layer]), DIMS, K)
        np.testing.assert_array_less(np.abs(np.asarray(out_w[layer] - ref_w[layer])), bound)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _init(key, shape, dtype=jnp.float32):
    # Flax's default initializers run op by op; one compiled call is much cheaper here.
    return jax.random.normal(key, shape, dtype) / jnp.sqrt(shape[0]).astype(dtype)


class _MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(K, N, kernel_init=_init, rngs=rngs)
        self.down = nnx.Linear(N, K, kernel_init=_init, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


@jax.jit
def _dequantized(state):
    is_q = lambda v: isinstance(v, QArray | PreparedQArray)
    return jax.tree.map(lambda v: v.dequantize() if is_q(v) else v, state, is_leaf=is_q)


@pytest.mark.parametrize("recipe, kind", [("int8w", "int8"), ("int4w", "int4")])
def test_engine_report_shows_kernel_paths(recipe, kind):
    qmodel = lowbit.quantize_model(_MLP(rngs=nnx.Rngs(0)), recipe)
    graphdef = qmodel.graphdef
    apply = lambda state, x: nnx.merge(graphdef, state)(x)
    report = lowbit.EngineReport()
    x = normal(11, (4, K))
    out = jax.jit(lowbit.run(apply, report=report))(qmodel.state, x)
    assert report.quantized_ops == {f"dot_general:cpu_kernel_{kind}": 2}
    assert report.fallbacks == {}
    # The quantized model is the float model on the dequantized weights, up to f32 rounding.
    ref = jax.jit(apply)(_dequantized(qmodel.state), x)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-5


def test_without_kernels_the_pure_jax_paths_run(monkeypatch):
    # What `LOWBIT_DISABLE_KERNELS=1` (read once per process) or a missing module amounts to.
    monkeypatch.setattr(kernels, "available", lambda: False)
    q = _weight("int8")
    x = normal(12, (3, K))
    assert dot_general_path(x, q, DIMS) == "weight_only_epilogue"
    # Read in the program lowered for this CPU: the kernels appear as FFI custom calls.
    lowered = jax.jit(lambda x, q: dot_general(x, q, DIMS)).lower(x, q).as_text()
    assert "custom_call" not in lowered
    monkeypatch.undo()
    lowered = jax.jit(lambda x, q: dot_general(x, q, DIMS)).lower(x, q).as_text()
    assert "custom_call @lowbit_wo_linear" in lowered


def test_w4a8_preset_runs_on_the_integer_kernels():
    # Every linear layer of `w4a8_g32` must be a layout the w4a8 kernel takes as it is; one
    # that is not would run the pure-JAX paths without saying so.
    model = _MLP(rngs=nnx.Rngs(0))
    model.up = nnx.Linear(K, 512, kernel_init=_init, rngs=nnx.Rngs(1))
    model.down = nnx.Linear(512, K, kernel_init=_init, rngs=nnx.Rngs(2))  # 264 % 32 != 0
    qmodel = lowbit.quantize_model(model, "w4a8_g32")
    graphdef = qmodel.graphdef
    apply = lambda state, x: nnx.merge(graphdef, state)(x)
    report = lowbit.EngineReport()
    out = jax.jit(lowbit.run(apply, report=report))(qmodel.state, normal(11, (4, K)))
    assert report.quantized_ops == {"dot_general:cpu_kernel_w4a8": 2}
    assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("name", ["int4_group_asym", "nf4_group", "int8"])
def test_prefill_sized_products_match_reference(name):
    # From GEMM_MIN_ROWS rows a weight-only product is XLA's GEMM on the kernel-dequantized
    # weight: the same values, so the same bound against the reference.
    from lowbit.ops._cpu_kernels import GEMM_MIN_ROWS

    q = _weight(name)
    x = normal(9, (GEMM_MIN_ROWS + 3, K))
    assert dot_general_path(x, q, DIMS) == f"cpu_kernel_{WEIGHTS[name][2]}"
    ((outs, ref, magnitude),) = _kernel_and_reference([[x]], q)
    _check_against_reference(jnp.float32, [x], outs, ref, magnitude)
