"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, and the tool parts
of its messages (an assistant's ``tool_calls``, ``role: "tool"`` answers), validated.

Pure: every problem is a `ToolError` naming the request field at fault (``tools[2].function.
parameters``), which `parse_request` answers as a 400. Sizes are bounded (tools per request,
schema depth and length) so that a request cannot make validation or the prompt arbitrarily
costly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping
from typing import Any

import jsonschema_rs

from lowbit.server._tool_calls import json_depth

MAX_TOOLS = 128  # OpenAI's own limit
MAX_SCHEMA_DEPTH = 32  # nesting of a tool's parameters schema (objects and arrays)
MAX_SCHEMA_CHARS = 32_768  # a tool's parameters schema as compact JSON
MAX_NESTING = 64  # any other tool value (a tool, a message's tool_calls or arguments)
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The meta-schemas the validator knows: any other ``$schema`` would make it fetch a URL.
_DRAFTS = {
    f"{scheme}://json-schema.org/{draft}{tail}"
    for scheme in ("http", "https")
    for draft in ("draft-04/schema", "draft-06/schema", "draft-07/schema")
    for tail in ("", "#")
} | {
    f"https://json-schema.org/draft/{draft}/schema{tail}"
    for draft in ("2019-09", "2020-12")
    for tail in ("", "#")
}
_CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A malformed tool field; `param` is its path in the request."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclasses.dataclass(frozen=True)
class Tool:
    """One offered function.

    Attributes:
      name: matches ``[a-zA-Z0-9_-]{1,64}``, unique in the request.
      definition: the request's ``{"type": "function", "function": {...}}`` object, as the chat
        template sees it (Hugging Face's ``tools`` entries).
      strict: arguments must satisfy ``parameters``: calls whose arguments do not are not
        returned as calls.
    """

    name: str
    definition: Mapping[str, Any]
    strict: bool

    @property
    def parameters(self) -> Mapping[str, Any] | None:
        return self.definition["function"].get("parameters")


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers and how the model may use them.

    Attributes:
      tools: the offered functions, in request order (never empty).
      choice: ``"none"`` (the tools are not shown to the model and answers are not parsed for
        calls), ``"auto"`` (shown, and calls in the answer are returned as ``tool_calls``),
        ``"required"`` (the answer is decoded under a grammar that admits only calls) or
        ``"function"`` (likewise, exactly one call of `function`).
      parallel: several calls per answer; False: the first call only (later ones stay text).
      function: the tool a named ``tool_choice`` names (choice ``"function"``), else None.
    """

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool
    function: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the answer must be calls (``required`` or a named function)."""
        return self.choice in ("required", "function")

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools an answer may call: the named one, or all offered."""
        return tuple(t for t in self.tools if self.function in (None, t.name))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def accepts(self, name: str, arguments: Mapping[str, Any]) -> bool:
        """Whether a call of `name` with `arguments` is one to return: an offered tool, and
        arguments that satisfy its schema when it is strict."""
        tool = next((t for t in self.callable if t.name == name), None)
        return tool is not None and arguments_fit(tool, arguments)

    @property
    def definitions(self) -> list[dict[str, Any]]:
        """The ``tools`` list a chat template renders."""
        return [json.loads(json.dumps(t.definition)) for t in self.tools]


def _schemas(value: Any):
    """Every object in `value` (each may be a subschema holding ``$schema``)."""
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _schemas(v)
    elif isinstance(value, list):
        for v in value:
            yield from _schemas(v)


def _parameters(param: str, schema: Any, strict: bool) -> None:

    if not isinstance(schema, dict):
        raise ToolError(param, f"must be a JSON Schema object, got {json.dumps(schema)[:80]}")
    if json_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ToolError(param, f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_CHARS:
        raise ToolError(param, f"is {size} characters as JSON; at most {MAX_SCHEMA_CHARS}")
    for sub in _schemas(schema):
        uri = sub.get("$schema")
        if uri is not None and uri not in _DRAFTS:
            raise ToolError(
                param,
                f"names the meta-schema {json.dumps(uri)[:120]}; only JSON Schema drafts 4, 6, "
                "7, 2019-09 and 2020-12 are known (or leave $schema out)",
            )
    try:
        jsonschema_rs.meta.validate(schema)
        if strict:  # compiled now: a bad regex or a dangling $ref is the request's fault
            _validator(schema)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as err:
        first = str(err).split("\n", 1)[0]
        raise ToolError(param, f"is not a valid JSON Schema: {first}") from None


def _validator(schema: Mapping[str, Any]):
    """`schema` compiled offline (no ``$ref`` is fetched), with a linear-time regex engine (a
    ``pattern`` cannot backtrack for ever on a model's output)."""
    return _compiled(json.dumps(schema, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _compiled(schema: str):

    return jsonschema_rs.validator_for(
        json.loads(schema), offline=True, pattern_options=jsonschema_rs.RegexOptions()
    )


def _unicode(param: str, value: Any) -> None:
    """Refuses a lone surrogate anywhere in `value` (JSON may escape one; the tokenizer cannot
    encode it into the prompt), and nesting past what the prompt's JSON can be written with."""
    if json_depth(value, MAX_NESTING) > MAX_NESTING:
        raise ToolError(param, f"nests deeper than {MAX_NESTING} levels")
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError(param, "holds a lone surrogate (e.g. \\ud800); send Unicode text") from None


def arguments_fit(tool: Tool, arguments: Mapping[str, Any]) -> bool:
    """Whether `arguments` satisfy a strict tool's ``parameters`` (always True otherwise)."""
    if not tool.strict or tool.parameters is None:
        return True
    return _validator(tool.parameters).is_valid(dict(arguments))


def _tool(i: int, value: Any) -> Tool:
    param = f"tools[{i}]"
    _unicode(param, value)
    if not isinstance(value, dict) or value.get("type") != "function":
        raise ToolError(
            f"{param}.type", 'each tool must be {"type": "function", "function": {...}}'
        )
    if set(value) - {"type", "function"}:
        extra = sorted(set(value) - {"type", "function"})[0]
        raise ToolError(f"{param}.{extra}", "is not a field of a tool")
    function = value.get("function")
    if not isinstance(function, dict):
        raise ToolError(
            f"{param}.function", "must be an object with name (and description, parameters)"
        )
    extra = set(function) - {"name", "description", "parameters", "strict"}
    if extra:
        raise ToolError(f"{param}.function.{sorted(extra)[0]}", "is not a field of a function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(
            f"{param}.function.name",
            f"must match [a-zA-Z0-9_-]{{1,64}}, got {json.dumps(name)[:80]}",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{param}.function.description", "must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{param}.function.strict", "must be true, false or null")
    if function.get("parameters") is not None:
        _parameters(f"{param}.function.parameters", function["parameters"], bool(strict))
    # The template sees only what was given, nulls dropped (HF templates test for presence).
    clean = {k: v for k, v in function.items() if v is not None and k != "strict"}
    return Tool(name=name, definition={"type": "function", "function": clean}, strict=bool(strict))


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The request's tools, or None when it offers none (``tools`` absent, null or empty).

    Raises:
      ToolError: for a malformed tool, duplicate names, or a ``tool_choice`` naming no offered
        tool (or ``required`` without tools).
    """
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "must be true, false or null")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolError("tools", "must be a list of function tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"holds {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools))
    seen: set[str] = set()
    for i, t in enumerate(parsed):
        if t.name in seen:
            raise ToolError(f"tools[{i}].function.name", f"{t.name!r} is given twice")
        seen.add(t.name)
    if choice is None:
        choice = "auto"
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError(
                "tool_choice",
                'must be none, auto, required or {"type": "function", "function": {"name": ...}}',
            )
        if name not in seen:
            raise ToolError("tool_choice", f"names {name!r}, which is not among the tools")
        choice = "function"
    elif choice not in _CHOICES:
        raise ToolError(
            "tool_choice",
            f"must be none, auto, required or a function, got {json.dumps(choice)[:80]}",
        )
    if choice == "required" and not parsed:
        raise ToolError("tool_choice", "is required but no tools are given")
    if not parsed:
        return None
    return ToolRequest(tools=parsed, choice=choice, parallel=parallel is not False, function=name)


def _arguments(param: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, str):
        raise ToolError(param, "must be a string holding a JSON object")
    try:
        arguments = json.loads(value)
    except (ValueError, RecursionError):
        raise ToolError(
            param, "is not valid JSON; send the arguments as a JSON object string"
        ) from None
    if not isinstance(arguments, dict):
        raise ToolError(param, "must hold a JSON object")
    if json_depth(arguments, MAX_NESTING) > MAX_NESTING:
        raise ToolError(param, f"nests deeper than {MAX_NESTING} levels")
    return arguments


def tool_calls_message(index: int, message: Mapping[str, Any], content: str) -> dict[str, Any]:
    """An assistant message with ``tool_calls``, as chat templates take it: each call's
    ``arguments`` a dict (Hugging Face's convention), ``content`` a string ("" for null)."""
    param = f"messages[{index}].tool_calls"
    _unicode(param, message.get("tool_calls"))
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        raise ToolError(param, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{param}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ToolError(
                at, 'must be {"id", "type": "function", "function": {"name", "arguments"}}'
            )
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f"{at}.function", "must be an object with name and arguments")
        call_id = call.get("id")
        if not isinstance(call_id, str):
            raise ToolError(f"{at}.id", "must be a string")
        arguments = _arguments(f"{at}.function.arguments", function.get("arguments"))
        out.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return {"role": "assistant", "content": content, "tool_calls": out}


def tool_message(index: int, message: Mapping[str, Any], content: str) -> dict[str, Any]:
    """A ``role: "tool"`` message (a function's result) as chat templates take it."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise ToolError(
            f"messages[{index}].tool_call_id", "is required: the id of the call answered"
        )
    _unicode(f"messages[{index}]", {k: message.get(k) for k in ("tool_call_id", "name")})
    out = {"role": "tool", "tool_call_id": call_id, "content": content}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out
