"""`by_platform`, lowbit's one platform switch: the CPU lowering takes the CPU rule, other
platforms the default; closed-over arrays become operands; derivatives and vmap follow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import lowerings

from lowbit.kernels import by_platform, by_platform_p


def _on_cpu(x, w):
    return x @ w + 1.0  # distinguishable from the default


def _default(x, w):
    return x @ w


def _args():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal((3, 4)), jnp.float32), jnp.asarray(
        rng.standard_normal((4, 2)), jnp.float32
    )


def test_cpu_lowering_takes_the_cpu_rule_and_others_the_default():
    x, w = _args()
    fn = jax.jit(lambda x, w: by_platform((x, w), {"cpu": _on_cpu}, _default))
    np.testing.assert_allclose(fn(x, w), x @ w + 1.0, rtol=1e-6)
    for platform in ("cuda", "tpu"):
        hlo = jax.jit(lambda x, w: by_platform((x, w), {"cpu": _on_cpu}, _default)).trace(x, w)
        text = hlo.lower(lowering_platforms=(platform,)).as_text()
        # The CPU rule's `+ 1.0` is not in another platform's program.
        assert "add" not in text, platform


def test_an_eager_call_runs_its_platforms_rule_and_compiles_once():
    # Called outside `jit`, the equation takes the rule of the platform its arrays (or host
    # values) are on, and a second call compiles nothing: every call traces its rules anew,
    # so compiling the equation itself would compile on every call.
    x, w = _args()
    np.testing.assert_allclose(by_platform((x, w), {"cpu": _on_cpu}, _default), x @ w + 1.0)
    host = (np.asarray(x), np.asarray(w))
    np.testing.assert_allclose(by_platform(host, {"cpu": _on_cpu}, _default), x @ w + 1.0)
    np.testing.assert_allclose(by_platform((x, w), {"tpu": _on_cpu}, _default), x @ w)
    with lowerings() as lowered:
        by_platform((x, w), {"cpu": _on_cpu}, _default)
    assert lowered == []


def test_closed_over_tracers_become_operands():
    x, w = _args()
    codes = jnp.arange(8, dtype=jnp.uint8).reshape(4, 2)

    def fn(x, w, codes):
        # Both implementations close over the traced `w` and integer `codes`.
        scaled = w * codes.astype(jnp.float32)
        return by_platform((), {"cpu": lambda: _on_cpu(x, scaled)}, lambda: _default(x, scaled))

    jaxpr = jax.make_jaxpr(fn)(x, w, codes)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is by_platform_p]
    for implementation in (eqn.params["default"], *eqn.params["branches"]):
        assert not any(isinstance(c, jax.core.Tracer) for c in implementation.consts)
    want = x @ (w * codes.astype(jnp.float32)) + 1.0
    np.testing.assert_allclose(jax.jit(fn)(x, w, codes), want, rtol=1e-5)


def test_derivative_and_vmap_follow_the_default():
    x, w = _args()

    def loss(x, w):
        return jnp.sum(by_platform((x, w), {"cpu": _on_cpu}, _default) ** 2)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    # The value is the CPU rule's (out = x @ w + 1), its derivative the default's (x @ w):
    # d loss = 2 out . d(x @ w).
    out = x @ w + 1.0
    np.testing.assert_allclose(got[0], 2 * out @ w.T, rtol=1e-5)
    np.testing.assert_allclose(got[1], x.T @ (2 * out), rtol=1e-5)
    batched = jax.jit(jax.vmap(lambda x: by_platform((x, w), {"cpu": _on_cpu}, _default)))
    np.testing.assert_allclose(batched(x[:, None, :]), (x @ w + 1.0)[:, None, :], rtol=1e-5)


def test_unknown_platform_and_mismatched_results_are_refused():
    x, w = _args()
    with pytest.raises(ValueError, match="unknown platforms"):
        by_platform((x, w), {"gpu": _on_cpu}, _default)
    with pytest.raises(ValueError, match="cpu implementation returns"):
        by_platform((x, w), {"cpu": lambda x, w: (x @ w)[0]}, _default)
