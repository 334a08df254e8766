"""`lowbit.serving.apply_recipe`: a recipe applied to a loaded model, ready to run."""

import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from lowbit import kernels, serving
from lowbit.io import export_gguf
from lowbit.ops import PreparedQArray, _cpu_kernels
from lowbit.qarray import QArray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_gguf import write_tiny_gguf  # noqa: E402


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


@pytest.mark.skipif(not kernels.available(), reason=kernels.status())
def test_gguf_recipe_multiplies_every_tensor_on_int8_activations(tmp_path, monkeypatch):
    """Q4_0 / Q8_0 tensors (imported as int4 / int8 in groups of 32) multiply on int8
    activations in Q8_0 blocks, as llama.cpp multiplies them, like the block types do."""
    monkeypatch.setattr(_cpu_kernels, "MIN_WEIGHT_ELEMENTS", 0)  # the tiny model's layers
    source = write_tiny_gguf("llama", tmp_path / "tiny.gguf")
    loaded = serving.load_model(str(source))
    path = tmp_path / "q4_0.gguf"
    pure = nnx.to_pure_dict(nnx.split(loaded.model)[1])
    export_gguf(pure, path, config=loaded.model.config, type="Q4_0", source=source, log=None)
    loaded = serving.load_model(str(path))
    params, _ = serving.apply_recipe(loaded, nnx.split(loaded.model)[1], serving.GGUF_RECIPE)
    prepared = [x for x in _leaves(params) if isinstance(x, PreparedQArray)]
    assert "int4" in {x.route.kind for x in prepared}
    assert all(x.route.int8_activations for x in prepared)


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
