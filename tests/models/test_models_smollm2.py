"""SmolLM2 as a float NNX `Decoder`: structure, logits against NumPy, KV cache, generation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from smollm2_numpy_ref import smollm2_logits

from lowbit import models

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def sequence(smollm2):
    """Token ids of a chat prompt followed by an answer, and the prompt's length."""
    _, tok = smollm2
    prompt = tok.encode(models.chat_prompt(QUESTION)).ids
    return prompt + tok.encode(ANSWER).ids, len(prompt)


@pytest.fixture(scope="module")
def full_logits(smollm2, sequence):
    """Module logits [seq, vocab] for the whole sequence, no cache."""
    model, _ = smollm2
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    return np.asarray(fwd(state, jnp.asarray([sequence[0]], jnp.int32))[0])


def test_config_from_metadata(smollm2):
    model, _ = smollm2
    assert model.config == models.DecoderConfig(
        vocab_size=49152,
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        ffn_dim=1536,
        rope_base=100000.0,
        norm_eps=float(np.float32(1e-5)),
        tie_embeddings=True,
    )


def test_parameter_paths_and_mapping(smollm2):
    model, _ = smollm2
    params = {
        models.path_str(tuple(p)): v.shape
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    assert params["layers/3/attn/q_proj/kernel"] == (576, 576)
    assert params["layers/3/attn/k_proj/kernel"] == (576, 192)
    assert params["layers/29/mlp/down_proj/kernel"] == (1536, 576)
    assert params["embed/embedding"] == (49152, 576)
    assert params["norm/scale"] == (576,)
    assert "lm_head/kernel" not in params  # tied: logits come from the embedding
    mapping = models.gguf_param_map(model.config)
    assert len(params) == len(mapping) == 2 + 30 * 9
    assert {models.path_str(m.path) for m in mapping.values()} == set(params)
    q = mapping["blk.7.attn_q.weight"]
    assert (q.path, q.transpose, q.unpermute_heads) == (
        ("layers", 7, "attn", "q_proj", "kernel"),
        True,
        9,
    )
    assert mapping["blk.7.attn_k.weight"].unpermute_heads == 3
    assert mapping["blk.7.attn_v.weight"].unpermute_heads is None


def test_unpermute_inverts_llama_cpp_permutation():
    # The converter's permutation, restated: per head, rows [first half | second half] are
    # interleaved so that rows i and i + head_dim/2 end up adjacent.
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)

    w = np.arange(6 * 8 * 5).reshape(6 * 8, 5)
    permuted = permute(w, 6).reshape(w.shape)
    np.testing.assert_array_equal(models.unpermute_rope_rows(permuted, 6), w)
    raw_rows = np.arange(48 * 20, dtype=np.uint8).reshape(48, 20)  # block bytes move with rows
    np.testing.assert_array_equal(
        models.unpermute_rope_rows(permute(raw_rows, 3).reshape(48, 20), 3), raw_rows
    )
    with pytest.raises(ValueError, match="n_heads"):
        models.unpermute_rope_rows(w[:45], 6)


def test_logits_match_numpy_reference(smollm2_file, sequence, full_logits):
    # The same dequantized GGUF tensors the loader uses (the decoders are checked against the
    # gguf package in tests/gguf/test_gguf_reader.py), by GGUF name and in GGUF layout.
    weights = {name: t.dequantize() for name, t in smollm2_file.tensors.items()}
    ref = smollm2_logits(weights, smollm2_file.metadata, sequence[0])
    scale = np.abs(ref).max()
    rel = np.abs(full_logits - ref).max() / scale
    print(f"max |logit diff| = {np.abs(full_logits - ref).max():.3g} (logit scale {scale:.3g})")
    assert rel < 1e-4
    assert np.array_equal(full_logits.argmax(-1), ref.argmax(-1))


def test_kv_cache_matches_full_forward(smollm2, sequence, full_logits):
    """Prefill the left-padded prompt, then feed the answer one token at a time through the
    cache: the logits match the full forward pass."""
    model, _ = smollm2
    ids, n = sequence
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, tokens, cache: nnx.merge(graphdef, state)(tokens, cache=cache))
    pad = 64 - n
    padded = np.zeros((1, 64), np.int32)
    padded[0, pad:] = ids[:n]
    cache = dataclasses.replace(model.init_cache(1, 128), start=jnp.asarray([pad], jnp.int32))
    logits, cache = step(state, jnp.asarray(padded), cache)
    scale = np.abs(full_logits).max()
    np.testing.assert_allclose(np.asarray(logits[0, -1]), full_logits[n - 1], atol=1e-4 * scale)
    assert int(cache.length) == 64
    for pos in range(n, len(ids)):
        token = jnp.asarray([[ids[pos]]], jnp.int32)
        logits, cache = step(state, token, cache)
        np.testing.assert_allclose(np.asarray(logits[0, 0]), full_logits[pos], atol=1e-4 * scale)
    assert int(cache.length) == 64 + len(ids) - n


def test_greedy_generation_of_quantized_models_matches_float(smollm2):
    """The README prompt: int4w_g32_asym weights give the float model's tokens (the README's
    own example, run by tests/test_readme.py, checks int8w weights with an int8 cache)."""
    from lowbit.api import quantize_params

    model, tok = smollm2
    prompt = models.chat_prompt(QUESTION)
    text = models.generate_greedy(model, tok, prompt, 12)
    print(f"generated: {text!r}")
    assert "Paris" in text
    params = nnx.to_pure_dict(nnx.split(model)[1])
    quantized = models.generate(
        model, tok, prompt, params=quantize_params(params, "int4w_g32_asym"), max_new_tokens=12
    )
    assert quantized == text
    with pytest.raises(ValueError, match="max_new_tokens"):
        models.generate_greedy(model, tok, "x", 0)
