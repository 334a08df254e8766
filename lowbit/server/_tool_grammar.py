"""The grammar of an answer that must be tool calls (``tool_choice: "required"`` or a named
function): a Lark grammar for llguidance in which each call is written in the format the chat
template teaches (the one `lowbit.server._tool_calls` parses back) and its arguments are JSON
matching the tool's ``parameters`` schema (embedded with llguidance's ``%json``).

* ``HERMES``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, one per
  line.
* ``LLAMA3``: ``{"name": ..., "parameters": {...}}`` objects separated by ``; `` (without the
  ``<|python_tag|>`` control token: the parser takes the bare JSON).
* ``MISTRAL``: one ``[{"name": ..., "arguments": {...}}, ...]`` array (without the
  ``[TOOL_CALLS]`` control token, likewise).

Pure functions of the request; `schema_problem` asks llguidance (without a tokenizer, in
milliseconds) which offered schema it cannot compile, so that a 400 names that tool.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from lowbit.server._grammar import LIMITS
from lowbit.server._tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolFormat
from lowbit.server._tool_request import Tool, ToolRequest

# Compact JSON with the usual spaces (as `lowbit.server._grammar`'s): no free whitespace, so a
# model cannot spin on blanks inside valid arguments, and the parser reads what it expects.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# format -> (text before a call's JSON, the key of its arguments, text after, between calls,
# text around the whole answer)
_SHAPES = {
    ToolFormat.HERMES: (f"{HERMES_OPEN}\n", "arguments", f"\n{HERMES_CLOSE}", "\n", ("", "")),
    ToolFormat.LLAMA3: ("", "parameters", "", "; ", ("", "")),
    ToolFormat.MISTRAL: ("", "arguments", "", ", ", ("[", "]")),
}


def _lark(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The schema of `tool`'s arguments, with the JSON layout options llguidance reads from
    ``x-guidance``. A tool without ``parameters`` takes none (OpenAI's reading): ``{}``."""
    schema = dict(tool.parameters) if tool.parameters is not None else dict(NO_ARGUMENTS)
    schema["x-guidance"] = _JSON_OPTIONS
    return schema


def _call_rule(tool: Tool, fmt: ToolFormat) -> str:
    before, key, after, _, _ = _SHAPES[fmt]
    head = f'{before}{{"name": {json.dumps(tool.name)}, "{key}": '
    schema = json.dumps(arguments_schema(tool), ensure_ascii=False, separators=(",", ":"))
    return f"{_lark(head)} %json {schema} {_lark('}' + after)}"


def tool_grammar(tools: ToolRequest, fmt: ToolFormat) -> str:
    """The Lark grammar of a forced answer: one call of one of ``tools.callable`` (several,
    in the format's separator, when ``tools.parallel`` and no function is named)."""
    _, _, _, between, (start, end) = _SHAPES[fmt]
    rules = [f"call_{i}: {_call_rule(t, fmt)}" for i, t in enumerate(tools.callable)]
    calls = " | ".join(f"call_{i}" for i in range(len(rules)))
    many = tools.parallel and tools.function is None
    body = f"call ({_lark(between)} call)*" if many else "call"
    head = " ".join(part for part in (_lark(start) if start else "", body) if part)
    tail = f" {_lark(end)}" if end else ""
    return "\n".join([f"start: {head}{tail}", f"call: {calls}", *rules]) + "\n"


def schema_problem(tools: ToolRequest) -> tuple[str, str] | None:
    """``(param, message)`` for the first callable tool whose ``parameters`` llguidance cannot
    compile (a regex feature it lacks, a size past `LIMITS`), or None when all compile."""
    limits = llguidance.LLParserLimits(**LIMITS)
    for i, tool in enumerate(tools.tools):
        if tool not in tools.callable:
            continue
        lark = f"start: %json {json.dumps(arguments_schema(tool), ensure_ascii=False)}\n"
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, limits=limits
            )
        except ValueError as err:
            failed, messages = True, [str(err)]
        if failed:
            # llguidance's message: "at 1(8): <what>\n<details>\n   1 | <the grammar line>"
            text = messages[0] if messages else "cannot be compiled"
            text = text.split("\n   1 |", 1)[0].split(": ", 1)[-1]
            return f"tools[{i}].function.parameters", " ".join(text.split())
    return None
