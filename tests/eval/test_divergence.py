"""KL-divergence and top-token agreement: the per-token math against NumPy, the statistics, and
the windowed pass over two models."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import eval as lbe
from lowbit.eval._divergence import summarize

VOCAB = 11


def _numpy_kld(base_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KLD(base || model) per row, in float64."""

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        shifted = x - x.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    log_p, log_q = log_softmax(base_logits), log_softmax(logits)
    return (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)


def test_identical_logits_have_zero_divergence_and_full_agreement():
    logits = np.random.default_rng(0).normal(size=(3, 5, VOCAB)).astype(np.float32) * 4
    kld, same_top = lbe.token_divergence(logits, logits)
    assert kld.shape == same_top.shape == (3, 5)
    np.testing.assert_array_equal(np.asarray(kld), 0.0)
    assert bool(np.all(same_top))


def test_divergence_of_two_known_distributions():
    # p = (1/2, 1/2), q = (1/4, 3/4): KLD(p || q) = 1/2 ln 2 + 1/2 ln(2/3).
    base = np.log(np.array([[0.5, 0.5]], np.float32))
    model = np.log(np.array([[0.25, 0.75]], np.float32))
    kld, same_top = lbe.token_divergence(base, model)
    expected = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
    assert float(kld[0]) == pytest.approx(expected, rel=1e-6)
    assert not bool(same_top[0])  # the base's tie goes to token 0, the model's top is token 1


def test_divergence_matches_numpy_on_random_logits():
    rng = np.random.default_rng(1)
    base = rng.normal(size=(64, VOCAB)).astype(np.float32) * 3
    model = base + rng.normal(size=base.shape).astype(np.float32) * 0.5
    kld, same_top = lbe.token_divergence(base, model)
    np.testing.assert_allclose(np.asarray(kld), _numpy_kld(base, model), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(same_top), base.argmax(-1) == model.argmax(-1))
    assert float(np.min(kld)) >= -1e-6  # a divergence is not negative (up to rounding)


def test_low_precision_logits_are_computed_in_float32():
    rng = np.random.default_rng(2)
    base = rng.normal(size=(8, VOCAB)).astype(np.float32)
    model = base * 1.5
    kld, _ = lbe.token_divergence(jnp.asarray(base, jnp.bfloat16), jnp.asarray(model, jnp.bfloat16))
    assert kld.dtype == jnp.float32
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (base, model)]
    np.testing.assert_allclose(np.asarray(kld), _numpy_kld(*rounded), rtol=1e-4, atol=1e-6)


def test_extreme_and_infinite_logits_give_no_nan():
    inf = np.float32(np.inf)
    big = np.finfo(np.float32).max
    base = np.array(
        [
            [0.0, 1.0, -inf, -inf],  # masked tokens in both: the KLD of the rest
            [0.0, 1.0, -inf, 2.0],  # masked in the base only: finite
            [0.0, 1.0, 2.0, 3.0],  # masked in the model where the base has mass: +inf
            [1e30, -1e30, 0.0, 0.0],  # huge logits
            [big, -big, 0.0, 1e30],  # the largest finite logits: the KLD overflows float32
            [1e30, 1e30, -1e30, -1e30],
        ],
        np.float32,
    )
    model = np.array(
        [
            [1.0, 0.0, -inf, -inf],
            [0.0, 1.0, 0.5, 2.0],
            [0.0, 1.0, -inf, 3.0],
            [-1e30, 1e30, 0.0, 0.0],
            [-big, big, 0.0, 1e30],
            [1e30, 1e30, -1e30, -1e30],
        ],
        np.float32,
    )
    kld, same_top = lbe.token_divergence(base, model)
    kld = np.asarray(kld)
    assert not np.any(np.isnan(kld))
    assert kld[0] == pytest.approx(_numpy_kld(base[0, :2], model[0, :2]), rel=1e-5)
    assert np.isfinite(kld[1]) and kld[1] > 0
    p = np.exp(base[1, [0, 1, 3]]) / np.exp(base[1, [0, 1, 3]]).sum()
    log_q = model[1] - np.log(np.exp(model[1]).sum())
    assert kld[1] == pytest.approx(np.sum(p * (np.log(p) - log_q[[0, 1, 3]])), rel=1e-5)
    assert kld[2] == np.inf
    assert kld[3] == pytest.approx(2e30, rel=1e-5)  # all mass moved from token 0 to token 1
    assert kld[4] == np.inf  # 2 * big is past float32's range: +inf, not NaN
    assert kld[5] == 0.0
    assert np.asarray(same_top).tolist() == [False, True, True, False, False, True]


def test_agreement_counts_positions_whose_argmax_is_equal():
    base = np.zeros((6, VOCAB), np.float32)
    model = np.zeros((6, VOCAB), np.float32)
    base_top = [0, 3, 5, 7, 9, 10]
    model_top = [0, 3, 4, 7, 1, 10]
    base[np.arange(6), base_top] = 5.0
    model[np.arange(6), model_top] = 5.0
    _, same_top = lbe.token_divergence(base, model)
    assert np.asarray(same_top).tolist() == [True, True, False, True, False, True]
    result = summarize(np.zeros(6), same_top, np.arange(6), context=6, base_nll=0.0, buckets=2)
    assert result.top1 == pytest.approx(4 / 6)


