"""Weight-only kernels against the pure-JAX reference, on every ISA path this CPU runs."""

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


def make_weight(kind, k, n, group_size, seed=0):
    rng = np.random.default_rng(seed)
    groups = 1 if group_size is None else -(-k // group_size)
    if kind == "int8":
        codes = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    elif kind == "fp8":
        codes = jnp.asarray(rng.standard_normal((k, n)) * 20, jnp.float8_e4m3fn)
    else:
        codes = jnp.asarray(rng.integers(0, 16, (k, n)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.01, 0.1, (groups, n)), jnp.float32)
    zp = jnp.asarray(rng.uniform(0, 15, (groups, n)), jnp.float32) if kind == "uint4" else None
    return codes, scale, zp


CASES = [
    # kind, K, N, group_size
    ("int8", 131, 37, None),
    ("int8", 64, 16, None),
    ("fp8", 97, 33, None),
    ("int4", 128, 48, 32),
    ("int4", 131, 17, None),
    ("int4", 200, 24, 64),  # ragged last group
    ("uint4", 256, 40, 128),
    ("uint4", 67, 5, None),
    ("nf4", 192, 31, 64),
    ("nf4", 512, 16, 256),
]


@pytest.mark.parametrize(("kind", "k", "n", "group_size"), CASES)
@pytest.mark.parametrize("m", [1, 7])
def test_matches_reference(isa, kind, k, n, group_size, m):
    codes, scale, zp = make_weight(kind, k, n, group_size)
    w = kernels.prepare(kind, codes, scale, zp, group_size)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k)), jnp.float32)
    bias = jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)
    y = kernels.weight_only_linear(x, w, bias)
    ref = _reference.weight_only_linear(x, kind, codes, scale, zp, group_size, bias)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4", "fp8"])
def test_bf16_in_and_out(isa, kind):
    group_size = 32 if kind in ("int4", "nf4") else None
    codes, scale, zp = make_weight(kind, 96, 40, group_size, seed=3)
    w = kernels.prepare(kind, codes, scale, zp, group_size)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 96)), jnp.bfloat16)
    y = kernels.weight_only_linear(x, w)
    ref = _reference.weight_only_linear(x, kind, codes, scale, zp, group_size)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2
    )
    y32 = kernels.weight_only_linear(x, w, out_dtype=jnp.float32)
    ref32 = _reference.weight_only_linear(x, kind, codes, scale, zp, group_size, None, jnp.float32)
    np.testing.assert_allclose(np.asarray(y32), np.asarray(ref32), rtol=1e-5, atol=1e-4)


def test_large_batch_uses_blocked_path(isa):
    # M above the small-batch threshold and K above one K-block exercise the blocked loops.
    codes, scale, zp = make_weight("uint4", 1100, 70, 50)
    w = kernels.prepare("uint4", codes, scale, zp, 50)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((70, 1100)), jnp.float32)
    y = kernels.weight_only_linear(x, w)
    ref = _reference.weight_only_linear(x, "uint4", codes, scale, zp, 50)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-3)


def test_empty_batch_and_leading_dims():
    codes, scale, zp = make_weight("int4", 64, 20, 32)
    w = kernels.prepare("int4", codes, scale, zp, 32)
    assert kernels.weight_only_linear(jnp.zeros((0, 64)), w).shape == (0, 20)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 64)), jnp.float32)
    y = kernels.weight_only_linear(x, w)
    ref = _reference.weight_only_linear(x.reshape(6, 64), "int4", codes, scale, zp, 32)
    np.testing.assert_allclose(np.asarray(y).reshape(6, 20), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_transposed_input_under_jit():
    codes, scale, zp = make_weight("nf4", 64, 24, 64)
    w = kernels.prepare("nf4", codes, scale, zp, 64)
    xt = jnp.asarray(np.random.default_rng(6).standard_normal((64, 9)), jnp.float32)
    y = jax.jit(lambda a, ww: kernels.weight_only_linear(a.T, ww))(xt, w)
    ref = _reference.weight_only_linear(xt.T, "nf4", codes, scale, zp, 64)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_isa_paths_agree():
    codes, scale, zp = make_weight("uint4", 160, 50, 32)
    w = kernels.prepare("uint4", codes, scale, zp, 32)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((3, 160)), jnp.float32)
    previous = kernels.set_isa("scalar")
    try:
        outs = {}
        for name in kernels.supported_isas():
            assert kernels.set_isa(name) == name
            outs[name] = np.asarray(kernels.weight_only_linear(x, w))
    finally:
        kernels.set_isa(previous)
    base = outs["scalar"]
    for out in outs.values():
        np.testing.assert_allclose(out, base, rtol=1e-5, atol=1e-4)
