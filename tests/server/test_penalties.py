"""`presence_penalty` and `frequency_penalty`: greedy answers checked step by step against the
rule applied in NumPy to the model's logits (computed without the server), in single-step
decode calls through the HTTP API and in multi-step calls of the scheduler alone."""

import time

import numpy as np
import openai
from reference_logits import answer_logits

from lowbit.server import Job, Scheduler, SchedulerConfig

PROMPT = [5, 17, 99, 42, 7]
NEW = 16
TOLERANCE = 2e-3  # the server's KV-cache decode against one full forward pass, in float32


def _check_greedy_with_penalties(loaded, prompt, ids, presence, frequency):
    """Each of `ids` is the argmax (up to float rounding) of ``logit - frequency * count -
    presence * (count > 0)`` over the answer's tokens before it; returns how many steps the
    penalty changed the choice."""
    counts = np.zeros(loaded.tokenizer.get_vocab_size())
    changed = 0
    for i, (token, logits) in enumerate(zip(ids, answer_logits(loaded, prompt, ids), strict=True)):
        logits = logits[: len(counts)]
        penalized = logits - frequency * counts - presence * (counts > 0)
        assert penalized[token] >= penalized.max() - TOLERANCE, i
        changed += int(np.argmax(logits) != token)
        counts[token] += 1
    return changed


def test_penalties_through_the_api(base_url, loaded):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)

    def answer(**penalties):
        out = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=NEW,
            temperature=0,
            extra_body={"return_token_ids": True},
            **penalties,
        )
        return out.choices[0].model_extra["token_ids"]

    plain = answer()
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself: a penalty has a job
    assert _check_greedy_with_penalties(loaded, PROMPT, plain, 0.0, 0.0) == 0
    penalized = answer(presence_penalty=0.5, frequency_penalty=1.5)
    assert penalized != plain
    assert _check_greedy_with_penalties(loaded, PROMPT, penalized, 0.5, 1.5) >= 1
    # Negative penalties favour what was said.
    favoured = answer(presence_penalty=-2.0)
    _check_greedy_with_penalties(loaded, PROMPT, favoured, -2.0, 0.0)
    # Streamed: the same tokens.
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=NEW,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=1.5,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    streamed = [t for c in stream for t in c.choices[0].model_extra.get("token_ids", [])]
    assert streamed == penalized


def test_penalties_in_multi_step_decode_calls(loaded):
    """Eight steps per decode call: the counts carried inside the call penalize its own
    tokens; a row that follows another in the same slot starts from no counts."""
    scheduler = Scheduler(
        loaded.model,
        None,
        None,
        SchedulerConfig(slots=1, max_len=64, single_pass=16, chunk=16, steps=8),
    )
    scheduler.start()
    answers, done = {}, []
    try:
        deadline = time.monotonic() + 300
        while not scheduler.ready:
            assert time.monotonic() < deadline and scheduler.error is None
            time.sleep(0.05)
        settings = [(0.0, 1.0), (0.8, 0.0), (0.0, 0.0)]
        for i, (presence, frequency) in enumerate(settings):
            answers[i] = []

            def emit(tokens, finish, i=i):
                answers[i].extend(tokens)
                if finish is not None:
                    done.append(i)

            job = Job(
                PROMPT, 20, 0.0, 0, 1.0, 0, frozenset(), time.monotonic() + 60, emit,
                presence_penalty=presence, frequency_penalty=frequency,
            )  # fmt: skip
            scheduler.submit(job)
        while len(done) < len(settings):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        scheduler.close()
    for i, (presence, frequency) in enumerate(settings):
        assert len(answers[i]) == 20
        changed = _check_greedy_with_penalties(loaded, PROMPT, answers[i], presence, frequency)
        assert (changed > 0) == (i < 2), i
