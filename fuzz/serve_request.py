"""Fuzzes the bodies `lowbit serve` reads (`lowbit.server`: `parse_body`, then
`parse_request` for ``/v1/completions`` and ``/v1/chat/completions``, and `parse_guidance` for
their ``response_format`` and ``logit_bias``).

Contract: an `APIError` with a 4xx status and a message (answered as an OpenAI error object),
or a request whose fields have the documented types and ranges.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

from fuzz._contract import ContractViolation, main

BODIES = (
    {"model": "m", "prompt": "The capital of France is", "max_tokens": 8},
    {
        "prompt": [1, 2, 3],
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 3,
        "stop": ["\n", "."],
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        "max_completion_tokens": 16,
        "n": 1,
        "logprobs": None,
    },
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"}},
    {
        "prompt": "x",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": True},
        },
        "logit_bias": {"5": -100, "7": 2.5},
    },
)


def seeds() -> Iterator[tuple[str, bytes]]:
    for i, body in enumerate(BODIES):
        yield f"body_{i}.json", json.dumps(body).encode()


def _load():
    global APIError, parse_body, parse_request, parse_guidance, MAX_LOGPROBS, MAX_N
    from lowbit.server._guidance import parse_guidance
    from lowbit.server._protocol import MAX_LOGPROBS, MAX_N, APIError, parse_body, parse_request


def _check(request) -> None:
    """A parsed request's fields are what the scheduler may rely on."""
    if request.max_tokens is not None and not (
        isinstance(request.max_tokens, int) and request.max_tokens >= 1
    ):
        raise ContractViolation(f"max_tokens {request.max_tokens!r}")
    if not (isinstance(request.temperature, float | int) and math.isfinite(request.temperature)):
        raise ContractViolation(f"temperature {request.temperature!r}")
    if request.temperature < 0 or not (0 < request.top_p <= 1):
        raise ContractViolation(f"temperature {request.temperature!r} / top_p {request.top_p!r}")
    if not all(isinstance(s, str) for s in request.stop):
        raise ContractViolation(f"stop {request.stop!r}")
    if not (type(request.n) is int and 1 <= request.n <= MAX_N):
        raise ContractViolation(f"n {request.n!r}")
    if request.logprobs is not None and not (
        type(request.logprobs) is int and 0 <= request.logprobs <= MAX_LOGPROBS
    ):
        raise ContractViolation(f"logprobs {request.logprobs!r}")
    for penalty in (request.presence_penalty, request.frequency_penalty):
        if not (type(penalty) is float and -2.0 <= penalty <= 2.0):
            raise ContractViolation(f"penalty {penalty!r}")


def test_one(data: bytes) -> None:
    for chat in (False, True):
        try:
            body = parse_body(data)
            _check(parse_request(body, chat))
            guidance = parse_guidance(body, 260)
            if not all(0 <= t < 260 and -100 <= b <= 100 for t, b in guidance.logit_bias):
                raise ContractViolation(f"logit_bias {guidance.logit_bias!r}")
        except APIError as err:
            if not (400 <= err.status < 500 and err.message):
                raise ContractViolation(f"APIError {err.status} {err.message!r}") from err


if __name__ == "__main__":
    main(test_one, _load)
