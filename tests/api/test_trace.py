"""Following parameters through jaxprs: the ops each parameter feeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.api import param_uses

W = {"w": jnp.ones((4, 3)), "v": jnp.ones((3, 3)), "table": jnp.ones((10, 4))}
X = jnp.arange(8.0).reshape(2, 4) / 8


def plain(p, x):
    return x @ p["w"]


def remat(p, x):
    return jax.checkpoint(lambda x: jnp.tanh(x @ p["w"]))(x)


def cond(p, x):
    return jax.lax.cond(x.sum() > 0, lambda x: x @ p["w"], lambda x: -(x @ p["w"]), x)


def while_loop(p, x):
    def body(carry):
        i, h = carry
        return i + 1, jnp.tanh(h @ p["v"])

    return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, x @ p["w"]))[1]


def nested_jit_transposed(p, x):
    return jax.jit(lambda x, w: jnp.einsum("bi,oi->bo", x, w.T))(x, p["w"])


def lookup(p, x):
    ids = jnp.array([1, 2])
    return jnp.take(p["table"], ids, axis=0) + x


@pytest.mark.parametrize(
    "fn, expected",
    [
        (plain, {"w": {"dot_general"}}),
        (remat, {"w": {"dot_general"}}),
        (cond, {"w": {"dot_general"}}),
        (while_loop, {"w": {"dot_general"}, "v": {"dot_general"}}),
        (nested_jit_transposed, {"w": {"dot_general"}}),
        (lookup, {"table": {"gather"}}),
    ],
)
def test_param_uses_follow_weights_into_sub_jaxprs(fn, expected):
    assert param_uses(fn, W, X) == expected


def test_param_uses_follow_shard_map_bodies():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    specs = {"in_specs": (P(None, "model"), P()), "out_specs": P(None, "model")}

    def fn(p, x):
        return jax.shard_map(lambda w, x: x @ w, mesh=mesh, **specs)(p["w"], x)

    uses = param_uses(fn, {"w": jnp.ones((16, 8))}, jnp.ones((2, 16)))
    assert uses == {"w": frozenset({"dot_general"})}
