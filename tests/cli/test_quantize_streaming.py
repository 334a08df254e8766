"""`lowbit quantize FILE.gguf` streams one tensor at a time and writes the checkpoint the
in-memory path writes, byte for byte."""

import pytest
from flax import nnx

from lowbit import serving
from lowbit.cli import main
from lowbit.cli._cmd_quantize import _streams
from lowbit.io import save_checkpoint
from lowbit.models import has_smollm2, smollm2_gguf_path

pytestmark = pytest.mark.skipif(not has_smollm2(), reason="needs the SmolLM2 GGUF file")


@pytest.mark.parametrize("spec", ["int4w_g32_asym", "gguf"])
def test_gguf_file_streams_to_the_in_memory_checkpoint(spec, tmp_path, capsys):
    path = str(smollm2_gguf_path())
    assert _streams(path, spec) and not _streams(path, "int4w_g64_gptq")
    assert not _streams("smollm2", spec)
    assert main(["quantize", path, "--recipe", spec, "--out", str(tmp_path / "streamed")]) == 0
    assert "one tensor at a time" in capsys.readouterr().out
    loaded = serving.load_model(path)
    params, recipe = serving.apply_recipe(loaded, nnx.split(loaded.model)[1], spec)
    metadata = {serving.META_MODEL: loaded.spec, serving.META_RECIPE: spec, serving.META_KIND: "lm"}
    save_checkpoint(tmp_path / "in_memory", params, recipe=recipe, metadata=metadata)
    for name in ("manifest.json", "model.safetensors"):
        streamed = (tmp_path / "streamed" / name).read_bytes()
        assert streamed == (tmp_path / "in_memory" / name).read_bytes(), name
