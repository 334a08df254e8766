"""w8a8 kernels: bit-exact integer products and the float epilogues, on every ISA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import kernels
from lowbit.kernels import _reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.status())


@pytest.fixture(params=kernels.supported_isas() or ["none"])
def isa(request):
    previous = kernels.set_isa(kernels.supported_isas()[-1])
    yield kernels.set_isa(request.param)
    kernels.set_isa(previous)


def make(k, n, m, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (1, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, dtype)
    return codes, scale, x


@pytest.mark.parametrize(("k", "n"), [(1, 1), (13, 7), (97, 33), (256, 64), (131, 160)])
@pytest.mark.parametrize("m", [1, 5, 21])
def test_int32_bit_exact(isa, k, n, m):
    codes, scale, x = make(k, n, m)
    w = kernels.prepare("w8a8", codes, scale)
    xq, _ = _reference.quantize_per_token(x)
    xq = xq.at[0, 0].set(-128)  # the full int8 range is accepted, not only [-127, 127]
    got = kernels.w8a8_matmul_int32(xq, w)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_reference.w8a8_matmul_int32(xq, codes)))


def test_int32_extreme_values(isa):
    k, n = 515, 19
    codes = jnp.full((k, n), -128, jnp.int8)
    w = kernels.prepare("w8a8", codes, jnp.ones((1, n)))
    for fill in (-128, 127):
        xq = jnp.full((3, k), fill, jnp.int8)
        np.testing.assert_array_equal(
            np.asarray(kernels.w8a8_matmul_int32(xq, w)),
            np.asarray(_reference.w8a8_matmul_int32(xq, codes)),
        )


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_entry_matches_reference(isa, out_dtype):
    codes, scale, x = make(150, 45, 6, seed=1)
    w = kernels.prepare("w8a8", codes, scale)
    xq, xs = _reference.quantize_per_token(x)
    bias = jnp.linspace(-2.0, 2.0, 45, dtype=jnp.float32)
    got = kernels.w8a8_linear_quantized(xq, xs, w, bias, out_dtype=out_dtype)
    ref = _reference.w8a8_linear_quantized(xq, xs, codes, scale, bias, out_dtype)
    assert got.dtype == out_dtype
    tol = 1e-6 if out_dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_quantization_matches_reference(isa, dtype):
    codes, scale, x = make(200, 40, 9, seed=2, dtype=dtype)
    x = x.at[3].set(0.0)  # all-zero row: scale 1, output = bias, no NaN
    w = kernels.prepare("w8a8", codes, scale)
    bias = jnp.arange(40, dtype=jnp.float32) / 10
    got = kernels.w8a8_linear(x, w, bias, out_dtype=jnp.float32)
    ref = _reference.w8a8_linear(x, codes, scale, bias, jnp.float32)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(bias), rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-4)
    assert kernels.w8a8_linear(x, w).dtype == dtype


def test_blocked_large_batch(isa):
    codes, scale, x = make(2100, 40, 70, seed=3)
    w = kernels.prepare("w8a8", codes, scale)
    xq, _ = _reference.quantize_per_token(x)
    np.testing.assert_array_equal(
        np.asarray(kernels.w8a8_matmul_int32(xq, w)),
        np.asarray(_reference.w8a8_matmul_int32(xq, codes)),
    )


def test_empty_batch_and_transposed_input():
    codes, scale, x = make(33, 17, 4, seed=4)
    w = kernels.prepare("w8a8", codes, scale)
    assert kernels.w8a8_linear(jnp.zeros((0, 33)), w).shape == (0, 17)
    assert kernels.w8a8_matmul_int32(jnp.zeros((0, 33), jnp.int8), w).shape == (0, 17)
    xt = jnp.asarray(x.T)
    got = jax.jit(lambda a, ww: kernels.w8a8_linear(a.T, ww))(xt, w)
    ref = _reference.w8a8_linear(x, codes, scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_isa_paths_agree_bit_exact():
    codes, scale, x = make(300, 70, 11, seed=5)
    w = kernels.prepare("w8a8", codes, scale)
    xq, _ = _reference.quantize_per_token(x)
    previous = kernels.set_isa("scalar")
    try:
        outs = []
        for name in kernels.supported_isas():
            kernels.set_isa(name)
            outs.append(np.asarray(kernels.w8a8_matmul_int32(xq, w)))
    finally:
        kernels.set_isa(previous)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
