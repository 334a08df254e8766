"""Runners and sessions on tiny random Llama and BERT models (no downloaded weights)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowbit import eval as lbe
from lowbit.api import quantize_params
from lowbit.eval._harness import encoder_runner, lm_perplexity, lm_runner, lm_speed, pad_batch
from lowbit.models import Bert, BertConfig, Decoder, DecoderConfig, mean_pool
from lowbit.recipes import preset

LLAMA = DecoderConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64
)
CONTEXT = 16


def _init(build):
    """Builds a random model inside one jit: eager initialisation runs op by op and is slow."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(nnx.Rngs(0))))
    state = jax.jit(lambda: nnx.state(build(nnx.Rngs(0))))()
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def llama():
    model = _init(lambda rngs: Decoder(LLAMA, rngs=rngs))
    runner, params = lm_runner(model)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (3 * CONTEXT + 1,), 0, 64))
    return model, runner, params, tokens


def test_lm_perplexity_matches_a_direct_computation(llama):
    model, runner, params, tokens = llama
    result = lm_perplexity(runner, params, tokens, context=CONTEXT, max_tokens=3 * CONTEXT)
    assert result.windows == 3 and result.tokens == 3 * CONTEXT
    graphdef = nnx.graphdef(model)
    forward = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t))  # plain jit, no engine
    total = 0.0
    for w in range(3):
        window = tokens[w * CONTEXT : (w + 1) * CONTEXT]
        log_probs = jax.nn.log_softmax(forward(params, jnp.asarray(window[None]))[0], axis=-1)
        targets = tokens[w * CONTEXT + 1 : (w + 1) * CONTEXT + 1]
        total -= float(jnp.sum(log_probs[jnp.arange(CONTEXT), targets]))
    assert result.nll == pytest.approx(total / (3 * CONTEXT), rel=1e-5)
    # A random model is near uniform: perplexity within a factor 2 of the vocabulary size.
    assert 32 < result.perplexity < 128


def test_quantized_params_run_through_the_same_runner(llama):
    _, runner, params, tokens = llama
    reference = lm_perplexity(runner, params, tokens, context=CONTEXT, max_tokens=CONTEXT)
    quantized = quantize_params(nnx.to_pure_dict(params), preset("int8w"))
    result = lm_perplexity(runner, quantized, tokens, context=CONTEXT, max_tokens=CONTEXT)
    # int8 per-channel weights (~40 dB) move the mean log-likelihood by well under 1%.
    assert abs(result.nll / reference.nll - 1) < 0.01
    assert lbe.param_bytes(quantized) < 0.4 * lbe.param_bytes(params)


def test_lm_speed_reports_positive_rates(llama):
    _, runner, params, tokens = llama
    speed = lm_speed(runner, params, tokens[:CONTEXT], decode_steps=3, iters=1)
    assert speed.prefill_tokens == CONTEXT and speed.decode_steps == 3
    assert speed.prefill_tokens_per_s > 0 and speed.decode_tokens_per_s > 0


class _CharTokenizer:
    """Stands in for a `tokenizers.Tokenizer`: one id per character, 1..63."""

    class _Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode_batch(self, sentences):
        return [self._Encoding([1 + ord(c) % 63 for c in s]) for s in sentences]


def test_encoder_runner_embeds_like_the_model():
    config = BertConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, ffn_dim=32, max_positions=64)
    model = _init(lambda rngs: Bert(config, rngs=rngs))
    tokenizer = _CharTokenizer()
    runner, params = encoder_runner(model, tokenizer, mean_pool)
    sentences = ["hello there", "a much longer sentence than that", "x"]
    tokens, mask = pad_batch(tokenizer, sentences)
    assert tokens.shape == (3, 32) and mask.sum(axis=1).tolist() == [11, 32, 1]
    embeddings = runner.embed(params, sentences)
    graphdef = nnx.graphdef(model)
    apply = jax.jit(lambda state, t, m: mean_pool(nnx.merge(graphdef, state)(t, m), m))
    expected = apply(params, jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(embeddings, np.asarray(expected), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    quantized = quantize_params(nnx.to_pure_dict(params), preset("int8w"))
    similarity = lbe.embedding_similarity(embeddings, runner.embed(quantized, sentences))
    assert 0.99 < similarity.min <= similarity.mean <= 1.0 + 1e-6
    assert not math.isnan(similarity.mean)
    with pytest.raises(ValueError, match="sentences is empty"):
        pad_batch(tokenizer, [])
