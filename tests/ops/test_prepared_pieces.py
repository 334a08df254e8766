"""`PreparedPieces`: a weight split over a mesh axis, each device's piece in the CPU kernels'
layout. It enters a `shard_map` that splits it the same way as those pieces; any other use
sees its logical QArray (the pieces joined), counted by the engine, never silently."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import lowbit
from lowbit import kernels
from lowbit.engine import trace_report
from lowbit.models._sharding import _place_qarray, _prepared_pieces, generation_sharding
from lowbit.ops import PreparedPieces

pytestmark = pytest.mark.skipif(
    not kernels.available() or jax.default_backend() != "cpu" or jax.device_count() < 2,
    reason="needs the CPU kernels and 2 (simulated) devices",
)

K, N = 512, 256  # each piece of either split (256 x 256 or 512 x 128) is run by a kernel


@functools.cache
def _weight():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((K, N), np.float32))
    q = lowbit.quantize({"kernel": w}, "int4w_g32_asym", kernel_layouts=False)["kernel"]
    return w, q


def _pieces(axis: int) -> tuple[PreparedPieces, jax.sharding.Mesh]:
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    plan = generation_sharding(mesh)
    _, q = _weight()
    pieces = _prepared_pieces(_place_qarray(q, axis, plan, "kernel"), axis, plan)
    assert isinstance(pieces, PreparedPieces)
    return pieces, plan.mesh


@pytest.mark.parametrize("axis", [0, 1], ids=["rows", "columns"])
def test_pieces_join_back_into_the_logical_weight(axis):
    pieces, _ = _pieces(axis)
    _, q = _weight()
    joined = pieces.logical()
    assert joined.shape == q.shape == pieces.shape
    for field in ("codes", "scale", "zero_point"):
        np.testing.assert_array_equal(getattr(joined, field), getattr(q, field))


@pytest.mark.parametrize("axis", [0, 1], ids=["rows", "columns"])
def test_a_shard_map_splitting_like_the_pieces_runs_the_kernel_on_each(axis):
    """With the shard_map's default check of varying axes: the kernel call's output is typed
    like its pure-JAX branch's (it failed to trace before, for any weight a kernel runs)."""
    pieces, mesh = _pieces(axis)
    w, q = _weight()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, K), np.float32))
    spec = P("model", None) if axis == 0 else P(None, "model")
    x_spec = P(None, "model") if axis == 0 else P()

    def body(x, w):
        y = x @ w
        return jax.lax.psum(y, "model") if axis == 0 else y

    out_spec = P() if axis == 0 else P(None, "model")
    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, spec), out_specs=out_spec)
    report = trace_report(f, x, pieces)
    assert not report.fallbacks and "dot_general:cpu_kernel_uint4" in report.quantized_ops
    got = jax.jit(lowbit.run(f))(x, pieces)
    np.testing.assert_allclose(got, jax.jit(lowbit.run(f))(x, q), rtol=1e-5, atol=1e-4)


def test_any_other_use_is_the_logical_weight_and_counted():
    pieces, mesh = _pieces(1)
    _, q = _weight()
    x = jnp.ones((2, K), jnp.float32)
    # A shard_map that splits the weight another way: the logical QArray is split instead.
    other = jax.shard_map(
        lambda x, w: jax.lax.psum(x @ w, "model"),
        mesh=mesh,
        in_specs=(P(None, "model"), P("model", None)),
        out_specs=P(),
    )
    np.testing.assert_allclose(
        jax.jit(lowbit.run(other))(x, pieces), jax.jit(lowbit.run(other))(x, q), rtol=1e-5
    )
    # Outside any shard_map: a layout op dequantizes it, and the report says so.
    report = trace_report(lambda x, w: x @ w.reshape(K, N), x, pieces)
    assert report.fallbacks, report
