"""QArray as a pytree value: jit, vmap, tree_map, sharding, layout ops, nbytes, invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import lowerings
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lowbit.qarray import PerChannel, PerGroup, QArray, quantize


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)


def test_pytree_leaves_and_static_metadata(x):
    q = quantize(x, "int4", granularity=PerGroup(16))
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2  # codes and scale; absent optional leaves are not leaves
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt.shape == q.shape and rebuilt.format == "int4"
    assert np.array_equal(rebuilt.dequantize(), q.dequantize())


def test_jit_round_trip_matches_eager(x):
    config = dict(granularity=PerGroup(16), symmetric=False, calibration=None)
    config.pop("calibration")
    eager = quantize(x, "uint4", **config)
    jitted = jax.jit(lambda v: quantize(v, "uint4", **config))(x)
    assert np.array_equal(eager.codes, jitted.codes)
    # Same codes; the dequantized floats may differ in the last ulp where XLA fuses differently.
    np.testing.assert_allclose(
        jax.jit(lambda q: q.dequantize())(jitted), eager.dequantize(), rtol=1e-6, atol=1e-6
    )


def test_an_eager_dequantize_is_one_program_a_layout():
    # A shape no other test uses: its first dequantize lowers one program (op by op it was
    # about ten), and a second call lowers nothing.
    x = jax.random.normal(jax.random.key(3), (40, 24), jnp.float32)
    q = quantize(x, "uint4", granularity=PerGroup(8, axis=0), symmetric=False)
    with lowerings() as lowered:
        first = q.dequantize(jnp.bfloat16)
        count = len(lowered)
        again = q.dequantize(jnp.bfloat16)
    assert count <= 1 and len(lowered) == count
    codes = np.asarray(q.unpacked_codes(), np.float32)
    scale = np.repeat(np.asarray(q.scale), 8, axis=0)
    zero = np.repeat(np.asarray(q.zero_point, np.float32), 8, axis=0)
    want = ((codes - zero) * scale).astype(jnp.bfloat16)
    assert first.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(first), want)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda q: q.dequantize(jnp.bfloat16))(q)), np.asarray(first)
    )


def test_vmap_over_leading_axis_slices_metadata(x):
    stacked = jnp.stack([x, 2 * x, -x])
    q = quantize(stacked, "int8", granularity=PerChannel(axes=(0, 2)))
    per_layer = jax.vmap(lambda layer: layer.dequantize())(q)
    np.testing.assert_array_equal(per_layer, q.dequantize())
    built = jax.vmap(lambda v: quantize(v, "int8", granularity=PerChannel()))(stacked)
    assert built.shape == stacked.shape
    np.testing.assert_array_equal(built.unpacked_codes(), q.unpacked_codes())
    # The same scales, but JAX 0.9's XLA divides by the grid's end in one program and
    # multiplies by its reciprocal in the other: 1 ulp apart there (equal on JAX 0.12).
    np.testing.assert_array_max_ulp(built.scale_values(), q.scale_values(), maxulp=1)


def test_tree_map_keeps_metadata(x):
    q = quantize(x, "int8", granularity=PerChannel())
    doubled = jax.tree_util.tree_map(lambda a: a, q)
    assert doubled.shape == q.shape and doubled.dtype == q.dtype


def test_nbytes_counts_packed_codes_and_scales(x):
    q = quantize(x, "int4", granularity=PerGroup(16))
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (64, 16)
    assert q.nbytes == 64 * 32 // 2 + (64 // 16) * 32 * 4
    q3 = quantize(x, "int3", granularity=PerChannel())
    assert q3.codes.shape == (64, 12)  # 32 codes of 3 bits = 12 bytes


def test_transpose_moves_codes_scales_and_packed_axis(x):
    q = quantize(x, "int4", granularity=PerGroup(16))
    t = q.T
    assert t.shape == (32, 64) and t.packed_axis == 0
    np.testing.assert_array_equal(t.dequantize(), q.dequantize().T)


def test_dtype_is_preserved():
    xb = jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16).reshape(8, 8)
    q = quantize(xb, "int8")
    assert q.dtype == jnp.bfloat16 and q.dequantize().dtype == jnp.bfloat16


def test_repr_is_readable(x):
    text = repr(quantize(x, "uint4", granularity=PerGroup(16), symmetric=False))
    assert "uint4" in text and "(64, 32)" in text and "asymmetric" in text


def test_check_rejects_inconsistent_scale(x):
    q = quantize(x, "int8", granularity=PerChannel())
    bad = QArray(
        codes=q.codes,
        scale=jnp.ones((1, 5)),
        zero_point=None,
        tensor_scale=None,
        format="int8",
        shape=q.shape,
        dtype=q.dtype,
    )
    with pytest.raises(ValueError, match="scale shape"):
        bad.check()


def test_sharding_places_scales_with_codes(x):
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 simulated devices")
    mesh = Mesh(devices.reshape(1, 8), ("data", "model"))
    w = jnp.tile(x, (1, 4))  # [64, 128]
    q = quantize(w, "int8", granularity=PerChannel())
    sharded = jax.device_put(q, NamedSharding(mesh, P(None, "model")))
    assert sharded.codes.sharding.spec == P(None, "model")
    assert sharded.scale.sharding.spec == P(None, "model")
    out = jax.jit(lambda q: q.dequantize())(sharded)
    np.testing.assert_array_equal(out, q.dequantize())
