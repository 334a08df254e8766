"""Tools on ``/v1/chat/completions`` (the call parser itself: `test_tool_calls`): request
validation, prompts through a Hermes-style template and through the fallback, and end to end
with the official `openai` client (a scripted tokenizer makes the tiny random model "say" a
call). ``tool_choice`` required and a named function: the grammar of calls in each format
against the parser, and the tiny model's sampled and greedy answers (streamed and not) always
calls of offered tools whose arguments fit the schema."""

import contextlib
import dataclasses
import json

import httpx
import openai
import pytest
from server_support import running

from lowbit.models._chat_template import ChatTemplate
from lowbit.server._protocol import APIError, parse_request
from lowbit.server._tool_calls import ToolFormat, parse_tool_calls
from lowbit.server._tool_prompt import FALLBACK_SYSTEM, chat_prompt

H, L, M = ToolFormat.HERMES, ToolFormat.LLAMA3, ToolFormat.MISTRAL
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {}}'

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def _chat(**fields):
    return parse_request({"messages": HISTORY, **fields}, chat=True)


def _param_of(**fields):
    with pytest.raises(APIError) as err:
        _chat(**fields)
    assert err.value.status == 400
    return err.value.param


def _with_function(**function):
    return [{"type": "function", "function": {"name": "f", **function}}]


def _nested(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER_TOOL, {"type": "function"}]}, "tools[1].function"),
        ({"tools": _with_function(name="has space")}, "tools[0].function.name"),
        ({"tools": _with_function(name="x" * 65)}, "tools[0].function.name"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
        ({"tools": _with_function(parameters={"type": "strng"})}, "tools[0].function.parameters"),
        ({"tools": _with_function(parameters=[1])}, "tools[0].function.parameters"),
        (
            {"tools": _with_function(parameters={"$schema": "http://example.com/meta"})},
            "tools[0].function.parameters",
        ),
        (
            {"tools": _with_function(strict=True, parameters={"type": "string", "pattern": "(("})},
            "tools[0].function.parameters",
        ),
        ({"tools": _with_function(parameters=_nested(40))}, "tools[0].function.parameters"),
        # Deeper than any recursive walk (or json.dumps) could go: still a 400, never a 500.
        ({"tools": _with_function(parameters=_nested(5000))}, "tools[0]"),
        ({"tools": [TIME_TOOL] * 129}, "tools"),
        ({"tools": _with_function(description=5)}, "tools[0].function.description"),
        ({"tools": _with_function(extra=1)}, "tools[0].function.extra"),
        ({"tools": [TIME_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TIME_TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": [TIME_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [TIME_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_name_the_field(fields, param):
    assert _param_of(**fields) == param


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "assistant", "content": None, "tool_calls": {}}, "messages[0].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            "messages[0].tool_calls[0].id",
        ),
        ({"role": "assistant", "content": None}, "messages[0].content"),
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "function": {"name": "f", "arguments": '{"a": ' + "[" * 5000}}
                ],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c",
                        "function": {
                            "name": "f",
                            "arguments": '{"a": ' + "[" * 5000 + "]" * 5000 + "}",
                        },
                    }
                ],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_messages_name_the_field(message, param):
    with pytest.raises(APIError) as err:
        parse_request({"messages": [message]}, chat=True)
    assert err.value.param == param


def test_good_tools_are_parsed_and_strict_ones_check_arguments():
    strict = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": True}}
    req = _chat(tools=[strict, TIME_TOOL], tool_choice="auto", parallel_tool_calls=False)
    assert [t.name for t in req.tools.tools] == ["get_weather", "get_time"]
    assert not req.tools.parallel and req.tools.choice == "auto"
    assert req.tools.accepts("get_weather", {"city": "Paris"})
    assert not req.tools.accepts("get_weather", {"city": 5})  # strict: the schema holds
    assert req.tools.accepts("get_time", {"any": "thing"})  # not strict: any object
    assert not req.tools.accepts("rm_rf", {})
    assert req.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert req.messages[2]["content"] == ""
    assert req.messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}
    assert _chat(tools=[], tool_choice="none").tools is None


# -- prompts ----------------------------------------------------------------------------------

