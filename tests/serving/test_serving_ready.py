"""`lowbit.serving.ready`: a loaded model's quantized params laid out for the CPU kernels."""

import jax
import numpy as np
from flax import nnx

import lowbit
from lowbit import kernels, serving
from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray


def _kinds(tree):
    is_leaf = lambda x: isinstance(x, QArray | PreparedQArray)
    return {type(x).__name__ for x in jax.tree.leaves(tree, is_leaf=is_leaf) if is_leaf(x)}


def test_ready_prepares_what_a_kernel_runs_and_keeps_the_outputs(tiny_lm):
    state = nnx.to_pure_dict(nnx.state(tiny_lm.model))
    logical = lowbit.quantize_params(state, "int8")
    served = serving.ready(tiny_lm, logical)
    has_kernels = kernels.available() and jax.default_backend() == "cpu"
    assert ("PreparedQArray" in _kinds(served)) == has_kernels
    fn = lowbit.run(serving.model_fn(tiny_lm.model, tiny_lm.kind))
    tokens = np.array([[1, 2, 3, 4]], np.int32)
    np.testing.assert_allclose(
        np.asarray(fn(served, tokens)), np.asarray(fn(logical, tokens)), rtol=1e-5, atol=1e-5
    )


def test_kernel_axes_fn_finds_the_axes_ready_uses(tiny_lm):
    state = nnx.to_pure_dict(nnx.state(tiny_lm.model))
    axes = serving.kernel_axes_fn(tiny_lm)(lowbit.quantize_params(state, "int8"))
    assert axes and set(axes.values()) <= {0, 1}
