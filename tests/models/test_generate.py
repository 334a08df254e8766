"""`generate_tokens` / `generate` on a tiny random Llama: batching, sampling, stops, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lowbit.api import quantize_params
from lowbit.models import Decoder, DecoderConfig
from lowbit.models._generate import bucket, generate_tokens
from lowbit.models._sampling import Sampling, greedy_tokens, sample_logits

CONFIG = DecoderConfig(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=64,
    context_length=64,
)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11]]
NEW = 6


@pytest.fixture(scope="module")
def tiny():
    return Decoder(CONFIG, rngs=nnx.Rngs(0))


@nnx.jit
def _last_logits(model, ids):
    # One program a length (op by op, each length compiled every op of the model again).
    return model(ids)[0, -1]


def _reference_greedy(model, prompt, n):
    """Greedy continuation by re-running the whole sequence without a cache, one row alone."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(jnp.argmax(_last_logits(model, jnp.asarray([ids], jnp.int32)))))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def greedy(tiny):
    return generate_tokens(tiny, PROMPTS, max_new_tokens=NEW)


def test_batched_left_padded_greedy_matches_one_row_at_a_time(tiny, greedy):
    assert greedy.prompt_lengths == [5, 3, 1]
    assert greedy.stopped == [False] * 3
    for prompt, tokens in zip(PROMPTS, greedy.tokens, strict=True):
        assert tokens == _reference_greedy(tiny, prompt, NEW)


def test_streamed_chunks_give_the_same_tokens(tiny, greedy):
    chunks = []
    out = generate_tokens(tiny, PROMPTS, max_new_tokens=NEW, chunk=2, on_tokens=chunks.append)
    assert out.tokens == greedy.tokens
    assert sum(c.shape[1] for c in chunks) == NEW and len(chunks) > 1


def test_the_graph_is_hashed_once_a_generation_not_once_a_chunk(tiny, greedy, monkeypatch):
    # jit hashes its static arguments on every call; nnx's GraphDef hashes its whole graph.
    generate_tokens(tiny, PROMPTS, max_new_tokens=NEW, chunk=1)  # compiled
    calls = []
    graph_hash = nnx.graph.GraphDef.__hash__

    def counted(self):
        calls.append(1)
        return graph_hash(self)

    monkeypatch.setattr(nnx.graph.GraphDef, "__hash__", counted)
    out = generate_tokens(tiny, PROMPTS, max_new_tokens=NEW, chunk=1)
    assert out.tokens == greedy.tokens
    assert len(calls) == 1  # NEW chunks


def test_stop_token_ends_a_row_and_is_not_returned(tiny, greedy):
    stop = greedy.tokens[0][2]
    out = generate_tokens(tiny, PROMPTS, max_new_tokens=NEW, stop_ids=[stop])
    assert out.tokens[0] == greedy.tokens[0][: greedy.tokens[0].index(stop)]
    assert out.stopped[0]
    for row in (1, 2):
        expected = greedy.tokens[row]
        if stop in expected:
            assert out.stopped[row] and out.tokens[row] == expected[: expected.index(stop)]
        else:
            assert out.tokens[row] == expected


def test_sampling_is_reproducible_and_depends_on_the_key(tiny):
    s = Sampling(temperature=1.5, top_k=20, top_p=0.9)
    a = generate_tokens(tiny, PROMPTS, max_new_tokens=NEW, sampling=s, key=1)
    b = generate_tokens(tiny, PROMPTS, max_new_tokens=NEW, sampling=s, key=1, chunk=4)
    c = generate_tokens(tiny, PROMPTS, max_new_tokens=NEW, sampling=s, key=2)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_sample_logits_top_k_and_top_p_restrict_the_support():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 256))
    keys = jax.random.split(jax.random.key(0), 8)
    draws = lambda s: np.concatenate([np.asarray(sample_logits(logits, k, s)) for k in keys])  # noqa: E731
    assert set(draws(Sampling(temperature=1.0, top_k=2))) == {0, 1}
    # Mass before token 2 is 0.8 >= 0.75: nucleus keeps tokens 0 and 1 only.
    assert set(draws(Sampling(temperature=1.0, top_p=0.75))) == {0, 1}
    assert set(draws(Sampling(temperature=1.0))) == {0, 1, 2, 3}
    assert set(draws(Sampling())) == {0}


def test_quantized_params_and_kv_cache_run_the_same_loop(tiny, greedy):
    params = quantize_params(nnx.to_pure_dict(nnx.split(tiny)[1]), "int8w")
    out = generate_tokens(tiny, PROMPTS, params=params, max_new_tokens=NEW, kv_cache="int8")
    assert [len(t) for t in out.tokens] == [NEW] * 3
    # int8 weights and cache on a random model: the first greedy token rarely moves.
    assert sum(a[0] == b[0] for a, b in zip(out.tokens, greedy.tokens, strict=True)) >= 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[]), "prompts is empty"),
        (dict(prompts=[[1], []]), r"prompts\[1\] has no tokens"),
        (dict(prompts=[list(range(60))], max_new_tokens=8), r"prompts\[0\].*context of 64"),
        (dict(kv_cache="int3"), "kv_cache"),
    ],
)
def test_bad_input_names_the_argument(tiny, kwargs, match):
    args = dict(prompts=PROMPTS, max_new_tokens=NEW) | kwargs
    with pytest.raises(ValueError, match=match):
        generate_tokens(tiny, args.pop("prompts"), **args)


@pytest.mark.parametrize("top_p", [0.0, 1.5, -0.1])
def test_top_p_outside_0_1_is_an_error(top_p):
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=top_p)


def test_buckets_bound_the_number_of_compiled_lengths():
    sizes = {bucket(n) for n in range(1, 4097)}
    assert len(sizes) <= 20
    assert all(bucket(n) >= n and bucket(n) <= max(16, 1.5 * n) for n in range(1, 4097))


_SPECIALS = st.sampled_from([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan])
# A few shapes (each is a program to compile); the values are what varies.
_LOGITS = arrays(
    np.float32,
    st.tuples(st.sampled_from([1, 3]), st.sampled_from([1, 5, 40])),
    elements=st.one_of(st.floats(-4, 4, width=32).map(lambda v: float(round(v))), _SPECIALS),
)
_GREEDY = jax.jit(greedy_tokens)


@given(_LOGITS)
def test_greedy_tokens_is_argmax(logits):
    # Rounded values make ties common; NaN, infinities and signed zeros as argmax treats them
    # (NumPy's too: the first maximum, or the first NaN).
    got = np.asarray(_GREEDY(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))


@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_kept_programs_give_the_same_tokens_in_a_new_process(tiny, tmp_path, kv_cache):
    """With a program directory, generation keeps its prefill and decode programs there; a
    new process (the in-process programs forgotten) reads them back without tracing and
    samples the same tokens, greedy and sampled, quantized weights included."""
    from lowbit.api import _stored

    params = quantize_params(nnx.to_pure_dict(nnx.state(tiny)), "int8")
    options = dict(
        params=params,
        max_new_tokens=NEW,
        sampling=Sampling(temperature=0.8, top_k=20),
        key=3,
        kv_cache=kv_cache,
        stop_ids=[5],
    )
    expected = generate_tokens(tiny, PROMPTS, **options)
    _stored._COMPILED.clear()
    kept = generate_tokens(tiny, PROMPTS, program_dir=tmp_path, **options)
    files = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert {name.split("-")[1] for name in files} == {"prefill", "decode"}
    _stored._COMPILED.clear()
    again = generate_tokens(tiny, PROMPTS, program_dir=tmp_path, **options)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == files
    assert kept == expected and again == expected
