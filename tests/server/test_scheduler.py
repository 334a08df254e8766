"""Continuous batching under load: concurrent streaming clients joining and leaving the running
batch get exactly the tokens `generate_tokens` gives each of them alone; a restarted server
gives the same answers."""

import asyncio
import time

import numpy as np
import openai
from server_support import CONFIG, running, served_model

from lowbit.api import _stored
from lowbit.models import Sampling, generate_tokens

NEW = 16
# Prompt lengths: one-pass prefills, and two longer than CONFIG.single_pass
# (prefilled in chunks between the others' decode steps).
LENGTHS = (3, 9, 14, 40, 47)
SAMPLINGS = (Sampling(), Sampling(temperature=0.9, top_k=40, top_p=0.95))
CLIENTS = 32


def _requests(vocab):
    rng = np.random.default_rng(0)
    out = []
    for i in range(CLIENTS):
        n = LENGTHS[i % len(LENGTHS)]
        out.append(
            dict(
                prompt=[int(t) for t in rng.integers(3, vocab, n)],
                sampling=SAMPLINGS[i % len(SAMPLINGS)],
                seed=1000 + i,
                leave=i % 6 == 5,  # these clients disconnect after two chunks
            )
        )
    return out


async def _stream(client, r):
    s = r["sampling"]
    stream = await client.completions.create(
        model="tiny",
        prompt=r["prompt"],
        max_tokens=NEW,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=r["seed"],
        stream=True,
        extra_body={"top_k": s.top_k or 0, "return_token_ids": True},
    )
    ids, finish, chunks = [], None, 0
    async for chunk in stream:
        chunks += 1
        if r["leave"] and chunks == 2:
            await stream.close()
            return None
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids", [])
            finish = chunk.choices[0].finish_reason or finish
    return ids, finish


async def _all(url, requests):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    async with client:
        return await asyncio.gather(*(_stream(client, r) for r in requests))


def _reference(loaded, served, r):
    return generate_tokens(
        loaded.model,
        [r["prompt"]],
        max_new_tokens=NEW,
        sampling=r["sampling"],
        key=r["seed"],
        stop_ids=sorted(served.stop_ids),
    )


def test_32_concurrent_streams_match_generate_token_for_token(base_url, loaded, served):
    requests = _requests(loaded.tokenizer.get_vocab_size())
    answers = asyncio.run(_all(base_url, requests))
    checked = 0
    for r, answer in zip(requests, answers, strict=True):
        if r["leave"]:
            assert answer is None
            continue
        ids, finish = answer
        expected = _reference(loaded, served, r)
        assert ids == expected.tokens[0], r
        assert finish == ("stop" if expected.stopped[0] else "length")
        checked += 1
    assert checked == CLIENTS - sum(r["leave"] for r in requests)
    # The clients that left freed their slots: nothing runs any more.
    deadline = time.monotonic() + 5
    while served.scheduler.busy_slots or served.scheduler.queue_length:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_restarted_server_gives_the_same_answers(loaded):
    requests = _requests(loaded.tokenizer.get_vocab_size())[:6]
    requests = [dict(r, leave=False) for r in requests]
    runs = []
    for _ in range(2):
        with running(served_model(loaded, CONFIG)) as url:
            runs.append(asyncio.run(_all(url, requests)))
    assert runs[0] == runs[1]
    assert all(len(ids) >= 1 for ids, _ in runs[0])


def _run_int8_slots(loaded, program_dir=None):
    """Six requests through two slots of a 64-slot int8 cache (rows join mid-way and the cache
    slides left several times); returns the scheduler and each request's tokens."""
    from lowbit.server import Job, Scheduler, SchedulerConfig

    config = SchedulerConfig(slots=2, max_len=64, single_pass=16, chunk=16)
    scheduler = Scheduler(loaded.model, None, "int8", config, program_dir=program_dir)
    scheduler.start()
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (5, 12, 9, 16, 14, 7)]
    answers = {i: [] for i in range(len(prompts))}
    done = []
    try:
        deadline = time.monotonic() + 300
        while not scheduler.ready:
            assert time.monotonic() < deadline and scheduler.error is None
            time.sleep(0.05)
        for i, p in enumerate(prompts):

            def emit(tokens, finish, i=i):
                answers[i].extend(tokens)
                if finish is not None:
                    done.append((i, finish))

            job = Job(p, 20, 0.0, 0, 1.0, i, frozenset(), time.monotonic() + 60, emit)
            scheduler.submit(job)
        while len(done) < len(prompts):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Every program compiled (and kept), the background ones too.
        assert scheduler.programs.done.wait(300) and scheduler.error is None
    finally:
        scheduler.close()
    assert sorted(done) == [(i, "length") for i in range(len(prompts))]
    return scheduler, prompts, answers


def test_an_int8_kv_cache_slides_and_still_matches_generate(loaded):
    """The scheduler alone (no HTTP)."""
    scheduler, prompts, answers = _run_int8_slots(loaded)
    assert scheduler.slots.slides >= 1
    for i, p in enumerate(prompts):
        expected = generate_tokens(loaded.model, [p], max_new_tokens=20, kv_cache="int8")
        assert answers[i] == expected.tokens[0], i


def test_a_second_start_reads_its_programs_and_answers_the_same(loaded, tmp_path):
    """With a program directory, the first start keeps every program's traced form there; the
    second compiles from those files without tracing, and every request gets the same tokens."""
    first, _, answers = _run_int8_slots(loaded, tmp_path)
    kept = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert all(name.endswith(".jaxexport") for name in kept)
    assert {name.split("-")[0] for name in kept} >= {"decode", "prefill", "insert", "shift"}
    compiled = first.programs.compiled()
    assert all(program.stored for program in compiled.values())

    _stored._COMPILED.clear()  # as a new process
    second, _, again = _run_int8_slots(loaded, tmp_path)
    # Nothing traced again: no file added or rewritten.
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == kept
    assert set(second.programs.compiled()) == set(compiled)
    assert again == answers
