"""w8a8 kernels: bit-exact integer products and the float epilogues, on every ISA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import kernels
from lowbit.kernels import _reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.status())


def on_each_isa(fn):
    """fn() evaluated on every ISA path this CPU supports (as numpy), the best path restored."""
    names = kernels.supported_isas()
    outs = {}
    try:
        for name in names:
            assert kernels.set_isa(name) == name
            outs[name] = jax.tree.map(np.asarray, fn())
    finally:
        kernels.set_isa(names[-1])
    return outs


def make(k, n, m, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (1, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, dtype)
    return codes, scale, x


@pytest.mark.parametrize(("k", "n"), [(1, 1), (13, 7), (97, 33), (131, 160)])
def test_int32_bit_exact(k, n):
    codes, scale, x = make(k, n, 21)
    w = kernels.pack("w8a8", codes, scale)
    xq, _ = _reference.quantize_per_token(x)
    xq = xq.at[0, 0].set(-128)  # the full int8 range is accepted, not only [-127, 127]
    ref = np.asarray(_reference.w8a8_matmul_int32(xq, codes))
    outs = on_each_isa(
        lambda: (kernels.w8a8_matmul_int32(xq, w), kernels.w8a8_matmul_int32(xq[:1], w))
    )
    for got, got1 in outs.values():
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(got1, ref[:1])


def test_int32_extreme_values():
    k, n = 515, 19
    codes = jnp.full((k, n), -128, jnp.int8)
    w = kernels.pack("w8a8", codes, jnp.ones((1, n)))
    xq = jnp.asarray(np.repeat(np.array([[-128], [127], [0]], np.int8), k, axis=1))
    ref = np.asarray(_reference.w8a8_matmul_int32(xq, codes))
    for got in on_each_isa(lambda: kernels.w8a8_matmul_int32(xq, w)).values():
        np.testing.assert_array_equal(got, ref)


def test_quantized_entry_matches_reference():
    codes, scale, x = make(150, 45, 6, seed=1)
    w = kernels.pack("w8a8", codes, scale)
    xq, xs = _reference.quantize_per_token(x)
    bias = jnp.linspace(-2.0, 2.0, 45, dtype=jnp.float32)
    ref = np.asarray(_reference.w8a8_linear_quantized(xq, xs, codes, scale, bias, jnp.float32))
    outs = on_each_isa(
        lambda: (
            kernels.w8a8_linear_quantized(xq, xs, w, bias),
            kernels.w8a8_linear_quantized(xq, xs, w, bias, out_dtype=jnp.bfloat16),
        )
    )
    for y32, y16 in outs.values():
        np.testing.assert_allclose(y32, ref, rtol=1e-6, atol=1e-6)
        assert y16.dtype == jnp.bfloat16
        np.testing.assert_allclose(y16.astype(np.float32), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_quantization_matches_reference(dtype):
    codes, scale, x = make(200, 40, 9, seed=2, dtype=dtype)
    x = x.at[3].set(0.0)  # all-zero row: scale 1, output = bias, no NaN
    w = kernels.pack("w8a8", codes, scale)
    bias = jnp.arange(40, dtype=jnp.float32) / 10
    ref = np.asarray(_reference.w8a8_linear(x, codes, scale, bias, jnp.float32))
    outs = on_each_isa(
        lambda: (kernels.w8a8_linear(x, w, bias, out_dtype=jnp.float32), kernels.w8a8_linear(x, w))
    )
    for got, native in outs.values():
        assert not np.isnan(got).any()
        np.testing.assert_array_equal(got[3], np.asarray(bias))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
        assert native.dtype == dtype


def test_blocked_large_batch():
    codes, scale, x = make(2100, 40, 70, seed=3)
    w = kernels.pack("w8a8", codes, scale)
    xq, _ = _reference.quantize_per_token(x)
    ref = np.asarray(_reference.w8a8_matmul_int32(xq, codes))
    for got in on_each_isa(lambda: kernels.w8a8_matmul_int32(xq, w)).values():
        np.testing.assert_array_equal(got, ref)


def test_empty_batch_and_transposed_input():
    codes, scale, x = make(33, 17, 4, seed=4)
    w = kernels.pack("w8a8", codes, scale)
    assert kernels.w8a8_linear(jnp.zeros((0, 33)), w).shape == (0, 17)
    assert kernels.w8a8_matmul_int32(jnp.zeros((0, 33), jnp.int8), w).shape == (0, 17)
    xt = jnp.asarray(x.T)
    got = jax.jit(lambda a, ww: kernels.w8a8_linear(a.T, ww))(xt, w)
    ref = _reference.w8a8_linear(x, codes, scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_fused_quantization_is_identical_on_every_isa():
    # The vectorized quantizers must round exactly like the portable loop: ties at .5 after
    # the division, tails shorter than a vector, rows of very different scales.
    codes, scale, x = make(203, 33, 37, seed=5)
    x = x * jnp.logspace(-3, 3, 37)[:, None]
    x = x.at[1, :8].set(jnp.asarray([0.5, -0.5, 1.5, -2.5, 127.0, -127.0, 63.5, 0.0]))
    w = kernels.pack("w8a8", codes, scale)
    outs = on_each_isa(lambda: kernels.w8a8_linear(x, w))
    for got in outs.values():
        np.testing.assert_array_equal(got, outs["scalar"])
