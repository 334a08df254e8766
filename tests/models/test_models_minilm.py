"""all-MiniLM-L6-v2 as a float NNX `Bert`: structure, embeddings against NumPy, semantics."""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from minilm_numpy_ref import minilm_embedding
from safetensors.numpy import load_file, save_file

from lowbit import models
from lowbit.models._bert import ACTIVATIONS, MLP

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Quantization maps real numbers onto a small grid of integers, per block of 32 weights.",
    "Hi",
]


@pytest.fixture(scope="module")
def embeddings(minilm):
    model, tok = minilm
    return models.embed_sentences(model, tok, SENTENCES)


def test_parameter_paths_and_mapping(minilm):
    model, _ = minilm
    assert model.config == models.BertConfig()
    params = {
        models.path_str(tuple(p)): v.shape
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    assert params["layers/2/attn/query/kernel"] == (384, 384)
    assert params["layers/5/mlp/up/kernel"] == (384, 1536)
    assert params["embeddings/word/embedding"] == (30522, 384)
    mapping = models.hf_bert_param_map(model.config)
    assert {models.path_str(m.path) for m in mapping.values()} == set(params)
    assert mapping["encoder.layer.4.output.dense.weight"].path == (
        "layers",
        4,
        "mlp",
        "down",
        "kernel",
    )


def test_tokenizer_does_not_pad_to_128(minilm):
    _, tok = minilm
    enc = tok.encode("A man is eating food.")
    assert enc.tokens == ["[CLS]", "a", "man", "is", "eating", "food", ".", "[SEP]"]
    assert len(tok.encode("word " * 400).ids) == 256


def test_matches_numpy_reference(minilm, embeddings):
    weights = load_file(str(models.minilm_dir() / "model.safetensors"))
    _, tok = minilm
    assert embeddings.shape == (len(SENTENCES), 384) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    for sentence, ours in zip(SENTENCES, embeddings, strict=True):
        ref = minilm_embedding(weights, tok.encode(sentence).ids)
        cosine = float(ours @ ref / np.linalg.norm(ours))
        print(f"cosine {cosine:.8f}  {sentence!r}")
        assert cosine >= 0.99999


def test_similar_sentences_are_closer(embeddings):
    sim = embeddings @ embeddings.T
    print(f"food/bread {sim[0, 1]:.4f}, food/baby {sim[0, 2]:.4f}, bread/baby {sim[1, 2]:.4f}")
    assert sim[0, 1] > 0.6
    assert sim[0, 1] > sim[0, 2] + 0.5 and sim[0, 1] > sim[1, 2] + 0.5


def test_batching_does_not_change_embeddings(minilm, embeddings):
    model, tok = minilm
    # Two batches of the first call's shape: no new compilation, and the same numbers.
    chunked = models.embed_sentences(model, tok, SENTENCES[::-1] + SENTENCES, batch_size=5)
    np.testing.assert_allclose(chunked, np.concatenate([embeddings[::-1], embeddings]), atol=1e-5)
    assert models.embed_sentences(model, tok, []).shape == (0, 384)
    with pytest.raises(TypeError, match="sentences"):
        models.embed_sentences(model, tok, "one string")


def test_loader_rejects_unexpected_or_missing_tensor(minilm, tmp_path):
    src = models.minilm_dir()
    for name in ["config.json", "tokenizer.json"]:
        shutil.copy(src / name, tmp_path / name)
    weights = load_file(str(src / "model.safetensors"))
    weights["encoder.layer.0.attention.self.rotary.weight"] = np.zeros(3, np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="rotary"):
        models.load_hf_bert(tmp_path)
    del weights["encoder.layer.0.attention.self.rotary.weight"]
    del weights["encoder.layer.5.output.dense.bias"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="encoder.layer.5.output.dense.bias"):
        models.load_hf_bert(tmp_path)


def test_abstract_matches_eval_shape():
    config = models.BertConfig(n_layers=2, vocab_size=100, dim=24, n_heads=4, ffn_dim=48)
    a = models.Bert.abstract(config)
    b = nnx.eval_shape(lambda: models.Bert(config, rngs=nnx.Rngs(0)))
    assert nnx.graphdef(a) == nnx.graphdef(b)
    shapes = lambda m: [(p, v.shape, v.dtype) for p, v in nnx.to_flat_state(nnx.state(m))]
    assert shapes(a) == shapes(b)


_HF_SHAPES = {
    "vocab_size": 100,
    "hidden_size": 24,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "max_position_embeddings": 32,
}


def test_config_reads_the_activation():
    read = lambda act: models.bert_config_from_hf({**_HF_SHAPES, "hidden_act": act})
    assert read("gelu_new").activation == "gelu_new"
    assert models.bert_config_from_hf(_HF_SHAPES).activation == "gelu"
    with pytest.raises(ValueError, match="activation is 'swish'.*'relu'"):
        read("swish")
    # The activation is the one the MLP applies: relu and exact gelu differ on the same weights.
    x = jnp.linspace(-3.0, 3.0, 2 * 3 * 24).reshape(2, 3, 24)
    outputs = []
    for act in ("gelu", "relu"):
        mlp = MLP(
            models.BertConfig(dim=24, n_heads=4, ffn_dim=48, activation=act),
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            rngs=nnx.Rngs(0),
        )
        expected = mlp.down(ACTIVATIONS[act](mlp.up(x)))
        outputs.append(mlp(x))
        np.testing.assert_allclose(outputs[-1], expected, rtol=1e-6)
    assert not np.allclose(outputs[0], outputs[1])


def test_config_rejects_other_models():
    with pytest.raises(ValueError, match="n_heads=5"):
        models.BertConfig(n_heads=5)
