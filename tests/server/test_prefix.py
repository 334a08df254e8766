"""The prefix cache: block names and LRU eviction (host side), and on the server: a request
that starts like an earlier one reads those tokens' keys and values instead of prefilling
them, says so in ``usage.prompt_tokens_details.cached_tokens``, and gets the tokens it would
get without the cache, in every KV cache format."""

import time

import numpy as np
import openai
import pytest
from server_support import CONFIG, running, served_model

from lowbit.models._generate import generate_tokens
from lowbit.server import Job, Scheduler, SchedulerConfig
from lowbit.server._prefix import PrefixIndex, chain

# -- the index ---------------------------------------------------------------------------------


def test_a_block_name_stands_for_the_whole_prefix():
    a = chain(list(range(40)), 16)
    assert len(a) == 2  # full blocks only
    b = chain([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # the same second block after another first one
    assert chain(list(range(40)), 16) == a
    assert chain(list(range(33)), 16) == a


def test_match_takes_the_longest_cached_head():
    index = PrefixIndex(blocks=8, size=4)
    names = chain(range(16), 4)
    placed = index.allocate(names[:3])
    index.touch(names[:3])
    assert [i for i, _ in placed] == [0, 1, 2]
    assert index.match(names) == [b for _, b in placed]
    other = chain([7] + list(range(1, 16)), 4)
    assert index.match(other) == []


def test_eviction_takes_a_chains_last_blocks_first_and_never_its_own():
    index = PrefixIndex(blocks=4, size=4)
    old = chain(range(100, 116), 4)  # 4 blocks: the pool is full
    index.allocate(old)
    index.touch(old)
    new = chain(range(8), 4)  # 2 blocks: evict old's last two
    placed = index.allocate(new)
    index.touch(new)
    assert len(placed) == 2 and index.stats.evictions == 2
    assert len(index.match(old)) == 2  # its head is still reachable
    assert len(index.match(new)) == 2
    huge = chain(range(200, 240), 4)  # longer than the pool: as much as fits, from its first
    placed = index.allocate(huge)
    index.touch(huge)
    assert [i for i, _ in placed] == [0, 1, 2, 3]
    assert len(index.match(huge)) == 4 and index.match(new) == []


def test_forget_returns_blocks():
    index = PrefixIndex(blocks=2, size=4)
    names = chain(range(8), 4)
    index.allocate(names)
    index.forget(names)
    assert index.used == 0 and index.match(names) == []
    assert len(index.allocate(names)) == 2


# -- the scheduler -----------------------------------------------------------------------------

NEW = 8
PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 250, 60)]
# Shares PROMPT's first 50 tokens (three full 16-token blocks), then differs.
FOLLOW_UP = PROMPT[:50] + [int(t) for t in np.random.default_rng(6).integers(3, 250, 30)]


def _answer(client, prompt):
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=NEW,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    return r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens_details.cached_tokens


def test_a_shared_head_is_read_from_the_cache_and_gives_the_same_tokens(base_url, loaded, served):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    first, cached = _answer(client, PROMPT)
    assert cached == 0
    again, cached = _answer(client, PROMPT)
    assert cached == 48  # 3 of its 3 full blocks (the last token is always prefilled)
    assert again == first
    follow, cached = _answer(client, FOLLOW_UP)
    assert cached == 48
    for prompt, got in ((PROMPT, first), (FOLLOW_UP, follow)):
        expected = generate_tokens(loaded.model, [prompt], max_new_tokens=NEW)
        assert got == expected.tokens[0]


def test_metrics_count_hits_and_queries(base_url):
    import urllib.request

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 250, 40)]
    _answer(client, prompt)
    _answer(client, prompt)
    text = urllib.request.urlopen(f"{base_url}/metrics").read().decode()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("lowbit_prefix_cache")
    }
    assert values["lowbit_prefix_cache_hit_tokens_total"] >= 32
    assert values["lowbit_prefix_cache_queried_tokens_total"] >= 80
    assert 0 < values["lowbit_prefix_cache_hit_rate"] < 1
    assert values["lowbit_prefix_cache_blocks_used"] >= 2
    assert "lowbit_prefix_cache_evictions_total" in values


def test_the_cache_can_be_turned_off(loaded):
    served = served_model(loaded, SchedulerConfig(**{**_fields(CONFIG), "kv_memory": 0}))
    assert served.scheduler.prefill.prefix is None
    with running(served) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert _answer(client, PROMPT)[1] == 0
        assert _answer(client, PROMPT)[1] == 0


def _fields(config):
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def test_kv_memory_too_small_for_one_block_is_refused(loaded):
    with pytest.raises(ValueError, match="kv_memory=10 bytes holds no prefix-cache block"):
        Scheduler(loaded.model, None, None, SchedulerConfig(max_len=64, kv_memory=10))


@pytest.mark.parametrize("kv", ["int8", "int4", "fp8"])
def test_quantized_caches_hit_and_match_a_miss(loaded, kv):
    """The scheduler alone, a pool of 5 blocks (evictions happen): each prompt twice and a
    follow-up, with the cache and (the same scheduler, its index set aside) without."""
    config = SchedulerConfig(slots=2, max_len=128, single_pass=16, chunk=16)
    memory = 5 * loaded.model.init_cache(1, 16, kv).nbytes()
    scheduler = Scheduler(
        loaded.model, None, kv, SchedulerConfig(**{**_fields(config), "kv_memory": memory})
    )
    scheduler.start()
    try:
        deadline = time.monotonic() + 300
        # Until the background compile is done, the pool is neither read nor written.
        while not scheduler.programs.done.is_set():
            assert time.monotonic() < deadline and scheduler.error is None
            time.sleep(0.05)
        index, scheduler.prefill.prefix = scheduler.prefill.prefix, None
        miss_tokens, miss_cached = _run(scheduler)
        scheduler.prefill.prefix = index
        hit_tokens, hit_cached = _run(scheduler)
    finally:
        scheduler.close()
    assert miss_cached == [0] * 5
    # `other`'s 4 blocks evict PROMPT's last two (of 3), so the first follow-up reads one block;
    # the second reads the follow-up's own 4 of 5 (the last token is always prefilled).
    assert hit_cached == [0, 48, 0, 16, 64]
    assert index.stats.evictions > 0
    assert hit_tokens == miss_tokens


def _run(scheduler):
    other = [int(t) for t in np.random.default_rng(8).integers(3, 250, 70)]
    tokens, cached = [], []
    deadline = time.monotonic() + 120
    for p in [PROMPT, PROMPT, other, FOLLOW_UP, FOLLOW_UP]:  # one at a time: each sees the
        out, done = [], []  # pool the earlier ones left
        job = Job(
            p,
            NEW,
            0.0,
            0,
            1.0,
            0,
            frozenset(),
            deadline,
            lambda t, f, out=out, done=done: (out.extend(t), f and done.append(f)),
        )
        scheduler.submit(job)
        while not done:
            assert time.monotonic() < deadline and scheduler.error is None
            time.sleep(0.01)
        tokens.append(out)
        cached.append(job.cached_tokens)
    return tokens, cached
