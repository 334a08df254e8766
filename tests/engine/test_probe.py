"""The probe on routed experts: ragged_dot uses carry their group sizes, and a scaled activation
keeps its tag through channel-preserving reshapes and row gathers only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.engine import probe
from lowbit.recipes import path_string

D, F, E = 8, 6, 3


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "norm": jnp.linspace(0.5, 2.0, D),
        "router": jax.random.normal(k[0], (D, E)),
        "up": jax.random.normal(k[1], (E, D, F)),
        "down": jax.random.normal(k[2], (E, F, D)),
    }


def _moe(p, x, token, sizes, mix=False):
    flat = (x * p["norm"]).reshape(-1, D)  # [batch, seq, D] -> [tokens, D]
    logits = flat @ p["router"]
    rows = flat[token]
    if mix:
        rows = rows[:, ::-1]  # moves channels: nothing may fold into the norm
    h = jax.lax.ragged_dot(rows, p["up"], sizes)
    return jax.lax.ragged_dot(h, p["down"], sizes), logits


def _uses(mix=False, jit=False):
    x = jax.random.normal(jax.random.key(1), (2, 3, D))
    token = jnp.array([0, 2, 5, 1, 3, 4, 4, 0])
    sizes = jnp.array([3, 0, 5], jnp.int32)
    seen = []

    def run(p, x, token, sizes):
        probe(
            lambda p, *a: _moe(p, *a, mix=mix),
            p,
            (x, token, sizes),
            {},
            seen.append,
            name=path_string,
        )
        return 0

    (jax.jit(run) if jit else run)(_params(), x, token, sizes)
    return seen


@pytest.mark.parametrize("jit", [False, True])
def test_ragged_dot_uses_carry_group_sizes_and_the_norm_scale_through_the_gather(jit):
    uses = {next(iter(u.paths)): u for u in _uses(jit=jit) if u.op != "other"}
    up, down, router = uses["up"], uses["down"], uses["router"]
    assert up.op == "ragged_dot" and down.op == "ragged_dot"
    if not jit:
        np.testing.assert_array_equal(up.group_sizes, [3, 0, 5])
    assert up.group_sizes is not None and router.group_sizes is None
    assert up.activation_scale == frozenset({("norm", 0)})
    assert router.activation_scale == frozenset({("norm", 0)})
    # The ragged_dot's output channels are the up kernel's axis 2, for every expert.
    assert down.activation_scale == frozenset({("up", 2)})
    others = {p for u in _uses(jit=jit) if u.op == "other" for p in u.paths}
    assert "norm" not in others


def test_a_gather_that_moves_channels_drops_the_scale_and_reports_the_norm():
    uses = _uses(mix=True)
    up = next(u for u in uses if u.paths == frozenset({"up"}))
    assert up.activation_scale is None
    assert any(u.op == "other" and "norm" in u.paths for u in uses)


def _looped(p, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    h = jax.lax.scan(layer, x, p["stack"], reverse=True)[0]

    def body(carry):
        i, h = carry
        return i + 1, jnp.tanh(h @ p["v"])

    h = jax.lax.while_loop(lambda c: c[0] < 2, body, (0, h @ p["w"]))[1]
    return jax.lax.cond(h.sum() > 0, lambda h: h @ p["w"], lambda h: -(h @ p["v"]), h)


def test_loops_step_with_each_steps_activation_and_layer_index():
    k = jax.random.split(jax.random.key(2), 3)
    p = {
        "stack": jax.random.normal(k[0], (2, 4, 4)) / 2,
        "w": jax.random.normal(k[1], (4, 4)) / 2,
        "v": jax.random.normal(k[2], (4, 4)) / 2,
    }
    x = jnp.arange(8.0).reshape(2, 4) / 8
    seen = []
    probe(_looped, p, (x,), {}, seen.append, name=path_string)
    uses = [u for u in seen if u.op != "other"]
    # The reversed scan visits layer 1 then layer 0; the while loop runs twice; one branch.
    h2 = jnp.tanh(
        jnp.tanh((jnp.tanh(jnp.tanh(x @ p["stack"][1]) @ p["stack"][0]) @ p["w"]) @ p["v"]) @ p["v"]
    )
    taken = "w" if h2.sum() > 0 else "v"
    assert [sorted(u.paths) for u in uses] == [["stack"], ["stack"], ["w"], ["v"], ["v"], [taken]]
    layer = lambda u: int(np.asarray(u.weight_indices((2, 4, 4))).ravel()[0]) // 16
    assert [layer(u) for u in uses[:2]] == [1, 0]
    h1 = jnp.tanh(x @ p["stack"][1])
    np.testing.assert_array_equal(uses[0].activation, x)
    np.testing.assert_allclose(uses[1].activation, h1, rtol=1e-6)
    h = jnp.tanh(h1 @ p["stack"][0]) @ p["w"]
    np.testing.assert_allclose(uses[3].activation, h, rtol=1e-6)
    np.testing.assert_allclose(uses[4].activation, jnp.tanh(h @ p["v"]), rtol=1e-6)


def test_a_traced_trip_count_runs_the_loop_as_it_is_unobserved():
    p = {"w": jnp.eye(4) / 2}
    x = jnp.ones((1, 4))

    def fn(p, x, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ p["w"]), (0, x))

    seen = []
    run = jax.jit(lambda p, x, n: probe(fn, p, (x, n), {}, seen.append, name=path_string)[1])
    np.testing.assert_allclose(run(p, x, 3), x / 8)
    assert [u for u in seen if u.op != "other"] == []


def test_the_probe_steps_through_the_interpreters_own_sub_jaxpr_rules():
    from lowbit.engine import _interpreter
    from lowbit.engine._walker import SUB_JAXPR_KINDS

    for name, kind in SUB_JAXPR_KINDS.items():
        if kind == "shard_map":  # a probe meeting one is an "other" use
            assert name not in _interpreter._PROBE_SUB_JAXPRS
        else:
            assert _interpreter._PROBE_SUB_JAXPRS[name] is _interpreter._RULES[name]
