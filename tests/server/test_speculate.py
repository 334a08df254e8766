"""Speculative decoding by prompt lookup, and decoding over the busy rows only: the scheduler
hands out exactly the tokens `generate_tokens` gives each request alone, while guesses are
accepted (counted) and the smaller programs run."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.cli._common import stop_ids
from lowbit.models import Sampling, generate_tokens
from lowbit.server import DraftModel, Job, Scheduler, SchedulerConfig
from lowbit.server import _programs as programs
from lowbit.server._registry import ProgramRegistry
from lowbit.server._speculate import accepted, draft, windows

NEW = 24


def test_draft_follows_the_latest_earlier_occurrence_of_the_longest_tail():
    text = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # The tail [5, 2, 3] never occurred; [2, 3] last did at 6, followed by 7, 8, 5.
    assert draft(text, 3).tolist() == [7, 8, 5]
    assert draft(text, 8).tolist() == [7, 8, 5, 2, 3]  # up to the end of the text
    assert draft(np.array([4, 5, 6]), 3).tolist() == []  # nothing repeats
    assert draft(np.array([4]), 3).tolist() == []


def test_accepted_counts_the_leading_agreement():
    assert accepted(np.array([1, 2, 3]), np.array([1, 2, 3, 4])) == 3
    assert accepted(np.array([1, 2, 3]), np.array([1, 7, 3, 4])) == 1
    assert accepted(np.array([1, 2]), np.array([0, 2, 3])) == 0


def test_row_index_pads_with_distinct_free_rows():
    assert programs.row_buckets(8) == [1, 2, 4]
    assert programs.row_index([5], 8).tolist() == [5]
    assert programs.row_index([1, 6, 3], 8).tolist() == [1, 3, 6, 0]
    assert programs.row_index([0, 1, 2, 3, 4], 8).tolist() == list(range(8))
    assert programs.row_index([0], 1).tolist() == [0]


def _serve(loaded, config, kv_cache, requests, draft=None, logprobs=None):
    """Runs `requests` (prompt, max_tokens, temperature, seed, delay) through a scheduler,
    each asking for `logprobs` alternatives; returns it, each request's tokens and finish
    reasons, and the programs each turn ran. A delay is seconds, or a predicate on
    (scheduler, finished requests) that is waited for: a wall-time delay cannot promise that a
    background compile has finished on a slow machine."""
    scheduler = Scheduler(loaded.model, None, kv_cache, config, draft=draft)
    ran = []
    program = scheduler._program

    def spy(name, width, args):
        if scheduler.ready:
            ran.append((name, width))
        return program(name, width, args)

    scheduler._program = spy
    scheduler.start()
    answers = {i: [] for i in range(len(requests))}
    done = {}
    try:
        deadline = time.monotonic() + 300

        def wait_for(condition):
            while not condition():
                assert time.monotonic() < deadline and scheduler.error is None
                time.sleep(0.05)

        # Also the background compile: a turn speculates (or decodes the busy rows alone) only
        # once its program is compiled.
        wait_for(lambda: scheduler.ready and not scheduler.programs.pending)
        for i, (prompt, max_tokens, temperature, seed, delay) in enumerate(requests):
            if callable(delay):
                wait_for(lambda delay=delay: delay(scheduler, done))
            else:
                time.sleep(delay)

            def emit(tokens, finish, i=i):
                answers[i].extend(tokens)
                if finish is not None:
                    done[i] = finish

            stop = frozenset(stop_ids(loaded, None))
            job = Job(prompt, max_tokens, temperature, 0, 1.0, seed, stop, deadline, emit)
            job = dataclasses.replace(job, logprobs=logprobs)
            scheduler.submit(job)
        wait_for(lambda: len(done) == len(requests))
    finally:
        scheduler.close()
    return scheduler, answers, done, ran


def _repeating(rng, n, period):
    unit = [int(t) for t in rng.integers(3, 250, period)]
    return (unit * (n // period + 1))[:n]


def test_windows_feed_exactly_the_unseen_tokens():
    assert windows(1) == [1] and windows(2) == [2] and windows(13) == [8, 4, 1]
    assert windows(200) == [64, 64, 64, 8]


def _perturbed(loaded, scale):
    """The tiny model's own module with its weights scaled (a draft that sometimes differs)."""
    from flax import nnx

    state = nnx.split(loaded.model)[1]
    return jax.tree.map(lambda a: a * scale if a.dtype == jnp.float32 else a, state)


