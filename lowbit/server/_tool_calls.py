"""Tool calls in a model's answer, in the formats the common chat templates teach.

* ``HERMES`` (Hermes 2 Pro, Qwen2.5, Qwen3 and this server's fallback prompt): one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the text.
* ``LLAMA3`` (Llama 3.1, 3.2): the answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several separated by ``;``).
* ``MISTRAL``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

``<|python_tag|>`` and ``[TOOL_CALLS]`` are control tokens that decoding usually drops, so an
answer that *starts* with the bare JSON (object, resp. array) counts as well. A call naming a
tool that was not offered, or whose arguments are not a JSON object, is not a call: its text
stays in the content. Pure functions and one small streaming state; nothing here knows HTTP.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_OPEN = "[TOOL_CALLS]"
_SEPARATORS = re.compile(r"[\s;]*")
MAX_ARGUMENTS_DEPTH = 64  # deeper arguments are not a call (and could not be re-serialized)


def json_depth(value: Any, cap: int) -> int:
    """How deeply `value` (parsed JSON) nests objects and arrays, counted up to `cap + 1`.

    Iterative: Python's parser takes nesting that a recursive walk, ``json.dumps`` or the
    schema validator could not (a `RecursionError`, or a native stack overflow).
    """
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > cap:
                return deepest
            todo.extend((v, depth) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


def tool_format(template: str) -> ToolFormat:
    """The call format a chat template teaches, by what its text mentions (Hermes when it
    mentions none: the fallback prompt teaches Hermes)."""
    if HERMES_OPEN in template:
        return ToolFormat.HERMES
    if MISTRAL_OPEN in template:
        return ToolFormat.MISTRAL
    if PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template):
        return ToolFormat.LLAMA3
    return ToolFormat.HERMES


@dataclasses.dataclass(frozen=True)
class Call:
    """A recognised call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: Mapping[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class Parsed:
    """An answer split into calls and content.

    Attributes:
      content: with calls, the text outside them (trailing whitespace dropped), or None when
        that is blank; without calls, the whole text.
      calls: the calls, in order.
    """

    content: str | None
    calls: tuple[Call, ...]


# accept(name, arguments): whether a call is to be returned (an offered tool, fitting args).
Accept = Callable[[str, Mapping[str, Any]], bool]
_Span = tuple[int, int, tuple[Call, ...]]  # text[start:end] holds these calls


def _call(value: Any, accept: Accept) -> Call | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict) or json_depth(arguments, MAX_ARGUMENTS_DEPTH) > (
        MAX_ARGUMENTS_DEPTH
    ):
        return None
    if not accept(value["name"], arguments):
        return None
    return Call(value["name"], arguments)


