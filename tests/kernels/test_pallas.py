"""Pallas weight-only matmul and the XLA int8 / fp8 products against the dequantized float math.

On CPU the kernel body runs in the Pallas interpreter; on a GPU backend the same tests compile
it through Triton (so they check the real kernel there).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.kernels import pallas
from lowbit.qarray import PerChannel, PerGroup, QuantConfig, quantize

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
# Relative to max |reference|: bfloat16 weights and activations round to 8 bits of mantissa;
# float32 dots run as TF32 on NVIDIA GPUs (10 bits) and exactly in the interpreter.
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float32: 1e-2 if ON_GPU else 1e-5}


def weight(fmt, k, n, granularity, pack_axis=None, seed=0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    return quantize(jnp.asarray(w), fmt, granularity=granularity, pack_axis=pack_axis)


def activations(m, k, dtype, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


@jax.jit
def reference(x, q):
    w = q.dequantize(jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)


def assert_close(y, ref, dtype):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    scale = float(np.max(np.abs(ref)))
    np.testing.assert_allclose(y, ref, rtol=0, atol=TOLERANCE[dtype] * scale)


# (format, granularity, pack_axis (None: the default, N), K, N, activation dtype)
CASES = [
    ("int4", PerGroup(32, 0), None, 128, 64, jnp.float32),
    ("int4", PerChannel((1,)), 0, 256, 128, jnp.bfloat16),
    ("uint4", PerGroup(64, 0), None, 256, 64, jnp.bfloat16),
    ("uint4", PerGroup(32, 0), 0, 128, 128, jnp.float32),
    ("nf4", PerGroup(64, 0), None, 128, 256, jnp.bfloat16),
    ("nf4", PerChannel((1,)), 0, 64, 64, jnp.float32),
    ("int8", PerChannel((1,)), None, 256, 128, jnp.bfloat16),
    ("int8", PerGroup(128, 0), None, 256, 64, jnp.float32),
]


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-pack{c[2]}-{c[3]}x{c[4]}")
def test_weight_only_matches_dequantized_product(case, m):
    fmt, granularity, pack_axis, k, n, dtype = case
    q = weight(fmt, k, n, granularity, pack_axis)
    assert (q.zero_point is not None) == (fmt == "uint4")
    x = activations(m, k, dtype)
    y = pallas.weight_only_matmul(x, q, interpret=INTERPRET)
    assert y.shape == (m, n) and y.dtype == dtype
    assert_close(y, reference(x, q), dtype)


@pytest.mark.parametrize("body, m", [("gemv", 1), ("gemv", 16), ("xla", 2)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-pack{c[2]}-{c[3]}x{c[4]}")
def test_other_bodies(case, body, m):
    """The GEMV body (by default only for shapes the dot body cannot tile) and the XLA one
    (by default from `XLA_MIN_ROWS` rows) at rows where they do not run by default."""
    fmt, granularity, pack_axis, k, n, dtype = case
    q = weight(fmt, k, n, granularity, pack_axis)
    x = activations(m, k, dtype, seed=3)
    y = pallas.weight_only_matmul(x, q, interpret=INTERPRET, body=body)
    assert pallas.blocks_for(q, m, body=body).body == body
    assert y.shape == (m, n) and y.dtype == dtype
    assert_close(y, reference(x, q), dtype)


def test_default_bodies():
    q = weight("int4", 256, 128, PerGroup(64, 0))
    assert pallas.blocks_for(q, 1).body == "dot"
    assert pallas.blocks_for(q, pallas.XLA_MIN_ROWS).body == "xla"
    assert pallas.blocks_for(q, pallas.XLA_MIN_ROWS, pallas.Blocks(128, 0, 0, 0)).body == "dot"
    small_groups = weight("int4", 128, 64, PerGroup(8, 0))
    assert pallas.blocks_for(small_groups, 4).body == "gemv"
    with pytest.raises(ValueError, match="body='tiles'"):
        pallas.blocks_for(q, 1, body="tiles")


@pytest.mark.parametrize(
    "blocks",
    [
        dict(block_n=32, block_k=16, split_k=4),
        dict(block_n=64, block_k=64, split_k=1, num_warps=8),
        dict(block_n=128, block_k=2, split_k=2),
    ],
)
@pytest.mark.parametrize("fmt, pack_axis", [("int4", None), ("uint4", 0), ("int8", None)])
def test_gemv_explicit_blocks(blocks, fmt, pack_axis):
    q = weight(fmt, 256, 128, PerGroup(64, 0), pack_axis)
    if blocks["block_k"] < 2 * (pack_axis == 0):
        pytest.skip("packed along K a step takes two rows at least")
    x = activations(2, 256, jnp.bfloat16, seed=4)
    y = pallas.weight_only_matmul(
        x, q, out_dtype=jnp.float32, interpret=INTERPRET, body="gemv", **blocks
    )
    assert pallas.blocks_for(q, 2, body="gemv").m == 2
    assert_close(y, reference(x, q), jnp.bfloat16)


def test_gemv_bad_requests_raise():
    q = weight("int4", 256, 128, PerGroup(64, 0))
    x = activations(3, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="block_m = the rows rounded up"):
        pallas.weight_only_matmul(x, q, interpret=INTERPRET, body="gemv", block_m=16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        pallas.weight_only_matmul(activations(17, 256, jnp.bfloat16), q, body="gemv")
    with pytest.raises(ValueError, match="block_k=128"):
        pallas.weight_only_matmul(x, q, interpret=INTERPRET, body="gemv", block_k=128)
    with pytest.raises(ValueError, match="is CUDA's"):
        pallas.weight_only_matmul(x, q, interpret=INTERPRET, body="gemv", platform="tpu")


@pytest.mark.parametrize("fmt", ["int4", "uint4"])
@pytest.mark.parametrize(
    "blocks",
    [
        dict(block_m=16, block_n=32, block_k=32, split_k=2),
        dict(block_n=64, block_k=64, split_k=1),
        # Tiles over 64 rows dequantize the weight tile before the dot (scales after it below).
        dict(block_m=128, block_n=64, block_k=32, split_k=2, num_warps=8),
    ],
)
def test_explicit_blocks_and_split_k(blocks, fmt):
    q = weight(fmt, 256, 128, PerGroup(64, 0))
    x = activations(20, 256, jnp.bfloat16)
    y = pallas.weight_only_matmul(x, q, out_dtype=jnp.float32, interpret=INTERPRET, **blocks)
    assert y.dtype == jnp.float32
    assert_close(y, reference(x, q), jnp.bfloat16)


def test_leading_axes_and_input_scale():
    q = weight("int4", 128, 64, PerGroup(32, 0))
    smooth = jnp.asarray(np.linspace(0.5, 2.0, 128, dtype=np.float32)[:, None])
    q = dataclasses.replace(q, input_scale=smooth)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 128)), jnp.float32)
    y = pallas.weight_only_matmul(x, q, interpret=INTERPRET)
    assert y.shape == (2, 3, 64)
    assert_close(y.reshape(6, 64), reference(x.reshape(6, 128), q), jnp.float32)


def test_gradient_with_respect_to_x():
    q = weight("uint4", 128, 64, PerGroup(32, 0))
    x = activations(3, 128, jnp.float32)
    w = q.dequantize(jnp.float32)

    def loss(fn):
        return lambda x: jnp.sum(jnp.sin(fn(x)))

    got = jax.jit(jax.grad(loss(lambda x: pallas.weight_only_matmul(x, q, interpret=INTERPRET))))
    want = jax.grad(loss(lambda x: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)))
    assert_close(got(x), want(x), jnp.float32)


@pytest.mark.parametrize(
    "fmt, k, n, granularity, match",
    [
        ("int4", 128, 40, PerGroup(32, 0), "N=40"),  # no power-of-two block >= 32 divides 40
        ("int4", 128, 64, PerGroup(8, 0), "group size 8"),  # groups smaller than a K step
        ("int8", 24, 64, PerChannel((1,)), "K=24"),
    ],
)
def test_shapes_without_a_block_raise(fmt, k, n, granularity, match):
    """The dot body's 16-element floors (M = 17); the GEMV body has none along K."""
    q = weight(fmt, k, n, granularity)
    assert pallas.supports(q, 17) is None
    with pytest.raises(ValueError, match=match):
        pallas.weight_only_matmul(activations(17, k, jnp.float32), q, interpret=INTERPRET)
    if n % 32 == 0:
        x = activations(4, k, jnp.float32)
        assert pallas.supports(q, 4) == "pallas"
        assert_close(
            pallas.weight_only_matmul(x, q, interpret=INTERPRET), reference(x, q), jnp.float32
        )


