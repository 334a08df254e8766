"""Packing: round trips through the prepared layouts, argument checks, `supports`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import kernels
from lowbit.kernels._layout import PreparedWeight


def codes_for(kind, k, n, rng):
    if kind in ("int8", "w8a8"):
        return jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    if kind == "fp8":
        return jnp.asarray(rng.standard_normal((k, n)), jnp.float8_e4m3fn)
    return jnp.asarray(rng.integers(0, 16, (k, n)), jnp.uint8)


@pytest.mark.parametrize(
    ("kind", "k", "n", "group_size"),
    [
        ("int8", 37, 19, None),
        ("fp8", 8, 3, None),
        ("int4", 70, 33, 32),
        ("uint4", 511, 16, None),
        ("int4", 576, 17, None),  # per-channel chunk 192 divides K: no padding
        ("int8", 1000, 5, None),
        ("nf4", 64, 17, 64),
        ("fp4", 96, 20, 32),
        ("w8a8", 23, 29, None),
    ],
)
def test_round_trip(kind, k, n, group_size):
    rng = np.random.default_rng(0)
    codes = codes_for(kind, k, n, rng)
    groups = 1 if group_size is None else -(-k // group_size)
    scale = jnp.asarray(rng.uniform(0.1, 1.0, (groups, n)), jnp.float32)
    zp = jnp.asarray(rng.uniform(0, 15, (groups, n)), jnp.float32) if kind == "uint4" else None
    w = kernels.pack(kind, codes, scale, zp, group_size)
    assert isinstance(w, PreparedWeight) and (w.k, w.n) == (k, n)
    back = kernels.prepared_to_logical(w)
    np.testing.assert_array_equal(
        np.asarray(back["codes"]).view(np.uint8), np.asarray(codes).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(back["scale"]), np.asarray(scale))
    if zp is not None:
        np.testing.assert_array_equal(np.asarray(back["zero_point"]), np.asarray(zp))
    # A pytree: passes through jit with the static metadata intact.
    same = jax.jit(lambda t: t)(w)
    assert same.kind == kind and same.storage_group == w.storage_group


def test_prepare_rejects_bad_arguments():
    rng = np.random.default_rng(1)
    codes = codes_for("int4", 64, 8, rng)
    with pytest.raises(ValueError, match="kind"):
        kernels.pack("int3", codes, jnp.ones((1, 8)))
    with pytest.raises(TypeError, match="codes"):
        kernels.pack("int8", codes, jnp.ones((1, 8)))
    with pytest.raises(ValueError, match="scale"):
        kernels.pack("int4", codes, jnp.ones((3, 8)), group_size=32)
    with pytest.raises(ValueError, match="group_size"):
        kernels.pack("int4", codes, jnp.ones((3, 8)), group_size=21)
    with pytest.raises(ValueError, match="zero_point"):
        kernels.pack("uint4", codes, jnp.ones((1, 8)))
    w = kernels.pack("int4", codes, jnp.ones((1, 8)))
    with pytest.raises(ValueError, match="x has shape"):
        kernels.weight_only_linear(jnp.ones((2, 63)), w)
    with pytest.raises(TypeError, match="x dtype"):
        kernels.weight_only_linear(jnp.ones((2, 64), jnp.float16), w)
    with pytest.raises(ValueError, match="w.kind"):
        kernels.w8a8_linear(jnp.ones((2, 64)), w)


def test_supports_and_status():
    assert isinstance(kernels.status(), str)
    ok = kernels.available()
    assert kernels.supports("int4", 4096, 4096, 64, jnp.float32) is ok
    assert kernels.supports("w8a8", 1024, 10, None, jnp.bfloat16) is ok
    assert not kernels.supports("int4", 64, 64, 63, jnp.float32)
    assert kernels.supports("int8", 64, 64, 32, jnp.float32) is ok
    assert not kernels.supports("w8a8", 64, 64, 32, jnp.float32)
    assert not kernels.supports("nf4", 64, 64, None, jnp.float16)
    assert not kernels.supports("int2", 64, 64, None, jnp.float32)
    assert not kernels.supports("w8a8", 1 << 20, 64, None, jnp.float32)


def test_per_channel_storage_group_divides_k_when_it_can():
    from lowbit.kernels._layout import storage_group

    assert storage_group("int4", 576, None) == 192
    assert storage_group("int8", 4096, None) == 256
    assert storage_group("int4", 1000, None) == 250
    # 2 * 257: no even divisor in [64, 256], so K is padded to a multiple of 256.
    assert storage_group("int4", 514, None) == 256
    assert storage_group("int4", 37, None) == 38
    assert storage_group("int4", 576, 32) == 32