# A small template in the style of Hermes 2 Pro / Qwen2.5.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_takes_tools_renders_them_and_the_history():
    template = ChatTemplate(HERMES_TEMPLATE)
    req = _chat(tools=[WEATHER_TOOL, TIME_TOOL])
    prompt = chat_prompt(template, req.messages, req.tools)
    assert prompt == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n"
        f"{json.dumps(WEATHER_TOOL)}\n{json.dumps(TIME_TOOL)}\n</tools><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n<tool_call>\n{WEATHER}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # tool_choice none: the tools are not shown (the history still is).
    hidden = chat_prompt(template, req.messages, _chat(tools=[TIME_TOOL], tool_choice="none").tools)
    assert "<tools>" not in hidden and "<tool_response>" in hidden
    # Other callers of ChatTemplate are unchanged.
    assert template("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_without_tools_gets_the_fallback(served):
    req = _chat(tools=[WEATHER_TOOL])
    prompt = chat_prompt(served.chat_template, req.messages, req.tools)
    section = FALLBACK_SYSTEM.format(tools=json.dumps(WEATHER_TOOL))
    assert prompt == (
        f"system: Be brief.\n\n{section}\n"
        "user: Weather in Paris?\n"
        f"assistant: <tool_call>\n{WEATHER}\n</tool_call>\n"
        "user: <tool_response>\n18 C, sunny\n</tool_response>\n"
        "assistant:"
    )
    assert "<tools>" not in chat_prompt(served.chat_template, req.messages, None)


# -- end to end -------------------------------------------------------------------------------


# The tiny model's context is 128 byte tokens: a terse template that renders tools (by name)
# and the tool history, for requests to fit.
TERSE_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TERSE_HISTORY = [
    {"role": "user", "content": "Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "9:00"},
]


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@contextlib.contextmanager
def _serving(served, **changes):
    """Another app on the running scheduler, with `changes` to what it serves."""
    with running(dataclasses.replace(served, **changes), start=False) as url:
        yield url


def test_requests_with_tools_and_tool_messages_are_answered(served, base_url):
    with _serving(served, chat_template=ChatTemplate(TERSE_TEMPLATE)) as url:
        client = _client(url)
        args = dict(model="tiny", messages=TERSE_HISTORY, tools=[WEATHER_TOOL, TIME_TOOL])
        out = client.chat.completions.create(**args, max_tokens=4, temperature=0)
        chunks = list(
            client.chat.completions.create(**args, max_tokens=4, temperature=0, stream=True)
        )
    prompt = (
        "tools: get_weather get_time\nuser: Paris?\n"
        "assistant: <tool_call>get_time{}</tool_call>\ntool: 9:00\nassistant:"
    )
    assert out.usage.prompt_tokens == len(served.tokenizer.encode(prompt).ids)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": _with_function(parameters={"type": 7})}, "tools[0].function.parameters"),
        ({"tools": [TIME_TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ],
)
def test_bad_tools_get_a_400_over_http(base_url, fields, param):
    body = {"messages": TERSE_HISTORY, **fields}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


class _Scripted:
    """A tokenizer whose decode says `pieces` (the i-th generated token decodes to the i-th
    piece), the real one otherwise: the random model's tokens become a scripted answer."""

    def __init__(self, tokenizer, pieces):
        self.tokenizer = tokenizer
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[: len(ids)])

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


SCRIPT = f"Checking.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"


def test_a_generated_call_comes_back_as_tool_calls_streamed_and_not(served):
    pieces = [SCRIPT[i : i + 7] for i in range(0, len(SCRIPT), 7)]
    with _serving(
        served,
        tokenizer=_Scripted(served.tokenizer, pieces),
        chat_template=ChatTemplate(TERSE_TEMPLATE),
        stop_ids=frozenset(),  # the script, not an early end of text, decides the answer
    ) as url:
        client = _client(url)
        args = dict(
            model="tiny",
            messages=[{"role": "user", "content": "Weather and time?"}],
            tools=[WEATHER_TOOL, TIME_TOOL],
            max_tokens=len(pieces),
            temperature=0,
        )
        out = client.chat.completions.create(**args)
        with client.chat.completions.stream(**args) as stream:
            final = stream.get_final_completion()
        chunks = list(client.chat.completions.create(**args, stream=True))
        hidden = client.chat.completions.create(**args, tool_choice="none")
    for choice in (out.choices[0], final.choices[0]):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        calls = choice.message.tool_calls
        assert [(c.type, c.function.name) for c in calls] == [
            ("function", "get_weather"),
            ("function", "get_time"),
        ]
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {}]
        assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert [d.tool_calls[0].index for d in deltas if d.tool_calls] == [0, 1]
    # tool_choice none: no parsing, the text is the answer.
    assert hidden.choices[0].message.content == SCRIPT
    assert hidden.choices[0].message.tool_calls is None
    assert hidden.choices[0].finish_reason == "length"


def test_the_openapi_document_states_the_tool_fields():
    import jsonschema_rs

    from lowbit.server._openapi import openapi_document

    schema = openapi_document("tiny", 260, 128)["components"]["schemas"]["ChatRequest"]
    valid = jsonschema_rs.validator_for(schema).is_valid
    good = {"tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "auto", "parallel_tool_calls": True}
    assert valid({"messages": HISTORY, **good})
    assert valid({"messages": TERSE_HISTORY, "tool_choice": "none"})
    assert valid({"messages": HISTORY, "tools": [TIME_TOOL], "tool_choice": "required"})
    named = {"type": "function", "function": {"name": "get_time"}}
    assert valid({"messages": HISTORY, "tools": [TIME_TOOL], "tool_choice": named})
    for bad in (
        {"tools": _with_function(name="has space")},
        {"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
        {"tool_choice": "sometimes"},
        {"tool_choice": {"type": "function"}},
        {"parallel_tool_calls": "yes"},
        {"messages": [{"role": "tool", "content": "x"}]},
    ):
        assert not valid({"messages": HISTORY, **bad}), bad


# -- tool_choice required and a named function: grammar-constrained calls ---------------------

PICK_SCHEMA = {
    "type": "object",
    "properties": {"c": {"enum": ["a", "b"]}},
    "required": ["c"],
    "additionalProperties": False,
}
PICK_TOOL = {"type": "function", "function": {"name": "pick", "parameters": PICK_SCHEMA}}
NOOP_TOOL = {"type": "function", "function": {"name": "noop"}}
NAMED = {"type": "function", "function": {"name": "pick"}}
# What each format's grammar writes for a pick and a noop call, and between two calls.
FORMAT_TEXTS = {
    H: (
        '<tool_call>\n{"name": "pick", "arguments": {"c": "b"}}\n</tool_call>',
        "\n",
        '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
    ),
    L: ('{"name": "pick", "parameters": {"c": "b"}}', "; ", '{"name": "noop", "parameters": {}}'),
    M: ('{"name": "pick", "arguments": {"c": "b"}}', ", ", '{"name": "noop", "arguments": {}}'),
}


def _grammar_takes(grammars, tokenizer, lark, text, stops):
    """Whether the grammar `lark` admits `text` (as the tokenizer splits it) as a whole answer."""
    constraint = grammars.constrain_lark(lark)
    tokens = tokenizer.encode(text, add_special_tokens=False).ids
    for i, token in enumerate(tokens):
        if not constraint.allowed[token]:
            return False
        if not constraint.advance(token):
            return i == len(tokens) - 1  # complete: the grammar takes no more
    return any(constraint.allowed[s] for s in stops)


@pytest.fixture(scope="module")
def grammars(served):
    from lowbit.server._grammar import Grammars

    return Grammars(served.tokenizer, served.stop_ids, served.scheduler.model.config.vocab_size)


@pytest.mark.parametrize("fmt", [H, L, M])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_forced_grammar_writes_what_the_parser_reads(grammars, served, fmt, parallel):
    from lowbit.server._tool_grammar import tool_grammar

    tools = _chat(
        tools=[PICK_TOOL, NOOP_TOOL], tool_choice="required", parallel_tool_calls=parallel
    )
    named = _chat(tools=[PICK_TOOL, NOOP_TOOL], tool_choice=NAMED, parallel_tool_calls=parallel)
    one, between, other = FORMAT_TEXTS[fmt]
    wrap = (lambda t: f"[{t}]") if fmt is M else (lambda t: t)
    both = wrap(one + between + other)
    stops = served.stop_ids
    for req, text, calls in [
        (tools, wrap(one), ["pick"]),
        (tools, wrap(other), ["noop"]),
        (tools, both, ["pick", "noop"] if parallel else None),
        (named, wrap(one), ["pick"]),
        (named, wrap(other), None),  # not the named function
        (named, both, None),  # one call only
        (tools, wrap(one.replace('"b"', '"z"')), None),  # arguments off the schema
        (tools, wrap(one.replace(": ", ":")), None),  # another layout
        (tools, "Sure. " + wrap(one), None),  # text before the call
    ]:
        lark = tool_grammar(req.tools, fmt)
        taken = _grammar_takes(grammars, served.tokenizer, lark, text, stops)
        assert taken == (calls is not None), (text, lark)
        if calls is not None:
            limit = None if req.tools.parallel else 1
            parsed = parse_tool_calls(text, fmt, req.tools.accepts, limit)
            assert [c.name for c in parsed.calls] == calls and parsed.content is None


def test_a_schema_llguidance_cannot_compile_is_named():
    from lowbit.server._tool_grammar import schema_problem

    lookaround = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": lookaround}}
    req = _chat(tools=[PICK_TOOL, bad_tool], tool_choice="required")
    param, message = schema_problem(req.tools)
    assert param == "tools[1].function.parameters" and "look-around" in message
    # Only the tools the answer may call are compiled.
    assert schema_problem(_chat(tools=[PICK_TOOL, bad_tool], tool_choice=NAMED).tools) is None


def _calls_of_stream(chunks):
    """choice index -> (its tool calls as (name, arguments text), finish reason, content)."""
    out = {}
    for chunk in chunks:
        for choice in chunk.choices:
            calls, reason, content = out.setdefault(choice.index, ({}, None, ""))
            for call in choice.delta.tool_calls or []:
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (
                    name + (call.function.name or ""),
                    arguments + (call.function.arguments or ""),
                )
            out[choice.index] = (
                calls,
                choice.finish_reason or reason,
                content + (choice.delta.content or ""),
            )
    return {i: ([calls[k] for k in sorted(calls)], r, c) for i, (calls, r, c) in out.items()}


@pytest.mark.parametrize(
    "choice, parallel",
    [("required", True), ("required", False), (NAMED, True), (NAMED, False)],
    ids=["required", "required-one", "named", "named-one"],
)
def test_forced_tool_choices_always_answer_with_valid_calls(served, base_url, choice, parallel):
    import jsonschema_rs

    valid = jsonschema_rs.validator_for(PICK_SCHEMA).is_valid
    names = {"pick"} if choice == NAMED else {"pick", "noop"}
    with _serving(served, chat_template=ChatTemplate(TERSE_TEMPLATE)) as url:
        client = _client(url)
        args = dict(
            model="tiny",
            messages=[{"role": "user", "content": "?"}],
            tools=[PICK_TOOL, NOOP_TOOL],
            tool_choice=choice,
            parallel_tool_calls=parallel,
            max_tokens=90,
        )
        answers = []  # (calls as (name, arguments text), finish reason, content)
        for sampling in (dict(temperature=0), dict(temperature=1.0, seed=7, n=3)):
            out = client.chat.completions.create(**args, **sampling)
            for c in out.choices:
                calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
                answers.append((calls, c.finish_reason, c.message.content))
            chunks = list(client.chat.completions.create(**args, **sampling, stream=True))
            answers.extend(_calls_of_stream(chunks).values())
    assert len(answers) == 8
    for calls, reason, content in answers:
        assert reason == "tool_calls" and calls, (calls, reason, content)
        several = parallel and choice == "required"
        assert len(calls) == 1 or several
        # Calls only (with several, a later call that max_tokens cut short stays text).
        assert not content or (several and content.lstrip().startswith("<tool_call>"))
        for name, arguments in calls:
            assert name in names
            if name == "pick":
                assert valid(json.loads(arguments)), arguments
            else:
                assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {
                "tools": [
                    PICK_TOOL,
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "string", "pattern": "(?<=a)b"},
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
        (
            {
                "tools": [PICK_TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"tools": [PICK_TOOL], "tool_choice": NAMED | {"function": {"name": "x"}}}, "tool_choice"),
    ],
)
def test_bad_forced_tool_requests_get_a_400(served, base_url, fields, param):
    body = {"messages": [{"role": "user", "content": "?"}], "max_tokens": 8, **fields}
    with _serving(served, chat_template=ChatTemplate(TERSE_TEMPLATE)) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
