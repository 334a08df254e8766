"""The engine's walker: one walk records every use of a parameter, through every sub-jaxpr."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lowbit.engine import kernel_axes
from lowbit.engine._axes import contraction_axes
from lowbit.engine._walker import SUB_JAXPRS, ops_fed, trace, walk
from lowbit.qarray import PerChannel, QuantConfig, quantize

K, N = 16, 8
X = jnp.ones((2, K))
W = jnp.ones((K, N))


def _walk(fn, *args):
    """Walk of fn(*args) following the first argument only."""
    return walk(jax.make_jaxpr(fn)(*args), [0])


def _dot_uses(record):
    return [u for u in record.sites if u.primitive == "dot_general"]


def test_top_level_use_records_operand_dimension_numbers_and_steps():
    (use,) = _dot_uses(_walk(lambda w, x: x @ w.T.T, W, X))
    assert use.leaf == 0 and use.operand == 1 and use.where == ()
    assert use.params["dimension_numbers"][0] == ((1,), (0,))
    assert [s.primitive for s in use.steps] == ["transpose", "transpose"]
    assert use.partners[0] is None


def test_scan_consts_and_stacked_xs():
    stacked = jnp.ones((3, K, K))

    def fn(p, x):
        def body(h, w):
            return h @ w + h @ p["sq"], None

        return jax.lax.scan(body, x, p["stack"])[0]

    # Leaves of a dict flatten in key order: sq (0), stack (1).
    record = walk(jax.make_jaxpr(fn)({"stack": stacked, "sq": jnp.ones((K, K))}, X), [0, 1])
    uses = {u.leaf: u for u in _dot_uses(record)}
    assert uses[0].where == ("scan",) and uses[0].steps == ()
    (step,) = uses[1].steps
    assert (step.primitive, step.in_shape, step.out_shape) == ("scan_slice", (3, K, K), (K, K))
    assert ops_fed(record) == {0: frozenset({"dot_general"}), 1: frozenset({"dot_general"})}


def test_while_body_and_cond_branches():
    def fn(w, x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w.T.T)

        h = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]
        return jax.lax.cond(h.sum() > 0, lambda h: jnp.take(w, jnp.array([0, 1]), 0), jnp.tanh, h)

    record = _walk(fn, jnp.ones((K, K)), X)
    where = sorted((u.where, u.op) for u in record.sites if u.op != "other")
    assert where == [
        (("cond", "branch 1"), "gather"),
        (("while", "body"), "dot_general"),
    ]


def test_shard_map_maps_global_to_per_device_block():
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))

    @jax.jit
    def fn(w, x):
        specs = {"in_specs": (P(None, "model"), P()), "out_specs": P(None, "model")}
        f = jax.shard_map(lambda w, x: x @ w, mesh=mesh, **specs)
        return f(w, x)

    (use,) = _dot_uses(_walk(fn, W, X))
    assert use.where == ("shard_map",)
    (step,) = use.steps
    assert (step.primitive, step.in_shape, step.out_shape) == ("shard_map", (K, N), (K, N // 2))


def test_jit_remat_and_custom_jvp_pass_values_back_out():
    transposed = jax.jit(lambda w: w.T)
    relu = jax.custom_jvp(lambda w: w)
    relu.defjvp(lambda p, t: (p[0], t[0]))

    def fn(w, x):
        return x @ jax.checkpoint(lambda w: relu(w))(transposed(w).T)

    (use,) = _dot_uses(_walk(fn, W, X))
    assert use.where == () and [s.primitive for s in use.steps] == ["transpose", "transpose"]


def test_both_operands_parameters_feed_no_weight_use():
    record = walk(jax.make_jaxpr(lambda a, b: a @ b)(W.T, W), [0, 1])
    assert ops_fed(record) == {}
    assert contraction_axes(record, {1}) == {1: 0}  # `a` is no quantized weight
    assert contraction_axes(record, {0, 1}) == {}  # both quantized: no linear layer


def test_every_sub_jaxpr_rule_name_is_an_engine_rule():
    from lowbit.engine import _compat

    assert set(SUB_JAXPRS) <= set(_compat.PRIMITIVE_ALIASES)


def _qweight(shape, axis=0):
    w = jax.random.normal(jax.random.key(0), shape)
    return quantize(w, QuantConfig(format="int8", granularity=PerChannel((1 - axis,))))


@pytest.mark.parametrize("flow", ["scan", "while", "cond"])
def test_kernel_axes_follow_control_flow(flow):
    def fn(p, x):
        if flow == "scan":
            return jax.lax.scan(lambda h, _: (h @ p["w"].T, None), x, None, length=2)[0]
        if flow == "while":
            return jax.lax.fori_loop(0, 2, lambda i, h: h @ p["w"].T, x)
        return jax.lax.cond(x.sum() > 0, lambda h: h @ p["w"].T, lambda h: -h, x)

    axes = kernel_axes(fn, {"w": _qweight((K, K))}, X)
    keys = (jax.tree_util.SequenceKey(0), jax.tree_util.SequenceKey(0))
    assert axes == {(*keys, jax.tree_util.DictKey("w")): 1}


def test_kernel_axes_skip_shard_map_bodies():
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))

    def fn(p, x):
        specs = {"in_specs": (P(None, "model"), P()), "out_specs": P(None, "model")}
        f = jax.shard_map(lambda w, x: x @ w, mesh=mesh, **specs)
        return f(p["w"], x)

    assert kernel_axes(fn, {"w": _qweight((K, N))}, X) == {}


def test_trace_follows_only_what_it_is_told():
    traced = trace(lambda p, x: x @ p, (W, X), {}, lambda path, _: path[1].idx == 0)
    assert len(traced.leaves) == 2
    (use,) = traced.record.sites
    assert use.leaf == 0 and use.partners == (None, traced.record.sites[0].partners[1])
    assert ops_fed(traced.record) == {0: frozenset({"dot_general"})}


def test_kernel_axes_follow_bfloat16_casts_not_integer_ones():
    bf16 = lambda w, x: x.astype(jnp.bfloat16) @ w.T.astype(jnp.bfloat16)
    assert contraction_axes(_walk(bf16, W.T, X), {0}) == {0: 1}
    as_int = lambda w, x: x.astype(jnp.int32) @ w.astype(jnp.int32)
    assert contraction_axes(_walk(as_int, W, X), {0}) == {}
