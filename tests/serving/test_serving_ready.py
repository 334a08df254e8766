"""`lowbit.serving.ready`: a loaded model's quantized params laid out for the CPU kernels."""

import jax
import numpy as np
import pytest
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


def test_kernel_axes_are_kept_beside_the_programs_and_read_back_without_a_trace(
    tiny_lm, tmp_path, monkeypatch
):
    from lowbit.serving import _ready

    state = nnx.to_pure_dict(nnx.state(tiny_lm.model))
    int8 = lowbit.quantize_params(state, "int8")
    traced = serving.kernel_axes_fn(tiny_lm)(int8)
    assert serving.kernel_axes_fn(tiny_lm, str(tmp_path))(int8) == traced
    (kept,) = tmp_path.glob("kernel-axes-*.json")

    def no_trace(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(_ready, "kernel_axes_of", no_trace)
    assert serving.kernel_axes_fn(tiny_lm, str(tmp_path))(int8) == traced
    served = serving.ready(tiny_lm, int8, str(tmp_path))
    assert _kinds(served) == _kinds(serving.ready(tiny_lm, int8, str(tmp_path)))
    # Other layouts are another file, traced; a damaged file is traced again and rewritten.
    with pytest.raises(AssertionError, match="traced again"):
        serving.kernel_axes_fn(tiny_lm, str(tmp_path))(lowbit.quantize_params(state, "int4"))
    for damaged in ("{not json", "[[0, 7]]", "[[99999, 0]]", '{"a": 1}'):
        kept.write_text(damaged)
        with pytest.raises(AssertionError, match="traced again"):
            serving.kernel_axes_fn(tiny_lm, str(tmp_path))(int8)
    monkeypatch.undo()
    assert serving.kernel_axes_fn(tiny_lm, str(tmp_path))(int8) == traced
    assert serving.kernel_axes_fn(tiny_lm)(int8) == traced
