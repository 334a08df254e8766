"""`lowbit.prepare`: the one transform that lays quantized weights out for the CPU kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit
from lowbit import kernels
from lowbit.api import quantize_model, quantize_params, run
from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray

HAS_KERNELS = kernels.available() and jax.default_backend() == "cpu"


class _Mlp(nnx.Module):
    def __init__(self, *, rngs):
        self.up = nnx.Linear(256, 512, rngs=rngs)
        self.down = nnx.Linear(512, 256, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def _kinds(tree):
    is_leaf = lambda x: isinstance(x, QArray | PreparedQArray)
    return [type(x) for x in jax.tree.leaves(tree, is_leaf=is_leaf) if is_leaf(x)]


X = jnp.linspace(-1, 1, 2 * 256).reshape(2, 256)


def test_params_form_lays_out_and_keeps_the_outputs():
    model = _Mlp(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    logical = quantize_params(nnx.to_pure_dict(state), "int8")
    assert set(_kinds(logical)) == {QArray}
    fn = lambda p, x: nnx.merge(graphdef, p)(x)
    served = lowbit.prepare(logical, fn, X)
    assert (PreparedQArray in _kinds(served)) == HAS_KERNELS
    np.testing.assert_allclose(run(fn)(served, X), run(fn)(logical, X), rtol=1e-5, atol=1e-5)


def test_module_form_updates_an_nnx_module_in_place():
    graphdef, state = nnx.split(_Mlp(rngs=nnx.Rngs(0)))
    module = nnx.merge(graphdef, quantize_params(state, "int8"))
    assert lowbit.prepare(module, X) is module
    assert (PreparedQArray in _kinds(nnx.state(module))) == HAS_KERNELS


def test_quantized_model_records_that_it_is_prepared():
    qmodel = quantize_model(_Mlp(rngs=nnx.Rngs(0)), "int8")
    assert not qmodel.prepared
    assert lowbit.prepare(qmodel, X) is qmodel
    assert qmodel.prepared
    assert (PreparedQArray in _kinds(qmodel.state)) == HAS_KERNELS
    np.testing.assert_allclose(qmodel(X), qmodel.dequantized()(X), rtol=2e-2, atol=2e-2)


def test_params_without_their_function_are_refused():
    with pytest.raises(TypeError, match=r"lowbit.prepare\(qparams, fn, \*example_args\)"):
        lowbit.prepare({"kernel": jnp.ones((4, 4))}, X)
