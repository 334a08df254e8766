"""`n` choices per request through the official client: choice i is what a request of one
choice with seed ``seed + i`` gets, streamed and not; a client that leaves cancels them all."""

import time

import httpx
import openai
from server_support import CONFIG

PROMPT = "Once upon a time"
SAMPLING = dict(max_tokens=8, temperature=0.9, top_p=0.95)


def _client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)


def _ids(choice):
    return choice.model_extra["token_ids"]


def test_choice_i_is_the_single_answer_with_seed_plus_i(base_url):
    client = _client(base_url)
    ids = {"return_token_ids": True}
    out = client.completions.create(
        model="tiny", prompt=PROMPT, n=3, seed=5, logprobs=1, extra_body=ids, **SAMPLING
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    singles = [
        client.completions.create(
            model="tiny", prompt=PROMPT, seed=5 + i, extra_body=ids, **SAMPLING
        )
        for i in range(3)
    ]
    assert [_ids(c) for c in out.choices] == [_ids(s.choices[0]) for s in singles]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]
    assert len({tuple(_ids(c)) for c in out.choices}) > 1  # sampled: the choices differ
    for c in out.choices:
        assert len(c.logprobs.token_logprobs) == len(_ids(c))
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_choices_carry_their_index(base_url):
    client = _client(base_url)
    messages = [{"role": "user", "content": "hello"}]
    args = dict(model="tiny", messages=messages, n=3, seed=9, **SAMPLING)
    whole = client.chat.completions.create(**args)
    texts, finishes, roles = ["", "", ""], [None] * 3, [None] * 3
    stream = client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] = roles[c.index] or c.delta.role
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert roles == ["assistant"] * 3
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_client_that_leaves_cancels_every_choice(base_url, served):
    body = {"prompt": [7, 8, 9], "n": 3, "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert served.scheduler.busy_slots + served.scheduler.queue_length >= 1
    deadline = time.monotonic() + 10
    while served.scheduler.busy_slots or served.scheduler.queue_length:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_too_many_choices_are_a_400_naming_n(base_url):
    for n in (CONFIG.slots + 1, 200):
        r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "n": n})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n"
