"""`lowbit.serving.apply_recipe`: a recipe applied to a loaded model, ready to run."""

import jax
import pytest
from flax import nnx

from lowbit import kernels, serving
from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray


def _leaves(tree):
    is_leaf = lambda x: isinstance(x, QArray | PreparedQArray)
    return [x for x in jax.tree.leaves(tree, is_leaf=is_leaf) if is_leaf(x)]


def test_float_recipe_returns_the_float_params(tiny_lm):
    params, recipe = serving.apply_recipe(tiny_lm, nnx.state(tiny_lm.model), "float")
    assert not _leaves(params) and recipe is not None


def test_preset_quantizes_and_prepares(tiny_lm):
    params, recipe = serving.apply_recipe(tiny_lm, nnx.state(tiny_lm.model), "int8")
    leaves = _leaves(params)
    assert leaves and recipe.rules
    has_kernels = kernels.available() and jax.default_backend() == "cpu"
    assert any(isinstance(x, PreparedQArray) for x in leaves) == has_kernels


def test_gguf_recipe_needs_a_gguf_model(tiny_lm):
    with pytest.raises(ValueError, match="was not read from a GGUF file"):
        serving.apply_recipe(tiny_lm, nnx.state(tiny_lm.model), serving.GGUF_RECIPE)


def test_data_driven_recipe_without_calibration_says_what_to_pass(tiny_lm):
    with pytest.raises(ValueError, match="needs calibration data; pass calibrate="):
        serving.apply_recipe(tiny_lm, nnx.state(tiny_lm.model), "int4w_g64_gptq")


def test_calibrate_is_called_with_the_algorithms_weights(tiny_lm):
    seen = []

    def calibrate(loaded, params, paths, rows):
        seen.append((loaded, paths))
        raise RuntimeError("stop")  # what it returns is the algorithms' business

    with pytest.raises(RuntimeError, match="stop"):
        serving.apply_recipe(
            tiny_lm, nnx.state(tiny_lm.model), "int4w_g64_gptq", calibrate=calibrate
        )
    ((loaded, paths),) = seen
    assert loaded is tiny_lm and paths and all(isinstance(p, str) for p in paths)
