"""The OpenAI request bodies the server accepts, validated into `CompletionRequest`, and the
OpenAI-style error objects it answers bad input with.

Every check names the field and says what it accepts: an `APIError` becomes
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from lowbit._untrusted import load_json
from lowbit.server._tool_request import (
    ToolError,
    ToolRequest,
    parse_tools,
    tool_calls_message,
    tool_message,
)

# Fields the server reads; others OpenAI defines are accepted and ignored when they hold
# their default (or null), refused otherwise (see `_UNSUPPORTED`).
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    "return_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "response_format",  # both read by `lowbit.server._guidance`
    "logit_bias",
}
_COMPLETION = _COMMON | {"prompt", "echo", "logprobs", "suffix", "best_of"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_CHAT |= {"tools", "tool_choice", "parallel_tool_calls"}
# Fields a request may carry only with these neutral values.
NEUTRAL_FIELDS = {
    "echo": (False,),
    "suffix": (None,),
    "best_of": (None, 1),
}
MAX_STOP_STRINGS = 4
# The most alternatives per token `logprobs` (completions) or `top_logprobs` (chat) may ask for
# (OpenAI: 20 for chat, 5 for the legacy completions).
MAX_LOGPROBS = 20
# The most choices one request may ask for (the server also limits `n` to its slots).
MAX_N = 128


def _is_neutral(value: Any, neutral: tuple) -> bool:
    """Whether `value` is one of `neutral`, by JSON type too: Python's ``0.0 == False`` and
    ``True == 1`` would let ``"logprobs": 0.0`` or ``"best_of": true`` through."""
    return any(type(value) is type(n) and value == n for n in neutral)


class APIError(Exception):
    """An error answered as an OpenAI error object.

    Attributes:
      status: the HTTP status.
      message: what was wrong and how to fix it.
      type: ``invalid_request_error``, ``authentication_error``, ``rate_limit_error``, ...
      param: the request field at fault, or None.
      code: a short machine-readable code, or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    """A 400 for field `param`."""
    return APIError(400, f"{param}: {message}", param=param, code=code)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A validated completion or chat request.

    Attributes:
      chat: True for ``/v1/chat/completions`` (`messages` set), False for ``/v1/completions``
        (`prompt` set).
      prompt: the prompt text, or its token ids.
      messages: the chat messages (role/content dicts; an assistant's may hold ``tool_calls``,
        a ``tool`` message its ``tool_call_id``), as chat templates take them.
      max_tokens: new tokens at most, or None for the rest of the context.
      temperature, top_p, top_k: sampling (top_k 0: all tokens).
      seed: the PRNG seed, or None (then a random one).
      stop: strings that end the answer (not included).
      stream: answer with server-sent events.
      include_usage: with `stream`, a last chunk carrying the usage counts.
      return_token_ids: add each choice's token ids (``token_ids``) to the answer.
      tools: the offered tools and ``tool_choice``, or None.
      n: choices; choice i draws with seed ``seed + i``.
      logprobs: alternatives per token to report with each token's log-probability, or None
        for no log-probabilities (completions' ``logprobs``; chat's ``top_logprobs`` when
        ``logprobs`` is true).
      presence_penalty, frequency_penalty: in [-2, 2], subtracted from the logits of tokens
        the answer already holds (once, and once per occurrence).
    """

    chat: bool
    prompt: str | tuple[int, ...] | None
    messages: tuple[dict[str, Any], ...]
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    tools: ToolRequest | None = None
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in a request body.

    Raises:
      APIError: for a body that is not a UTF-8 JSON object.
    """
    try:
        # UTF-8 only (a byte-order mark is ignored): Python's parser would also take UTF-16
        # and UTF-32 bytes, which JSON exchanged between systems must not be (RFC 8259).
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise APIError(
            400, f"the request body is not UTF-8 ({err}); send one JSON object", code="invalid_json"
        ) from None
    try:
        # Bounded like every untrusted JSON: deep nesting, 5,000-digit integers and duplicate
        # keys are a 400, never a RecursionError (a 500) or a key silently dropped.
        body = load_json(text, "the request body")
    except ValueError as err:
        raise APIError(400, f"{err}; send one JSON object", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {json.dumps(value)}")
    if value < lo or (hi is not None and value > hi):
        limit = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise bad(name, f"must be {limit}, got {value}")
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(name, f"must be a number, got {json.dumps(value)}")
    if value > hi or value < lo or (lo_open and value == lo):
        interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad(name, f"must be in {interval}, got {value}")
    return float(value)


def unicode_text(name: str, value: str) -> str:
    """`value`, refused (a 400 naming `name`) when it is not Unicode text: JSON may escape a
    lone surrogate (``"\\ud800"``), which has no UTF-8 form and which the tokenizer refuses."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        at = err.start
        raise bad(
            name,
            f"holds a lone surrogate (\\u{ord(value[at]):04x}) at index {at}; send Unicode text",
        ) from None
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    return tuple(unicode_text("stop", s) for s in stop)


def _prompt(body: dict) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "is empty; give the text to continue")
        return unicode_text("prompt", prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return tuple(prompt)
    if prompt is None:
        raise bad("prompt", "is required", code="missing_field")
    raise bad(
        "prompt",
        "must be a non-empty string or a non-empty list of token ids (one prompt per request)",
    )


def _messages(body: dict) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "is required", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(name, "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad(
                f"{name}.role", f"must be system, user, assistant, developer or tool, got {role!r}"
            )
        calls = role == "assistant" and m.get("tool_calls") is not None
        if calls and content is None:  # an assistant's turn of calls only
            content = ""
        if isinstance(content, list):  # content parts: text only
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(f"{name}.content", "only text content parts are supported")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"{name}.content", "must be a string")
        unicode_text(f"{name}.content", content)
        try:
            if calls:
                out.append(tool_calls_message(i, m, content))
                continue
            if role == "tool":
                out.append(tool_message(i, m, content))
                continue
        except ToolError as err:
            raise bad(err.param, str(err)) from None
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token to report, or None when log-probabilities are not asked for."""
    if not chat:  # completions: logprobs is the number of alternatives
        if body.get("logprobs") is False:
            return None
        return _int(body, "logprobs", 0, MAX_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad("logprobs", f"must be true or false, got {json.dumps(wanted)}")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not wanted:
        if top is not None:
            raise bad("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def parse_request(body: dict[str, Any], chat: bool) -> CompletionRequest:
    """Validates a ``/v1/completions`` (`chat` False) or ``/v1/chat/completions`` body.

    Raises:
      APIError: 400 naming the field for anything malformed or unsupported.
    """
    known = _CHAT if chat else _COMPLETION
    for name, value in body.items():
        if name in known and name not in NEUTRAL_FIELDS:
            continue
        if name in NEUTRAL_FIELDS:
            if not _is_neutral(value, NEUTRAL_FIELDS[name]):
                raise bad(
                    name,
                    f"is not supported by this server (got {json.dumps(value)})",
                    code="unsupported",
                )
            continue
        raise bad(name, "is not a field this endpoint accepts", code="unknown_field")
    n = _int(body, "n", 1, MAX_N) or 1
    max_tokens = _int(body, "max_tokens", 1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", 1)
    # The sampler holds k in int32; any k past the vocabulary keeps every token, so a larger
    # one means the same (unclamped, 2**32 crashed the scheduler thread: every request lost).
    top_k = min(_int(body, "top_k", 0) or 0, 2**31 - 1)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise bad("seed", f"must be an integer, got {json.dumps(seed)}")
        seed %= 2**32  # negative and large seeds fold into jax.random.key's range
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"must be true or false, got {json.dumps(stream)}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", "may only hold include_usage")
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool):
        raise bad("return_token_ids", "must be true or false")
    if not chat and body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("model", "must be a string")
    try:
        tools = parse_tools(body) if chat else None
    except ToolError as err:
        raise bad(err.param, str(err), err.code) from None
    return CompletionRequest(
        chat=chat,
        prompt=None if chat else _prompt(body),
        messages=_messages(body) if chat else (),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0, lo_open=False),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        seed=seed,
        stop=_stop(body),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        return_token_ids=return_ids,
        tools=tools,
        n=n,
        logprobs=_logprobs(body, chat),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0, lo_open=False),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0, lo_open=False),
    )