def _json_at(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value starting at `at` and the index after it, or None."""
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except (ValueError, RecursionError):
        return None


def _start(text: str) -> int:
    """Index of the first non-blank character (len(text) when blank)."""
    return len(text) - len(text.lstrip())


def _hermes(text: str, accept: Accept) -> list[_Span]:
    spans = []
    at = text.find(HERMES_OPEN)
    while at >= 0:
        close = text.find(HERMES_CLOSE, at)
        # A missing close tag at the very end (the model stopped right after the JSON) is kept.
        end = len(text) if close < 0 else close + len(HERMES_CLOSE)
        inner = text[at + len(HERMES_OPEN) : len(text) if close < 0 else close].strip()
        parsed = _json_at(inner, 0) if inner else None
        call = _call(parsed[0], accept) if parsed and parsed[1] == len(inner) else None
        if call is not None:
            spans.append((at, end, (call,)))
        at = text.find(HERMES_OPEN, end if call is not None or close >= 0 else at + 1)
    return spans


def _llama3(text: str, accept: Accept) -> list[_Span]:
    start = _start(text)
    tag = text.find(PYTHON_TAG)
    if tag >= 0 and not text[start:].startswith("{"):
        start = tag
    at = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
    calls, end = [], start
    while True:
        at = _SEPARATORS.match(text, at).end()
        parsed = _json_at(text, at) if text.startswith("{", at) else None
        call = _call(parsed[0], accept) if parsed else None
        if call is None:
            break
        calls.append(call)
        at = end = parsed[1]
    return [(start, end, tuple(calls))] if calls else []


def _mistral(text: str, accept: Accept) -> list[_Span]:
    start = _start(text)
    tag = text.find(MISTRAL_OPEN)
    if tag >= 0 and not text[start:].startswith("["):
        start = tag
    at = start + len(MISTRAL_OPEN) if text.startswith(MISTRAL_OPEN, start) else start
    at = _start(text[at:]) + at
    parsed = _json_at(text, at) if text.startswith("[", at) else None
    if not parsed or not isinstance(parsed[0], list) or not parsed[0]:
        return []
    calls = [_call(v, accept) for v in parsed[0]]
    if any(c is None for c in calls):  # one array is one answer: all its calls, or none
        return []
    return [(start, parsed[1], tuple(calls))]


_FIND = {ToolFormat.HERMES: _hermes, ToolFormat.LLAMA3: _llama3, ToolFormat.MISTRAL: _mistral}


def parse_tool_calls(
    text: str, fmt: ToolFormat, accept: Accept, limit: int | None = None
) -> Parsed:
    """Splits `text` (a whole answer) into tool calls and content.

    Args:
      text: the answer's text.
      fmt: the format the chat template teaches.
      accept: ``(name, arguments) -> bool``: whether a call is one to return (a tool that was
        offered, with arguments it accepts); a refused call stays text.
      limit: calls at most (``parallel_tool_calls: false`` is 1); a block of calls past it
        stays text.
    """
    kept: list[_Span] = []
    count = 0
    for span in _FIND[fmt](text, accept):
        if limit is not None and count + len(span[2]) > limit:
            break
        kept.append(span)
        count += len(span[2])
    if not kept:
        return Parsed(text, ())
    outside, at = [], 0
    for start, end, _ in kept:
        outside.append(text[at:start])
        at = end
    outside.append(text[at:])
    content = "".join(outside).rstrip()
    return Parsed(content or None, tuple(call for _, _, calls in kept for call in calls))


def _partial(text: str, opener: str) -> int:
    """Index where a tail of `text` that may grow into `opener` starts (len(text) if none)."""
    at = text.find(opener)
    if at >= 0:
        return at
    for n in range(min(len(opener) - 1, len(text)), 0, -1):
        if text.endswith(opener[:n]):
            return len(text) - n
    return len(text)


class ToolCallStream:
    """Releases an answer's text as it grows, holding back from where a call may begin.

    `add` returns the text that is safe to send as content now: everything before the first
    (possible) call opening, and never a trailing blank (it may turn out to precede a call, and
    the content of an answer with calls ends without one). `finish` parses the whole answer:
    what `add` released is always a head of its content, so streamed and whole answers agree.
    """

    def __init__(self, fmt: ToolFormat, accept: Accept, limit: int | None = None):
        self.fmt = fmt
        self.accept = accept
        self.limit = limit
        self.parts: list[str] = []  # the whole text, joined at the end
        self.tail = ""  # the text after what was released (short until an opening is seen)
        self.released = 0  # characters released
        self.opened = False  # a full opening was seen: nothing more is released

    def _hold(self) -> tuple[int, bool]:
        """Index in `tail` from which text is held back, and whether an opening starts there."""
        tail = self.tail
        if self.fmt is ToolFormat.HERMES:
            opener, bare = HERMES_OPEN, None
        elif self.fmt is ToolFormat.LLAMA3:
            opener, bare = PYTHON_TAG, "{"
        else:
            opener, bare = MISTRAL_OPEN, "["
        if bare is not None and self.released == 0:  # the answer may start with bare JSON
            first = _start(tail)
            rest = tail[first:]
            if rest.startswith(bare):
                return first, True
            if rest and opener.startswith(rest[: len(opener)]):
                return first, rest.startswith(opener)
        at = _partial(tail, opener)
        return at, tail.startswith(opener, at)

    def add(self, piece: str) -> str:
        """Adds `piece`; returns the content that is final now (maybe empty)."""
        self.parts.append(piece)
        if self.opened:
            return ""
        self.tail += piece
        hold, self.opened = self._hold()
        end = len(self.tail[:hold].rstrip())
        out, self.tail = self.tail[:end], self.tail[end:]
        self.released += end
        return out

    def finish(self) -> tuple[str, Parsed]:
        """The content not yet released, and the whole answer parsed."""
        text = "".join(self.parts)
        parsed = parse_tool_calls(text, self.fmt, self.accept, self.limit)
        whole = (parsed.content or "") if parsed.calls else text
        # `released` never passes the first opening nor ends in a blank: a head of `whole`.
        assert whole.startswith(text[: self.released])
        return whole[self.released :], parsed
