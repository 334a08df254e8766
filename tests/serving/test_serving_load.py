"""`lowbit.serving.load_model`: names, GGUF files, Hugging Face directories; clear errors."""

from pathlib import Path

import numpy as np
import pytest

from lowbit import serving


def test_unknown_name_lists_the_accepted_models():
    with pytest.raises(ValueError, match="smollm2, minilm"):
        serving.load_model("no-such-model")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        serving.load_model(str(tmp_path / "m.gguf"))


def test_a_bert_checkpoint_needs_its_config_and_tokenizer(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"missing \['config.json', 'tokenizer.json'\]"):
        serving.load_model(str(tmp_path / "model.safetensors"))


def test_hf_directory_is_recognised_by_its_three_files(tmp_path):
    assert not serving.is_hf_directory(tmp_path)
    for name in serving.HF_FILES:
        (tmp_path / name).write_text("{}")
    assert serving.is_hf_directory(tmp_path)
    assert not serving.is_hf_directory(tmp_path / "config.json")


def test_model_fn_calls_the_model_on_its_params(tiny_lm):
    from flax import nnx

    fn = serving.model_fn(tiny_lm.model, tiny_lm.kind)
    tokens = np.array([[1, 2, 3]], np.int32)
    np.testing.assert_array_equal(
        np.asarray(fn(nnx.state(tiny_lm.model), tokens)), np.asarray(tiny_lm.model(tokens))
    )


def test_as_numpy_tokens(tiny_lm):
    ids = serving.as_numpy_tokens(tiny_lm.tokenizer, "w0 w1 w5")
    assert ids.dtype == np.int32 and ids.tolist() == [1, 2, 6]


HF_REFERENCES = Path(__file__).parents[1] / "models" / "references" / "hf"


def test_a_sharded_hf_decoder_directory_loads_as_a_language_model():
    directory = HF_REFERENCES / "llama"
    assert serving.is_hf_directory(directory)
    loaded = serving.load_model(str(directory))
    assert (loaded.kind, loaded.name, loaded.spec) == ("lm", "llama", str(directory.resolve()))
    assert loaded.model.config.architecture == "llama" and loaded.gguf_path is None
    logits = loaded.model(np.array([[1, 2, 3]], np.int32))
    assert logits.shape == (1, 3, 256)


def test_an_hf_decoder_safetensors_path_loads_its_directory():
    loaded = serving.load_model(str(HF_REFERENCES / "gemma2" / "model.safetensors"))
    assert loaded.kind == "lm" and loaded.model.config.architecture == "gemma2"
