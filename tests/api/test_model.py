"""quantize_model with example inputs: one trace serves the uses, layouts and kernel axes."""

import jax
import jax.numpy as jnp
import numpy as np
from api_models import LinenMLP, init, linear
from flax import linen, nnx

from lowbit.api import param_uses, quantize_model
from lowbit.engine import probe
from lowbit.ops import PreparedQArray, is_prepared
from lowbit.qarray import QArray
from lowbit.recipes import path_string

_CALLS: list[str] = []


class _Counted(nnx.Module):
    """Two linear layers, the second applied in a scan; counts how often it is called (traced)."""

    def __init__(self, *, rngs):
        self.up = linear(64, 128, rngs=rngs)
        self.loop = nnx.Param(init(rngs.params(), (128, 128)))

    def __call__(self, x):
        _CALLS.append("nnx")
        h = self.up(x)
        w = self.loop[...]
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), h, None, length=2)[0]


def test_nnx_quantize_model_with_example_args_traces_once():
    model = _Counted(rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 64))
    _CALLS.clear()
    qmodel = quantize_model(model, "int8", example_args=(x,))
    assert _CALLS == ["nnx"]
    assert qmodel.prepared
    # The weight used only inside the scan body is laid out for the kernels too.
    state = nnx.to_pure_dict(qmodel.state)
    assert isinstance(state["loop"], QArray | PreparedQArray)
    np.testing.assert_allclose(qmodel(x), model(x), rtol=0.1, atol=0.05)


class _CountedLinen(LinenMLP):
    def __call__(self, x, negate: bool = False):
        _CALLS.append("linen")
        return super().__call__(x, negate)


def test_linen_quantize_model_with_example_args_traces_once():
    module = _CountedLinen()
    x = jnp.ones((2, 16))
    params = module.init(jax.random.key(0), x)
    _CALLS.clear()
    qmodel = quantize_model(module, "int8", params=params, example_args=(x,))
    assert _CALLS == ["linen"]
    assert isinstance(module, linen.Module)
    dense = qmodel.params["params"]["Dense_0"]["kernel"]
    assert isinstance(dense, QArray) or is_prepared(dense)


def test_param_uses_match_the_probe_on_an_nnx_mlp(block):
    graphdef, state = nnx.split(block)
    x = jnp.ones((2, 8, 64))
    call = lambda s, x: nnx.merge(graphdef, s)(x)
    seen: dict[str, set[str]] = {}

    def visit(use):
        if use.op != "other":
            for path in use.paths:
                seen.setdefault(path, set()).add(use.op)

    probe(call, state, (x,), {}, visit, name=path_string)
    assert param_uses(call, state, x) == {p: frozenset(o) for p, o in seen.items()}
