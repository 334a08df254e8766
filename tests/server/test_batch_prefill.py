"""Waiting prompts prefilled together: the batch's choice and layout, and a scheduler that
prefills several waiting prompts in one pass hands out exactly the tokens `generate_tokens`
gives each alone, and saves their blocks to the prefix cache."""

import dataclasses
import time

import numpy as np
import pytest

from lowbit.cli._common import stop_ids
from lowbit.models import Sampling, generate_tokens
from lowbit.server import Job, Scheduler, SchedulerConfig
from lowbit.server import _batch_prefill as batch_prefill


def test_batch_sizes_are_powers_of_two_from_two():
    assert batch_prefill.batch_sizes(1) == []
    assert batch_prefill.batch_sizes(4) == [2, 4]
    assert batch_prefill.batch_sizes(6) == [2, 4]
    assert batch_prefill.batch_size(3, [2, 4]) == 4
    assert batch_prefill.batch_size(5, [2, 4]) is None


def test_partners_are_the_oldest_of_the_same_width():
    waiting = [[1] * 5, [1] * 40, [1] * 7, [1] * 3, [1] * 6]
    width_of = lambda n: 16 if n <= 16 else None  # noqa: E731
    assert batch_prefill.partners(waiting, 16, width_of, 2) == [0, 2]
    assert batch_prefill.partners(waiting, 16, width_of, 9) == [0, 2, 3, 4]
    assert batch_prefill.partners(waiting, 32, width_of, 9) == []


def test_batch_tokens_left_pad_each_prompt_and_repeat_the_first():
    tokens, start = batch_prefill.batch_tokens([[5, 6], [7, 8, 9]], 4, 4)
    assert tokens.tolist() == [[0, 0, 5, 6], [0, 7, 8, 9], [0, 0, 5, 6], [0, 0, 5, 6]]
    assert start.tolist() == [2, 1, 2, 2]
    with pytest.raises(ValueError, match="do not fit a batch"):
        batch_prefill.batch_tokens([[1]] * 3, 4, 2)
    with pytest.raises(ValueError, match="does not fit width"):
        batch_prefill.batch_tokens([[1] * 5], 4, 2)


def test_prefill_rows_must_be_positive():
    with pytest.raises(ValueError, match="prefill_rows"):
        SchedulerConfig(prefill_rows=0)


@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_waiting_prompts_prefilled_together_match_each_alone(loaded, kv_cache):
    rng = np.random.default_rng(7)
    # Three prompts of one width (16) and a sampled one among them; all wait at once.
    requests = [(5, 0.0, 0), (14, 0.8, 3), (9, 0.0, 0)]
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n, _, _ in requests]
    config = SchedulerConfig(slots=4, max_len=64, single_pass=16, chunk=16, prefix_block=8)
    scheduler = Scheduler(loaded.model, None, kv_cache, config)
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
    stop = frozenset(stop_ids(loaded, None))
    try:
        deadline = time.monotonic() + 300
        while not scheduler.ready or scheduler.programs.pending:
            assert time.monotonic() < deadline and scheduler.error is None
            time.sleep(0.05)
        jobs = []
        for i, (prompt, (_, temperature, seed)) in enumerate(zip(prompts, requests, strict=True)):

            def emit(tokens, finish, i=i):
                answers[i].extend(tokens)
                if finish is not None:
                    done[i] = finish

            jobs.append(Job(prompt, 8, temperature, 0, 1.0, seed, stop, deadline, emit))
        scheduler.submit_all(jobs)
        while len(done) < len(requests):
            assert time.monotonic() < deadline and scheduler.error is None
            time.sleep(0.05)
    finally:
        scheduler.close()
    assert ("prefill", (16, 4)) in ran and ("insert", (16, 4)) in ran
    assert ("prefill", 16) not in ran  # none was prefilled alone
    # Each prompt's full blocks went to the prefix cache from its row of the batch.
    assert ("save", (16, 4)) in ran and scheduler.prefill.prefix.used == 2
    for i, (prompt, (_, temperature, seed)) in enumerate(zip(prompts, requests, strict=True)):
        expected = generate_tokens(
            loaded.model,
            [prompt],
            max_new_tokens=8,
            sampling=Sampling(temperature=temperature),
            key=seed,
            stop_ids=stop,
            kv_cache=kv_cache,
        )
        assert answers[i] == expected.tokens[0], i
        assert done[i] == ("stop" if expected.stopped[0] else "length"), i


def test_deterministic_runs_every_step_over_all_slots_and_each_prompt_alone(loaded):
    # A row's arithmetic then never depends on the rows beside it (see SchedulerConfig).
    config = SchedulerConfig(
        slots=4, max_len=64, single_pass=16, chunk=16, speculate="ngram", deterministic=True
    )
    scheduler = Scheduler(loaded.model, None, None, config)
    assert max(scheduler.prefill.batch_sizes, default=1) == 1
    programs = [(name, width) for name, width, _ in scheduler.slots.row_specs()]
    assert programs == [("verify", 4)]
    fast = Scheduler(loaded.model, None, None, dataclasses.replace(config, deterministic=False))
    assert max(fast.prefill.batch_sizes) > 1
    assert ("decode_rows", 1) in [(name, width) for name, width, _ in fast.slots.row_specs()]
