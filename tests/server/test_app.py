"""The HTTP API with real clients: the official `openai` package for completions and chat
(streamed and not), httpx for bad input, auth and a full queue."""

import concurrent.futures
import dataclasses

import httpx
import openai
import pytest
from server_support import CONFIG, running, served_model

from lowbit.models import Sampling, generate_tokens


def _client(base_url, key="unused"):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)


GREEDY = Sampling()


def _reference(loaded, served, prompt, n, sampling=GREEDY, seed=0):
    return generate_tokens(
        loaded.model,
        [prompt],
        max_new_tokens=n,
        sampling=sampling,
        key=seed,
        stop_ids=sorted(served.stop_ids),
    ).tokens[0]


def test_completion_matches_generate_token_for_token(base_url, loaded, served):
    prompt = loaded.tokenizer.encode("The quick brown fox").ids
    out = _client(base_url).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 30, "return_token_ids": True},
    )
    choice = out.choices[0]
    expected = _reference(loaded, served, prompt, 12, Sampling(0.8, 30, 0.9), seed=7)
    assert choice.model_extra["token_ids"] == expected
    assert choice.text == loaded.tokenizer.decode(expected, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == len(expected)
    assert out.usage.total_tokens == len(prompt) + len(expected)
    assert choice.finish_reason in ("length", "stop")


def test_streamed_completion_text_equals_the_whole_answer(base_url):
    client = _client(base_url)
    args = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_chat_uses_the_template_streamed_and_not(base_url, loaded, served):
    client = _client(base_url)
    messages = [{"role": "user", "content": "hello"}]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    prompt = loaded.tokenizer.encode("user: hello\nassistant:").ids
    assert out.usage.prompt_tokens == len(prompt)
    assert out.choices[0].model_extra["token_ids"] == _reference(loaded, served, prompt, 8)
    assert out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == out.choices[0].message.content


def test_models_health_and_metrics(base_url):
    assert [m.id for m in _client(base_url).models.list().data] == ["tiny"]
    health = httpx.get(f"{base_url}/health").json()
    # What the background thread has left to compile (0 once it is done).
    assert health["status"] == "ok" and health.keys() == {"status", "compiling"}
    assert isinstance(health["compiling"], int) and health["compiling"] >= 0
    text = httpx.get(f"{base_url}/metrics").text
    for name in (
        "lowbit_programs_compiling",
        "lowbit_requests_total",
        "lowbit_generated_tokens_total",
        "lowbit_queue_length",
        "lowbit_batch_occupancy",
        "lowbit_time_to_first_token_seconds_bucket",
        "lowbit_time_per_output_token_seconds_bucket",
    ):
        assert name in text


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b'{"prompt": "hi",', None),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "n": CONFIG.slots + 1}, "n"),
        ("/v1/completions", {"prompt": [5] * (CONFIG.max_len + 10)}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": CONFIG.max_len + 1}, "max_tokens"),
        ("/v1/completions", {"prompt": [9999]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        # max_completion_tokens overrides it, but a max_tokens past the context is still bad.
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": CONFIG.max_len + 1,
                "max_completion_tokens": 1,
            },
            "max_tokens",
        ),
        # A lone surrogate, escaped as JSON allows: not text the tokenizer encodes (was a 500).
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            "messages[0].content",
        ),
    ],
)
def test_bad_input_gets_a_400_error_object(base_url, path, body, param):
    # How fast (the target is 100 ms) is measured outside the tests (closing note of the serve
    # issue), not asserted here.
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{base_url}{path}", **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_an_api_key_guards_everything_but_health(served, base_url):
    guarded = dataclasses.replace(served, api_key="s3cret")
    with running(guarded, start=False) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 401
        out = _client(url, key="s3cret").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens >= 1


def test_a_full_queue_answers_429_with_retry_after(loaded):
    served = served_model(loaded, dataclasses.replace(CONFIG, queue=1))
    with running(served) as url:
        body = {"prompt": [7, 8, 9], "max_tokens": 120, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            responses = list(
                pool.map(
                    lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=60), range(12)
                )
            )
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    busy = [r for r in responses if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" for r in busy)
    assert all(r.json()["error"]["type"] == "rate_limit_error" for r in busy)
    answers = {tuple(r.json()["choices"][0]["text"]) for r in responses if r.status_code == 200}
    assert len(answers) == 1  # the same greedy answer for every accepted request
