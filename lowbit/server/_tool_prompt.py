"""A chat prompt with tools: through the model's own template when it renders ``tools``, else
through a fallback that teaches the Hermes ``<tool_call>`` format in the system prompt.

A template that reads ``tools`` (Qwen2.5, Qwen3, Hermes 2 Pro, Llama 3.1, Mistral, ...) gets
what Hugging Face's ``apply_chat_template(messages, tools=...)`` passes: the list of
``{"type": "function", "function": {...}}`` dicts, and messages whose ``tool_calls`` carry their
``arguments`` as dicts. A template that does not would silently drop the tools, so the tools are
listed in a system-prompt section instead (the wording Qwen2.5's template uses), earlier calls
are written back as ``<tool_call>`` blocks in the assistant's text and tool results become user
turns of ``<tool_response>`` blocks: only roles and text such a template already handles.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lowbit.server._tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    ToolCallStream,
    ToolFormat,
    tool_format,
)
from lowbit.server._tool_request import ToolRequest

FALLBACK_SYSTEM = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def takes_tools(chat_template: Callable[..., str]) -> bool:
    """Whether `chat_template` (a `ChatTemplate`) renders a ``tools`` list itself."""
    return bool(getattr(chat_template, "takes_tools", False))


def answer_format(chat_template: Callable[..., str]) -> ToolFormat:
    """The call format the prompt teaches: the template's own, or the fallback's (Hermes)."""
    if not takes_tools(chat_template):
        return ToolFormat.HERMES
    return tool_format(getattr(chat_template, "template", ""))


def _call_text(call: Mapping[str, Any]) -> str:
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]})
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], tools: ToolRequest | None
) -> list[dict[str, Any]]:
    """`messages` in roles and text only (system, user, assistant), the tools (if shown)
    listed in the system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        elif m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            text = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": "assistant", "content": text})
        else:
            out.append(dict(m))
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools is not None:
        lines = "\n".join(json.dumps(d, ensure_ascii=False) for d in tools.definitions)
        section = FALLBACK_SYSTEM.format(tools=lines)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def chat_prompt(
    chat_template: Callable[..., str],
    messages: Sequence[Mapping[str, Any]],
    tools: ToolRequest | None,
) -> str:
    """The prompt text for `messages` with `tools` (None, or ``tool_choice: "none"``: no
    tools are shown).

    Raises:
      ValueError: when the template fails or refuses the messages.
    """
    shown = tools if tools is not None and tools.choice != "none" else None
    if takes_tools(chat_template):
        variables = {"tools": shown.definitions} if shown is not None else {}
        return chat_template([dict(m) for m in messages], **variables)
    return chat_template(fallback_messages(messages, shown))


def tool_call_stream(
    chat_template: Callable[..., str], tools: ToolRequest | None
) -> ToolCallStream | None:
    """The parser of an answer's calls (auto, required or a named function: the same parser
    reads what the grammar of forced calls writes), or None when calls are not parsed (no
    tools, or ``tool_choice: "none"``)."""
    if tools is None or tools.choice == "none":
        return None
    limit = None if tools.parallel else 1
    return ToolCallStream(answer_format(chat_template), tools.accepts, limit)
