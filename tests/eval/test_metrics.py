"""Metrics on tiny synthetic models: perplexity, cosine, SQNR, sizes."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import eval as lbe
from lowbit.qarray import PerChannel, PerToken, QuantConfig
from lowbit.qarray import quantize as quantize_eager

# One compiled quantizer per (shape, config): eager quantization compiles many small ops.
quantize = jax.jit(quantize_eager, static_argnums=1)

VOCAB = 37


def test_uniform_model_perplexity_is_vocab_size():
    tokens = np.arange(200) % VOCAB
    calls = []

    def uniform(window):
        calls.append(window.shape)
        return jnp.zeros((*window.shape, VOCAB))

    result = lbe.perplexity(uniform, tokens, context=16, max_tokens=64)
    assert result.windows == 4 and result.tokens == 64
    assert set(calls) == {(1, 16)}
    assert result.perplexity == pytest.approx(VOCAB, rel=1e-5)


def test_perfect_model_perplexity_is_one_and_windows_score_next_tokens():
    tokens = np.arange(21) % 10  # the next token is always (t + 1) % 10

    def oracle(window):
        return 50.0 * jax.nn.one_hot((window + 1) % 10, 10)

    def off_by_one(window):
        return 50.0 * jax.nn.one_hot(window, 10)

    result = lbe.perplexity(oracle, tokens, context=4, stride=4)
    assert result.windows == 5 and result.tokens == 20  # starts 0..16; each needs 5 tokens
    assert result.perplexity == pytest.approx(1.0, abs=1e-6)
    assert lbe.perplexity(off_by_one, tokens, context=4).nll == pytest.approx(50.0, rel=1e-4)


def test_overlapping_windows_score_each_token_once():
    starts = lbe.window_starts(100, context=16, stride=8, max_tokens=40)
    assert starts == [0, 8, 16, 24]  # 16 + 8 + 8 + 8 = 40 scored


def test_perplexity_rejects_short_text_and_bad_stride():
    with pytest.raises(ValueError, match="needs at least 17"):
        lbe.perplexity(lambda w: jnp.zeros((1, 16, 3)), np.zeros(16, int), context=16)
    with pytest.raises(ValueError, match="stride=32"):
        lbe.window_starts(100, context=16, stride=32, max_tokens=10)


def test_perplexity_rejects_wrong_logits_shape():
    with pytest.raises(ValueError, match="expected \\(1, 8, vocab\\)"):
        lbe.perplexity(lambda w: jnp.zeros((8, 3)), np.zeros(20, int), context=8)


def test_cosine_similarity():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 7))
    assert np.allclose(lbe.cosine_similarity(a, 3.0 * a), 1.0)
    assert np.allclose(lbe.cosine_similarity(a, -a), -1.0)
    zeros = np.zeros((2, 3))
    assert np.allclose(lbe.cosine_similarity(zeros, zeros), 1.0)
    assert np.allclose(lbe.cosine_similarity(zeros, np.ones((2, 3))), 0.0)
    result = lbe.embedding_similarity(a, a + np.eye(5, 7) * 10)
    assert result.count == 5 and result.min <= result.mean < 1.0
    with pytest.raises(ValueError, match="\\[n, d\\]"):
        lbe.cosine_similarity(a, a[:3])


def test_sqnr_db():
    x = np.array([3.0, 4.0])
    assert lbe.sqnr_db(x, x) == math.inf
    assert lbe.sqnr_db(np.zeros(3), np.zeros(3)) == math.inf
    assert lbe.sqnr_db(np.zeros(2), x) == -math.inf
    # signal 25, noise 0.25 -> 20 dB
    assert lbe.sqnr_db(x, x + np.array([0.5, 0.0])) == pytest.approx(20.0)


def _params():
    key = jax.random.key(0)
    return {
        "embed": {"embedding": jax.random.normal(key, (64, 32))},
        "layers": [
            {
                "kernel": jax.random.normal(jax.random.fold_in(key, 1), (32, 48)),
                "bias": jnp.ones(48),
            }
        ],
    }


def test_weight_and_output_sqnr_follow_bits():
    params = _params()
    int8 = QuantConfig(format="int8", granularity=PerChannel((-1,)))
    int4 = QuantConfig(format="int4", granularity=PerChannel((-1,)))
    q8 = {
        **params,
        "layers": [
            {**params["layers"][0], "kernel": quantize(params["layers"][0]["kernel"], int8)}
        ],
    }
    q4 = {
        **params,
        "layers": [
            {**params["layers"][0], "kernel": quantize(params["layers"][0]["kernel"], int4)}
        ],
    }
    w8 = lbe.weight_sqnr(params, q8)
    w4 = lbe.weight_sqnr(params, q4)
    assert list(w8) == ["layers/0/kernel"]
    # ~6 dB per bit: int8 vs int4 differ by about 24 dB; gaussian absmax int8 is > 35 dB.
    assert w8["layers/0/kernel"] > 35.0
    assert 18.0 < w8["layers/0/kernel"] - w4["layers/0/kernel"] < 30.0
    out8 = lbe.output_sqnr(params, q8, rows=16)
    assert out8["layers/0/kernel"] > 30.0
    # Quantizing the activation too (w8a8) can only add noise on average.
    kernel = q8["layers"][0]["kernel"]

    w8a8 = dataclasses.replace(
        kernel, activation=QuantConfig(format="int4", granularity=PerToken())
    )
    out_a = lbe.output_sqnr(
        params, {**q8, "layers": [{**q8["layers"][0], "kernel": w8a8}]}, rows=16
    )
    assert out_a["layers/0/kernel"] < out8["layers/0/kernel"] - 6.0


def test_embedding_output_sqnr_contracts_last_axis():
    params = _params()
    q = {**params, "embed": {"embedding": quantize(params["embed"]["embedding"], "int8")}}
    out = lbe.output_sqnr(params, q, rows=4)
    assert lbe.contraction_axis("embed/embedding", 2) == 1
    assert out["embed/embedding"] > 30.0
    with pytest.raises(ValueError, match="expected \\[rows, 32\\]"):
        lbe.output_sqnr(params, q, inputs={"embed/embedding": np.zeros((4, 64))})


def test_sizes_count_packed_codes_and_scales():
    params = _params()
    kernel = params["layers"][0]["kernel"]
    q4 = quantize(kernel, QuantConfig(format="int4", granularity=PerChannel((-1,))))
    tree = {**params, "layers": [{**params["layers"][0], "kernel": q4}]}
    float_total = lbe.param_bytes(params)
    assert float_total == 4 * (64 * 32 + 32 * 48 + 48)
    assert lbe.float32_bytes(tree) == float_total
    # 4-bit codes: 32 * 48 / 2 bytes, plus 48 float32 scales.
    assert lbe.param_bytes(tree) == float_total - 4 * 32 * 48 + 32 * 48 // 2 + 4 * 48
    assert list(lbe.named_leaves(tree)) == ["embed/embedding", "layers/0/bias", "layers/0/kernel"]


def test_named_leaves_strips_nnx_value_keys():
    from flax import nnx

    _, state = nnx.split(nnx.Linear(3, 4, rngs=nnx.Rngs(0)))
    assert sorted(lbe.named_leaves(state)) == ["bias", "kernel"]
