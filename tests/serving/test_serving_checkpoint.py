"""Checkpoints with the CLI's metadata, read back ready to run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit
from lowbit import serving
from lowbit.io import save_checkpoint
from lowbit.ops import logical_weights
from lowbit.qarray import QArray


def _dequantized(tree):
    is_q = lambda x: isinstance(x, QArray)
    return [np.asarray(x.dequantize()) for x in jax.tree.leaves(tree, is_leaf=is_q) if is_q(x)]


def test_read_checkpoint_round_trips_and_names_its_model(tiny_lm, tmp_path):
    params, _ = serving.apply_recipe(tiny_lm, nnx.state(tiny_lm.model), "int8")
    meta = {serving.META_MODEL: "tiny", serving.META_RECIPE: "int8", serving.META_KIND: "lm"}
    save_checkpoint(tmp_path / "ck", params, metadata=meta)
    assert serving.is_checkpoint(tmp_path / "ck") and not serving.is_checkpoint(tmp_path)
    assert serving.checkpoint_metadata(tmp_path / "ck")[serving.META_MODEL] == "tiny"
    assert serving.checkpoint_recipe_label(tmp_path / "ck") == "int8"
    back = serving.read_checkpoint(tmp_path / "ck", tiny_lm)
    want, got = _dequantized(logical_weights(params)), _dequantized(logical_weights(back))
    assert want and len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_without_model_metadata_is_refused(tmp_path):
    save_checkpoint(tmp_path / "ck", lowbit.quantize_params({"kernel": jnp.ones((8, 8))}, "int8"))
    with pytest.raises(ValueError, match="its float model is unknown"):
        serving.checkpoint_metadata(tmp_path / "ck")