@pytest.mark.parametrize(
    ("kv_cache", "speculate", "scale"),
    # The n-gram drafter on a quantized cache; a draft model on a float cache (the served
    # model drafting for itself) and on a quantized one (a perturbed draft).
    [("int4", "ngram", None), (None, "draft", 1.0), ("int8", "draft", 0.8)],
)
def test_speculation_gives_the_greedy_tokens_and_accepts_guesses(
    loaded, kv_cache, speculate, scale
):
    rng = np.random.default_rng(3)
    prompt = lambda n: [int(t) for t in rng.integers(3, 250, n)]
    # A long greedy answer alone (a random model's answers repeat pieces of themselves), a
    # short max_tokens, and rows joining later (one sampled: no guesses while it runs) in a
    # 64-slot cache that must slide.
    requests = [
        (prompt(5), 44, 0.0, 0, 0.0),
        (prompt(9), 3, 0.0, 1, 0.0),
        (prompt(7), 10, 0.9, 2, 1.0),
        (prompt(12), 40, 0.0, 3, 0.0),
    ]
    config = SchedulerConfig(
        slots=2,
        max_len=64,
        single_pass=16,
        chunk=16,
        kv_memory=0,
        speculate=speculate,
        speculate_tokens=4,
    )
    # A draft model: the served one itself (its guesses all hold, up to float rounding) or
    # with weights scaled (some do not).
    draft = None if scale is None else DraftModel(loaded.model, _perturbed(loaded, scale))
    scheduler, answers, done, ran = _serve(loaded, config, kv_cache, requests, draft)
    stop = stop_ids(loaded, None)
    for i, (prompt_, max_tokens, temperature, seed, _) in enumerate(requests):
        expected = generate_tokens(
            loaded.model,
            [prompt_],
            max_new_tokens=max_tokens,
            sampling=Sampling(temperature=temperature),
            key=seed,
            stop_ids=stop,
            kv_cache=kv_cache,
        )
        assert answers[i] == expected.tokens[0], i
        assert done[i] == ("stop" if expected.stopped[0] else "length"), i
    stats = scheduler.speculation
    assert 0 < stats.accepted_tokens <= stats.drafted_tokens
    assert ("verify", 1) in ran
    assert scheduler.slots.slides >= 1
    if scale == 1.0:  # the served model drafting for itself: nearly every guess holds
        assert stats.accepted_tokens >= 0.8 * stats.drafted_tokens
    if draft is not None:  # a new prompt fed alone in windows, then the rows together
        assert ("draft_decode_rows", 1) in ran and ("draft_verify", (2, 1)) in ran
        assert any(name == "draft_verify" and w[0] > 2 for name, w in ran)


def test_a_draft_model_of_another_vocabulary_is_refused(loaded):
    import dataclasses as dc

    class Other:
        config = dc.replace(loaded.model.config, vocab_size=loaded.model.config.vocab_size + 1)

    config = SchedulerConfig(slots=1, max_len=64, single_pass=16, chunk=16, speculate="draft")
    with pytest.raises(ValueError, match="same tokenizer"):
        Scheduler(loaded.model, None, None, config, draft=DraftModel(Other()))
    with pytest.raises(ValueError, match="needs a draft model"):
        Scheduler(loaded.model, None, None, config)


def test_decode_runs_only_the_busy_rows(loaded, monkeypatch):
    rng = np.random.default_rng(4)
    requests = [([int(t) for t in rng.integers(3, 250, n)], 12, 0.0, n, 0.0) for n in (5, 9)]
    config = SchedulerConfig(slots=4, max_len=64, single_pass=16, chunk=16, kv_memory=0)
    scheduler, answers, done, ran = _serve(loaded, config, None, requests)
    for i, (prompt, max_tokens, *_rest) in enumerate(requests):
        expected = generate_tokens(loaded.model, [prompt], max_new_tokens=max_tokens)
        assert answers[i] == expected.tokens[0], i
    assert ("decode", 4) not in ran
    assert {("decode_rows", 1), ("decode_rows", 2)} & set(ran)
    assert scheduler.speculation is None
    # The busy rows' variant with log-probabilities is compiled once a request asks (the full
    # step runs meanwhile), and a request after that runs it.
    assert not any(name == "decode_rows_logprobs" for name, _ in scheduler.programs.compiled())

    def compiled_and_idle(scheduler, done):
        # The first request has finished and the program it asked for is compiled, so the
        # second runs alone on it.
        compiled = scheduler.programs.compiled()
        return 0 in done and ("decode_rows_logprobs", 1) in compiled

    late = [(*requests[0][:4], 0.0), (*requests[1][:4], compiled_and_idle)]
    asked = []
    compile_soon = ProgramRegistry.compile_soon

    def counting(self, name, width, args):
        asked.append((name, width))
        return compile_soon(self, name, width, args)

    monkeypatch.setattr(ProgramRegistry, "compile_soon", counting)
    _, again, _, ran = _serve(loaded, config, None, late, logprobs=2)
    assert again == answers
    assert ("decode_rows_logprobs", 1) in ran
    # Asked for once each, not on every step while it compiled.
    assert ("decode_rows_logprobs", 1) in asked and len(asked) == len(set(asked))


def test_the_busy_rows_log_probabilities_are_the_full_decodes(loaded):
    config = SchedulerConfig(slots=4, max_len=64, single_pass=16, chunk=16, kv_memory=0)
    scheduler = Scheduler(loaded.model, None, None, config)
    scheduler.slots.start[:] = 0
    scheduler.slots.token[:] = [5, 17, 42, 99]
    index = np.array([1, 3], np.int32)
    args = scheduler.slots.decode_args
    full, _ = programs.decode_logprobs(scheduler.graphdef, *args(3))
    rows, _ = programs.decode_rows_logprobs(scheduler.graphdef, *args(3, index))
    idle = np.array([0, 2])
    rows, full = jax.tree.map(np.asarray, (rows, full))
    np.testing.assert_array_equal(rows.tokens[index], full.tokens[index])
    assert (rows.tokens[idle] == -1).all()
    pairs = zip(jax.tree.leaves(rows.logprobs), jax.tree.leaves(full.logprobs), strict=True)
    for got, want in pairs:
        np.testing.assert_allclose(got[index][:, :3], want[index][:, :3], rtol=1e-5, atol=1e-5)
        assert not got[idle].any()  # rows not run: zeros