def test_bad_requested_block_raises():
    q = weight("int4", 128, 64, PerGroup(32, 0))
    with pytest.raises(ValueError, match="block_k=64"):
        pallas.weight_only_matmul(activations(2, 128, jnp.float32), q, block_k=64)
    with pytest.raises(ValueError, match="block_n=48"):
        pallas.weight_only_matmul(activations(2, 128, jnp.float32), q, block_n=48)


def with_activation(q, fmt):
    return dataclasses.replace(q, activation=QuantConfig(format=fmt))


def test_supports_names_the_path():
    int4 = weight("int4", 128, 64, PerGroup(32, 0))
    int8 = weight("int8", 128, 64, PerChannel((1,)))
    fp8 = weight("fp8_e4m3fn", 128, 64, PerChannel((1,)))
    assert pallas.supports(int4, 1) == "pallas"
    assert pallas.supports(int8, 4096, jnp.float32) == "pallas"
    assert pallas.supports(with_activation(int8, "int8"), 8) == "xla"
    assert pallas.supports(with_activation(fp8, "fp8_e4m3fn"), 8) == "xla"
    assert pallas.supports(fp8, 8) is None  # fp8 weight-only: not a path here
    assert pallas.supports(weight("int3", 128, 64, PerGroup(32, 0)), 8) is None
    assert pallas.supports(int4, 8, jnp.float16) is None
    assert pallas.supports(jnp.zeros((128, 64)), 8) is None