def test_mean_ci95_is_1_96_standard_errors():
    values = np.random.default_rng(3).exponential(size=500)
    mean, half = lbe.mean_ci95(values)
    assert mean == pytest.approx(values.mean())
    assert half == pytest.approx(1.959964 * values.std(ddof=1) / math.sqrt(500), rel=1e-6)
    # llama.cpp's printed uncertainty, from running sums: sqrt((sum2/n - mean^2) / (n - 1)).
    llama_cpp = math.sqrt(((values**2).sum() / 500 - values.mean() ** 2) / 499)
    assert half / llama_cpp == pytest.approx(1.959964, rel=1e-6)
    # A 0/1 indicator: the binomial interval 1.96 * sqrt(p (1 - p) / (n - 1)).
    flags = np.arange(40) % 4 == 0
    mean, half = lbe.mean_ci95(flags)
    assert mean == 0.25
    assert half == pytest.approx(1.959964 * math.sqrt(0.25 * 0.75 / 39), rel=1e-6)
    assert lbe.mean_ci95(np.array([2.0])) == (2.0, 0.0)
    assert lbe.mean_ci95(np.array([1.0, np.inf]))[1] == math.inf
    with pytest.raises(ValueError, match="at least one value"):
        lbe.mean_ci95(np.array([]))


def test_summary_percentiles_and_position_buckets():
    rng = np.random.default_rng(4)
    kld = rng.exponential(size=200)
    positions = np.arange(200) % 20
    result = summarize(kld, kld < 1.0, positions, context=20, base_nll=math.log(7.0), buckets=4)
    assert result.tokens == 200
    assert result.kld_mean == pytest.approx(kld.mean())
    assert result.kld_median == pytest.approx(np.median(kld))
    assert result.kld_p99 == pytest.approx(np.percentile(kld, 99))
    assert result.kld_max == kld.max()
    assert result.base_perplexity == pytest.approx(7.0)
    assert result.position_starts == (0, 5, 10, 15)
    assert result.position_tokens == (50, 50, 50, 50)
    assert result.position_kld[1] == pytest.approx(kld[(positions >= 5) & (positions < 10)].mean())
    assert lbe.DivergenceResult.from_json(result.to_json()) == result
    with pytest.raises(ValueError, match="one per token"):
        summarize(kld, kld[:3] < 1, positions, context=20, base_nll=0.0)
    with pytest.raises(ValueError, match="unknown field 'kld'"):
        lbe.DivergenceResult.from_json({**result.to_json(), "kld": 1})


def _model(seed: int, scale: float = 1.0):
    table = np.random.default_rng(seed).normal(size=(VOCAB, VOCAB)).astype(np.float32) * scale

    def logits_fn(window):
        return jnp.asarray(table)[window]

    return logits_fn, table


@pytest.mark.parametrize("stride", [None, 4])
def test_windowed_divergence_equals_the_divergence_of_all_scored_tokens(stride):
    tokens = np.random.default_rng(5).integers(0, VOCAB, size=60)
    model, model_table = _model(6)
    base, base_table = _model(7)
    options = dict(context=8, stride=stride, max_tokens=40)
    result, summary = lbe.divergence(model, base, tokens, **options)
    assert result.nll == pytest.approx(lbe.perplexity(model, tokens, **options).nll, rel=1e-6)
    base_ppl = lbe.perplexity(base, tokens, **options)
    assert summary.tokens == result.tokens == base_ppl.tokens
    assert summary.base_nll == pytest.approx(base_ppl.nll, rel=1e-5)
    # The logits here depend on the current token only, so every scored token's KLD is that of
    # its rows of the two tables: the windows must score each token exactly once.
    scored = []
    for begin in lbe.window_starts(60, context=8, stride=stride or 8, max_tokens=40):
        first = 0 if begin == 0 else 8 - (stride or 8)
        scored.extend(range(begin + first, begin + 8))
    expected = _numpy_kld(base_table[tokens[scored]], model_table[tokens[scored]])
    assert summary.kld_mean == pytest.approx(expected.mean(), rel=1e-5)
    assert summary.kld_p99 == pytest.approx(np.percentile(expected, 99), rel=1e-5)
    agree = base_table[tokens[scored]].argmax(-1) == model_table[tokens[scored]].argmax(-1)
    assert summary.top1 == pytest.approx(agree.mean())
    assert sum(summary.position_tokens) == summary.tokens


def test_a_model_against_itself_has_zero_divergence():
    tokens = np.arange(40) % VOCAB
    model, _ = _model(8)
    _, summary = lbe.divergence(model, model, tokens, context=8, max_tokens=32)
    assert summary.kld_mean == 0.0 and summary.kld_max == 0.0 and summary.top1 == 1.0
    assert summary.kld_ci95 == 0.0 and summary.top1_ci95 == 0.0


def test_vocabularies_that_differ_name_both_sizes():
    tokens = np.arange(40) % VOCAB
    model, _ = _model(8)

    def wider(window):
        return jnp.zeros((*window.shape, VOCAB + 5))

    with pytest.raises(ValueError, match=rf"vocabularies of {VOCAB + 5} and {VOCAB} tokens"):
        lbe.divergence(model, wider, tokens, context=8, max_tokens=16)


def test_kld_by_position_plot(tmp_path):
    result = summarize(
        np.linspace(0, 1, 32), np.ones(32, bool), np.arange(32) % 16, context=16, base_nll=1.0
    )
    png = lbe.plot_kld_by_position(result, tmp_path / "kld.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    empty = lbe.DivergenceResult.from_json({**result.to_json(), "position_starts": []})
    with pytest.raises(ValueError, match="position buckets"):
        lbe.plot_kld_by_position(empty, tmp_path / "x.png")
