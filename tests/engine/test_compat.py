"""The JAX internals the engine relies on exist in the installed JAX."""

import jax
import jax.numpy as jnp
from engine_helpers import all_eqns

from lowbit.engine import _compat


def test_required_primitives_exist():
    found = _compat.available_primitives()
    missing = [name for name in _compat.REQUIRED_PRIMITIVES if name not in found]
    assert missing == []


def test_rule_names_cover_primitives_seen_in_a_trace():
    def fn(w, x, ids):
        y = jax.jit(lambda a: a @ w)(x)
        y = jax.checkpoint(jnp.sin)(y) + jnp.take(w, ids, axis=0).sum()
        y = jax.lax.scan(lambda c, _: (c @ w.T @ w, None), y, None, length=2)[0]
        y = jax.lax.cond(y.sum() > 0, lambda a: a, lambda a: -a, y)
        return jax.lax.while_loop(lambda a: a.sum() > 1e9, lambda a: a / 2, y)

    jaxpr = jax.make_jaxpr(fn)(jnp.ones((4, 8)), jnp.ones((2, 4)), jnp.array([1], jnp.int32))
    rules = {_compat.rule_name(e.primitive.name) for e in all_eqns(jaxpr)}
    assert {"jit", "remat", "gather", "scan", "cond", "while", "dot_general"} <= rules
    scan = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")
    params = _compat.scan_params(scan)
    assert (params["num_consts"], params["num_carry"], params["length"]) == (1, 1, 2)
    cond = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond")
    assert len(_compat.cond_branches(cond)) == 2
    loop = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "while")
    assert _compat.while_params(loop)["body_nconsts"] == 0


def test_bind_eqn_reproduces_eval_jaxpr():
    fn = lambda x: jax.nn.relu(jax.jit(jnp.cumsum)(x)) * 2
    closed = jax.make_jaxpr(fn)(jnp.arange(4.0))
    jaxpr, consts = _compat.parts(closed)
    env = dict(zip(jaxpr.invars, [jnp.arange(4.0) - 2], strict=True))
    for eqn in jaxpr.eqns:
        args = [_compat.literal_value(a) if _compat.is_literal(a) else env[a] for a in eqn.invars]
        env.update(zip(eqn.outvars, _compat.bind_eqn(eqn, args), strict=True))
    assert jnp.array_equal(env[jaxpr.outvars[0]], fn(jnp.arange(4.0) - 2))
