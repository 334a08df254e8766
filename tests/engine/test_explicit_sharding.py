"""Quantized weights on a mesh with explicit axes (shardings are part of the types): quantize,
run, load and shard_map keep each weight's sharding and give the unsharded values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit
from lowbit.engine._compat import EXPLICIT_AXES_QUANTIZE
from lowbit.io import load_checkpoint, save_checkpoint
from lowbit.qarray import PerGroup, QArray, quantize

HAS_EXPLICIT_AXES = hasattr(jax, "set_mesh") and hasattr(jax.sharding, "AxisType")
pytestmark = pytest.mark.skipif(not HAS_EXPLICIT_AXES, reason="explicit mesh axes need a newer JAX")
# Tests that quantize weights sharded on explicit axes (see `EXPLICIT_AXES_QUANTIZE`).
quantizes = pytest.mark.skipif(
    not EXPLICIT_AXES_QUANTIZE, reason="quantizing on explicit mesh axes needs JAX 0.10 or newer"
)

# Large enough for the CPU kernel route (which sharded weights must not take).
W = jax.random.normal(jax.random.key(0), (512, 256)) / 16
X = jax.random.normal(jax.random.key(1), (4, 512))
COLUMNS, ROWS = P(None, "x"), P("x", None)


def _mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


def _linear(params, x):
    return x @ params["kernel"]


_run = jax.jit(lowbit.run(_linear))


@quantizes
@pytest.mark.parametrize("spec", [COLUMNS, ROWS], ids=["columns", "rows"])
@pytest.mark.parametrize(
    "recipe", ["int8", "int4w_g32_asym", "nf4", "int8_dynamic_activation_int8_weight"]
)
def test_sharded_weights_run_and_keep_their_sharding(recipe, spec):
    expected = _run(lowbit.quantize({"kernel": W}, recipe), X)
    mesh = _mesh()
    with jax.set_mesh(mesh):
        params = lowbit.quantize({"kernel": jax.device_put(W, NamedSharding(mesh, spec))}, recipe)
        weight = params["kernel"]
        assert isinstance(weight, QArray)  # no single-device kernel layout for a split weight
        assert weight.codes.sharding.spec == spec
        out = _run(params, X)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-4, rtol=2e-4)


@quantizes
@pytest.mark.parametrize("spec", [COLUMNS, ROWS], ids=["columns", "rows"])
def test_a_one_device_explicit_mesh_gets_the_kernel_layout(spec):
    # `jax.make_mesh` gives explicit axes by default: one device is the common case.
    expected = _run(lowbit.quantize({"kernel": W}, "int4w_g32_asym"), X)
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    w = jax.device_put(W, NamedSharding(mesh, spec))
    params = lowbit.quantize({"kernel": w}, "int4w_g32_asym")
    assert not isinstance(params["kernel"], QArray)  # laid out for the CPU kernel
    with jax.set_mesh(mesh):
        out = _run(params, jax.device_put(X, NamedSharding(mesh, P())))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-4, rtol=2e-4)


@quantizes
def test_a_group_that_straddles_two_shards_is_refused_with_the_parameter():
    mesh = _mesh()
    with jax.set_mesh(mesh):
        w = jax.device_put(W[:256], NamedSharding(mesh, ROWS))  # 32 rows per device
        with pytest.raises(ValueError, match=r"'kernel'.*block of 64 along axis 0.*pieces of 32"):
            lowbit.quantize({"kernel": w}, "int4w_g64")


def test_load_checkpoint_onto_an_explicit_mesh(tmp_path):
    q = lowbit.quantize({"kernel": W}, "int4w_g32_asym")
    expected = _run(q, X)
    save_checkpoint(tmp_path / "ckpt", q)
    mesh = _mesh()
    with jax.set_mesh(mesh):
        loaded = load_checkpoint(tmp_path / "ckpt", sharding=NamedSharding(mesh, COLUMNS))
        assert loaded["kernel"].codes.sharding.spec == COLUMNS
        out = _run(loaded, X)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-4, rtol=2e-4)


@quantizes
def test_shard_map_over_quantized_weights_sees_local_shapes():
    expected = _run(lowbit.quantize({"kernel": W}, "int4w_g32_asym"), X)
    mesh = _mesh()
    seen = []

    def body(params, x):
        seen.append(params["kernel"].shape)
        return x @ params["kernel"]

    with jax.set_mesh(mesh):
        w = jax.device_put(W, NamedSharding(mesh, COLUMNS))
        params = lowbit.quantize({"kernel": w}, "int4w_g32_asym")
        local = jax.shard_map(lowbit.run(body), in_specs=(COLUMNS, P()), out_specs=COLUMNS)
        out = jax.jit(local)(params, X)
    assert seen[-1] == (512, 256 // 8)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-4, rtol=2e-4)
    assert jnp.isfinite(out).all()


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_a_replicated_weight_on_a_mesh_runs_with_and_without_the_mesh_in_context(axis_type):
    # A logical QArray (as restored from a checkpoint): its kernel layout is built in the call.
    params = {"kernel": quantize(W, "int4", granularity=PerGroup(32, axis=0))}
    expected = _run(params, X)
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
    with jax.set_mesh(mesh):
        replicated = jax.device_put(params, NamedSharding(mesh, P()))
        inside = jax.jit(lowbit.run(_linear))(replicated, X)
    outside = jax.jit(lowbit.run(_linear))(replicated, np.asarray(X))  # no mesh in context
    for out in (inside, outside):
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(EXPLICIT_AXES_QUANTIZE, reason="only where JAX cannot quantize on them")
def test_an_old_jax_refuses_explicit_axes_with_the_fix():
    mesh = _mesh()
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="AxisType.Auto axes, or JAX 0.10"):
        lowbit.quantize({"kernel": jax.device_put(W, NamedSharding(mesh, COLUMNS))}, "nf4")
