"""`lowbit quantize FILE.gguf` streams one tensor at a time and writes the checkpoint the
in-memory path writes, byte for byte."""

import sys
from pathlib import Path

import pytest
from flax import nnx

from lowbit import serving
from lowbit.cli import main
from lowbit.cli._cmd_quantize import _streams
from lowbit.io import save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_gguf import write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory) -> str:
    """A tiny llama GGUF file with SmolLM2's block types (Q4_1 linear layers, a Q8_0
    embedding), written by lowbit's own export: the streaming paths' byte-for-byte checks on
    quantized blocks, at a thousandth of SmolLM2's size."""
    root = tmp_path_factory.mktemp("gguf")
    source = write_tiny_gguf("llama", root / "tiny.gguf")
    path = root / "q4_1.gguf"
    assert main(["export", str(source), "--recipe", "int4w_g32_asym", "--gguf", str(path)]) == 0
    return str(path)


@pytest.mark.parametrize("spec", ["int4w_g32_asym", "gguf"])
def test_gguf_file_streams_to_the_in_memory_checkpoint(spec, quantized_gguf, tmp_path, capsys):
    path = quantized_gguf
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


def test_export_streams_from_a_checkpoint_and_a_gguf_file(quantized_gguf, tmp_path, capsys):
    from lowbit.gguf import read_gguf
    from lowbit.io import export_gguf, import_gguf, load_checkpoint
    from lowbit.models import decoder_config_from_gguf, gguf_param_map

    path = quantized_gguf
    config = decoder_config_from_gguf(read_gguf(path))
    ck, out = str(tmp_path / "ck"), tmp_path / "out"
    out.mkdir()
    assert main(["quantize", path, "--recipe", "gguf", "--out", ck]) == 0
    assert main(["export", ck, "--gguf", str(out / "a.gguf")]) == 0
    export_gguf(load_checkpoint(ck), out / "b.gguf", config=config, source=path, log=None)
    assert (out / "a.gguf").read_bytes() == (out / "b.gguf").read_bytes()
    assert main(["export", path, "--recipe", "gguf", "--gguf", str(out / "c.gguf")]) == 0
    params, _ = import_gguf(path, name_map=gguf_param_map(config).get)
    export_gguf(params, out / "d.gguf", config=config, source=path, log=None)
    assert (out / "c.gguf").read_bytes() == (out / "d.gguf").read_bytes()


@pytest.mark.parametrize(
    "model_type, streams", [("llama", True), ("qwen2", True), ("gemma", False)]
)
def test_hugging_face_directory_streams_to_the_in_memory_checkpoint(
    model_type, streams, tmp_path, capsys
):
    # A sharded (llama) or single-file directory streams with a path-only recipe and writes
    # the in-memory path's checkpoint; Gemma's `1 + w` norms go through memory.
    path = Path(__file__).resolve().parents[1] / "models" / "references" / "hf" / model_type
    assert _streams(str(path), "int8w") is streams
    assert not _streams(str(path), "int4w_g64_gptq") and not _streams(str(path), "gguf")
    if not streams:
        return
    assert main(["quantize", str(path), "--recipe", "int8w", "--out", str(tmp_path / "s")]) == 0
    assert "one tensor at a time" in capsys.readouterr().out
    loaded = serving.load_model(str(path))
    params, recipe = serving.apply_recipe(loaded, nnx.split(loaded.model)[1], "int8w")
    metadata = {
        serving.META_MODEL: loaded.spec,
        serving.META_RECIPE: "int8w",
        serving.META_KIND: "lm",
    }
    save_checkpoint(tmp_path / "m", params, recipe=recipe, metadata=metadata)
    for name in ("manifest.json", "model.safetensors"):
        assert (tmp_path / "s" / name).read_bytes() == (tmp_path / "m" / name).read_bytes()


def test_by_layer_runs_gptq_from_a_gguf_file_one_layer_at_a_time(tmp_path, capsys):
    from lowbit.io import load_checkpoint

    path = str(write_tiny_gguf("llama", tmp_path / "tiny.gguf"))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, again and again. " * 300)
    args = ["quantize", path, "--calibration", str(text), "--calibration-sequences", "2"]
    out = str(tmp_path / "ck")
    recipe = "int4w_g32_asym_gptq"
    assert main([*args, "--recipe", recipe, "--by-layer", "--out", out]) == 0
    assert "one layer at a time" in capsys.readouterr().out
    q = load_checkpoint(out)
    assert q["layers"][1]["mlp"]["down_proj"]["kernel"].format == "uint4"
    assert main([*args, "--recipe", "gguf", "--by-layer", "--out", str(tmp_path / "x")]) != 0
    assert "--by-layer needs a recipe" in capsys.readouterr().err
    assert main(["quantize", str(text), "--recipe", recipe, "--by-layer", "--out", out]) != 0
    assert "must be a .gguf file or a Hugging Face decoder" in capsys.readouterr().err
