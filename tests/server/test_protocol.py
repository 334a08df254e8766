"""Request validation: every bad field gets a 400 naming it."""

import pytest

from lowbit.server import APIError, parse_request
from lowbit.server._protocol import MAX_LOGPROBS, MAX_N, parse_body


def test_a_valid_completion_parses_with_openai_defaults():
    req = parse_request({"prompt": "hi", "max_tokens": 5, "stop": "x", "seed": -1}, chat=False)
    assert req.prompt == "hi" and req.max_tokens == 5 and req.stop == ("x",)
    assert req.temperature == 1.0 and req.top_p == 1.0 and req.top_k == 0
    assert req.seed == 2**32 - 1 and not req.stream


def test_token_prompts_and_chat_messages_parse():
    assert parse_request({"prompt": [1, 2, 3]}, chat=False).prompt == (1, 2, 3)
    req = parse_request(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, chat=True
    )
    assert req.messages == ({"role": "user", "content": "hi"},)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": MAX_N + 1}, "n"),
        ({"prompt": "hi", "n": "2"}, "n"),
        ({"prompt": "hi", "n": 2.0}, "n"),
        ({"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"prompt": "hi", "logprobs": -1}, "logprobs"),
        ({"prompt": "hi", "logprobs": True}, "logprobs"),
        ({"prompt": "hi", "top_logprobs": 2}, "top_logprobs"),  # a chat field
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "presence_penalty": "high"}, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -2.01}, "frequency_penalty"),
        ({"prompt": "hi", "frequency_penalty": True}, "frequency_penalty"),
        ({"prompt": "hi", "temperature": 3}, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_k": -1}, "top_k"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
        ({"prompt": "hi", "colour": "red"}, "colour"),
        # Neutral values compare by JSON type: 0.0 is not false, true is not 1.
        ({"prompt": "hi", "logprobs": 0.0}, "logprobs"),
        ({"prompt": "hi", "echo": 0}, "echo"),
        ({"prompt": "hi", "best_of": True}, "best_of"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({}, "prompt"),
        # JSON may escape a lone surrogate; it is no text (the tokenizer raised: a 500).
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"prompt": "hi", "stop": ["ok", "\udfff"]}, "stop"),
    ],
)
def test_bad_completion_fields_name_the_field(body, param):
    with pytest.raises(APIError) as err:
        parse_request(body, chat=False)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.body()["error"]["message"].startswith(param)


def test_choices_logprobs_and_penalties_parse():
    req = parse_request(
        {"prompt": "hi", "n": 3, "logprobs": 0, "presence_penalty": -2, "frequency_penalty": 2},
        chat=False,
    )
    assert (req.n, req.logprobs, req.presence_penalty, req.frequency_penalty) == (3, 0, -2, 2)
    req = parse_request({"prompt": "hi", "logprobs": False, "presence_penalty": None}, False)
    assert (req.n, req.logprobs, req.presence_penalty) == (1, None, 0.0)
    chat = {"messages": [{"role": "user", "content": "a"}]}
    assert parse_request({**chat, "logprobs": True}, True).logprobs == 0
    assert parse_request({**chat, "logprobs": True, "top_logprobs": 20}, True).logprobs == 20
    assert parse_request({**chat, "logprobs": False}, True).logprobs is None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"n": 0}, "n"),
        ({"presence_penalty": -3}, "presence_penalty"),
    ],
)
def test_bad_chat_logprobs_choices_and_penalties_name_the_field(fields, param):
    body = {"messages": [{"role": "user", "content": "a"}], **fields}
    with pytest.raises(APIError) as err:
        parse_request(body, chat=True)
    assert err.value.status == 400 and err.value.param == param


def test_bad_chat_messages_name_the_message():
    with pytest.raises(APIError, match=r"messages\[1\]\.role"):
        parse_request({"messages": [{"role": "user", "content": "a"}, {"role": "bot"}]}, True)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "\ud834"}]
    with pytest.raises(APIError, match=r"messages\[0\]\.content: holds a lone surrogate"):
        parse_request({"messages": [{"role": "user", "content": parts}]}, True)


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"\xff"])
def test_a_body_that_is_not_a_json_object_is_refused(raw):
    with pytest.raises(APIError, match="JSON") as err:
        parse_body(raw)
    assert err.value.status == 400


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"[" * 100_000, "nested too deeply"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "4300 digits"),
        (b'{"prompt": "a", "prompt": "b"}', "appears twice"),
        (b"\xff\xfe{", "not UTF-8"),
        # Python's parser takes UTF-16 and UTF-32 bytes; a request body is UTF-8 only.
        ('{"prompt": "hi"}'.encode("utf-16"), "not UTF-8"),
        ('{"prompt": "hi"}'.encode("utf-32-le"), "not valid JSON"),  # NULs are UTF-8
    ],
    ids=["deep", "long-int", "duplicate-key", "not-utf8", "utf-16", "utf-32"],
)
def test_hostile_bodies_are_a_400_not_a_crash(raw, why):
    # Found by fuzz/serve_request.py's contract: each was a RecursionError or a bare ValueError
    # (a 500), or a key silently dropped.
    with pytest.raises(APIError, match=why) as err:
        parse_body(raw)
    assert err.value.status == 400