@pytest.mark.parametrize("fmt, fn", [("int8", "int8_matmul"), ("fp8_e4m3fn", "fp8_matmul")])
def test_activation_quantized_products(fmt, fn):
    q = with_activation(weight(fmt, 256, 128, PerChannel((1,))), fmt)
    x = activations(5, 256, jnp.bfloat16)
    y = getattr(pallas, fn)(x, q)
    assert y.shape == (5, 128) and y.dtype == jnp.bfloat16
    # The same math in float: quantized activations times the dequantized weight.
    codes, scale = pallas.quantize_rows(x, fmt)
    xq = codes.astype(jnp.float32) * scale
    assert_close(y, reference(xq, q), jnp.bfloat16)
    # ... and close to the unquantized product (8-bit activations: a few percent).
    np.testing.assert_allclose(
        np.asarray(y, np.float32), reference(x, q), atol=0.08 * float(jnp.max(reference(x, q)))
    )


@pytest.mark.parametrize("fmt, fn", [("int8", "int8_matmul"), ("fp8_e4m3fn", "fp8_matmul")])
def test_activation_quantized_products_take_n_k_weights(fmt, fn):
    """A weight stored [N, K] (contract_axis=1, the layout cuBLASLt reads) gives the product
    of the same weight stored [K, N]."""
    w = np.random.default_rng(3).standard_normal((256, 128)).astype(np.float32)
    kn = with_activation(quantize(jnp.asarray(w), fmt, granularity=PerChannel((1,))), fmt)
    nk = with_activation(quantize(jnp.asarray(w.T), fmt, granularity=PerChannel((0,))), fmt)
    x = activations(5, 256, jnp.float32)
    want = getattr(pallas, fn)(x, kn)
    got = getattr(pallas, fn)(x, nk, contract_axis=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match=r"\[N, K\].*contract_axis=1"):
        getattr(pallas, fn)(x, kn, contract_axis=1)  # scales [1, N]: per input channel there
    with pytest.raises(ValueError, match="contract_axis=2"):
        getattr(pallas, fn)(x, nk, contract_axis=2)


def test_matmul_dispatches_and_falls_back():
    x = activations(3, 128, jnp.float32)
    for q in (
        weight("nf4", 128, 64, PerGroup(64, 0)),
        with_activation(weight("int8", 128, 64, PerChannel((1,))), "int8"),
        weight("int3", 128, 64, PerGroup(32, 0)),  # no path: the dequantized product
    ):
        y = pallas.matmul(x, q, interpret=INTERPRET)
        assert_close(y, reference(x, q), jnp.float32 if q.activation is None else jnp.bfloat16)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile the kernel for real")
def test_kernel_lowers_for_cuda_from_a_cpu_host(monkeypatch):
    """Lowers to Triton IR for an H100 without one, so CI catches unsupported kernel ops."""
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h100 = info.get_gpu_info_from_version(info.GpuVersion.H100)
    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: h100)
    for fmt, pack_axis, m, dtype in [
        ("int4", None, 1, jnp.bfloat16),
        ("uint4", 0, 300, jnp.bfloat16),
        ("nf4", None, 17, jnp.float32),
        ("int8", None, 64, jnp.bfloat16),
        ("uint4", 0, 2, jnp.bfloat16),
        ("int8", None, 8, jnp.float32),
        ("nf4", None, 1, jnp.bfloat16),
    ]:
        q = weight(fmt, 256, 128, PerGroup(64, 0), pack_axis)
        body = "gemv" if m in (2, 8) else None
        fn = jax.jit(functools.partial(pallas.weight_only_matmul, body=body))
        lowered = fn.trace(jnp.zeros((m, 256), dtype), q).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_default_blocks_fill_the_gpu_at_decode():
    # Shapes only: no 4096 x 4096 quantization needed to see the tiles.
    spec = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    q = jax.eval_shape(lambda w: quantize(w, "int4", granularity=PerGroup(128, 0)), spec)
    assert pallas.blocks_for(q, 1) == pallas.Blocks(16, 128, 128, split_k=8)
    assert pallas.blocks_for(q, 1, body="gemv") == pallas.Blocks(1, 256, 64, 16, body="gemv")
    assert pallas.blocks_for(q, 3, body="gemv") == pallas.Blocks(4, 256, 16, 16, body="gemv")
    assert pallas.blocks_for(q, 256) == pallas.Blocks(128, 128, 64, split_k=2)
    wide = pallas.blocks_for(q, 16, pallas.Blocks(0, 64, 0, 0))
    assert (wide.n, wide.split_k) == (64, 4)
