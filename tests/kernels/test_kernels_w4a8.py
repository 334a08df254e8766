"""w4a8 (int4 weights x dynamic int8 activations): layout round trip and kernels on every ISA."""

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
            outs[name] = np.asarray(fn())
    finally:
        kernels.set_isa(names[-1])
    return outs


def make(k, n, m, group_size, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(rng.integers(0, 16, (k, n)), jnp.uint8)
    groups = 1 if group_size is None else -(-k // group_size)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (groups, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, dtype)
    return codes, scale, x


@pytest.mark.parametrize(("k", "n", "gs"), [(8, 1, None), (100, 17, 32), (300, 40, None)])
def test_layout_round_trip(k, n, gs):
    codes, scale, _ = make(k, n, 1, gs)
    w = kernels.pack("w4a8", codes, scale, group_size=gs)
    back = kernels.prepared_to_logical(w)
    np.testing.assert_array_equal(np.asarray(back["codes"]), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(back["scale"]), np.asarray(scale))
    assert back["zero_point"] is None


@pytest.mark.parametrize(
    ("k", "n", "m", "gs"), [(64, 16, 1, 32), (200, 33, 5, 40), (300, 40, 21, None)]
)
def test_matches_reference_on_every_isa(k, n, m, gs):
    codes, scale, x = make(k, n, m, gs, seed=k)
    x = x.at[0].set(0.0)  # an all-zero row gives the bias, no NaN
    w = kernels.pack("w4a8", codes, scale, group_size=gs)
    bias = jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)
    ref = np.asarray(_reference.w4a8_linear(x, codes, scale, gs, bias, jnp.float32))
    outs = on_each_isa(lambda: kernels.w4a8_linear(x, w, bias))
    for got in outs.values():
        np.testing.assert_array_equal(got[0], np.asarray(bias))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_reference_is_close_to_float_math_and_bf16_runs():
    codes, scale, x = make(128, 24, 3, 64, seed=7, dtype=jnp.bfloat16)
    w = kernels.pack("w4a8", codes, scale, group_size=64)
    wf = _reference.dequantize("int4", codes, scale, None, 64)
    exact = np.asarray(x.astype(jnp.float32) @ wf)
    got = kernels.w4a8_linear(x, w)
    assert got.dtype == jnp.bfloat16
    # int8 activations: error about amax / 254 per element, times sum |w|.
    bound = np.abs(np.asarray(x, np.float32)).max(1, keepdims=True) / 254 * np.abs(wf).sum(0)
    assert np.all(np.abs(np.asarray(got, np.float32) - exact) <= bound * 1.05 + 0.05)


def test_bad_group_size_names_the_rule():
    codes, scale, _ = make(64, 16, 1, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.pack("w4a8", codes, scale, group_size=12)
