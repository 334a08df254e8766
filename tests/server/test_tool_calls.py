"""The tool-call parser in each format (Hermes / Qwen, Llama 3, Mistral): whole answers and
the same answers streamed at every split, text before a call released and a call's opening
held, one call kept without parallel tool calls, and the format chosen from the template."""

import pytest

from lowbit.server._tool_calls import (
    Call,
    Parsed,
    ToolCallStream,
    ToolFormat,
    parse_tool_calls,
    tool_format,
)

H, L, M = ToolFormat.HERMES, ToolFormat.LLAMA3, ToolFormat.MISTRAL
OFFERED = {"get_weather", "get_time"}
accept = lambda name, arguments: name in OFFERED  # noqa: E731

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {}}'
PARIS = Call("get_weather", {"city": "Paris"})
NOW = Call("get_time", {})

CASES = [
    # Hermes / Qwen: one call, several, text around them, a missing close at the very end.
    (H, f"<tool_call>\n{WEATHER}\n</tool_call>", Parsed(None, (PARIS,))),
    (
        H,
        f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
        Parsed("Let me look.", (PARIS, NOW)),
    ),
    (H, f"A<tool_call>{WEATHER}</tool_call> and B", Parsed("A and B", (PARIS,))),
    (H, f"<tool_call>\n{TIME}", Parsed(None, (NOW,))),
    # Arguments written as a JSON string holding an object are taken.
    (H, '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', Parsed(None, (NOW,))),
    # Not calls: unknown tool, arguments not an object, malformed JSON, trailing junk, no JSON.
    (H, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None),
    (H, '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', None),
    (H, '<tool_call>{"name": "get_time", "arguments": {</tool_call>', None),
    (H, f"<tool_call>{TIME} extra</tool_call>", None),
    (H, "<tool_call></tool_call>", None),
    (H, "plain text, no call <tool", None),
    # Arguments nested past what can be re-serialized are not a call.
    (H, '<tool_call>{"name": "get_time", "arguments": {"a": ' + "[" * 70 + "]" * 70 + "}}", None),
    # ...while a good call beside a bad one is still taken.
    (
        H,
        f'<tool_call>{{"name": "nope"}}</tool_call><tool_call>{TIME}</tool_call>',
        Parsed('<tool_call>{"name": "nope"}</tool_call>', (NOW,)),
    ),
    # Llama 3.1/3.2: the answer is the JSON (with or without <|python_tag|>), "parameters".
    (L, '{"name": "get_weather", "parameters": {"city": "Paris"}}', Parsed(None, (PARIS,))),
    (
        L,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        Parsed(None, (PARIS, NOW)),
    ),
    (L, 'Sure: <|python_tag|>{"name": "get_time", "parameters": {}}', Parsed("Sure:", (NOW,))),
    (L, 'I would call {"name": "get_time", "parameters": {}}', None),  # JSON mid-text: prose
    (L, '{"name": "get_time", "parameters": {}} then text', Parsed(" then text", (NOW,))),
    (L, '{"city": "Paris"}', None),
    # Mistral: [TOOL_CALLS] and an array (the control token is usually dropped by decoding).
    (M, f"[TOOL_CALLS] [{WEATHER}, {TIME}]", Parsed(None, (PARIS, NOW))),
    (M, f"[{WEATHER}]", Parsed(None, (PARIS,))),
    (M, f'[{WEATHER}, {{"name": "nope", "arguments": {{}}}}]', None),  # all of an array or none
    (M, "[1, 2, 3]", None),
    (M, f"Here: [TOOL_CALLS][{TIME}]", Parsed("Here:", (NOW,))),
]


def _streamed(fmt, pieces, limit=None):
    stream = ToolCallStream(fmt, accept, limit)
    released = "".join(stream.add(p) for p in pieces)
    rest, parsed = stream.finish()
    return released + rest, parsed


@pytest.mark.parametrize("fmt, text, expected", CASES)
def test_calls_are_parsed_whole_and_streamed_at_every_split(fmt, text, expected):
    expected = expected or Parsed(text, ())  # not a call: the text stays content
    assert parse_tool_calls(text, fmt, accept) == expected
    content = (expected.content or "") if expected.calls else text
    for at in range(len(text) + 1):
        assert _streamed(fmt, [text[:at], text[at:]]) == (content, expected), at
    assert _streamed(fmt, list(text)) == (content, expected)


def test_streaming_releases_text_before_a_call_and_holds_from_its_opening():
    stream = ToolCallStream(H, accept)
    assert stream.add("Hello there ") == "Hello there"  # the blank waits: a call may follow
    assert stream.add("<tool") == ""
    assert stream.add("bar> and") == " <toolbar> and"  # not an opening after all
    assert stream.add(f"<tool_call>{TIME}</tool_call> more") == ""
    assert stream.finish() == (" more", Parsed("Hello there <toolbar> and more", (NOW,)))


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    out = parse_tool_calls(text, H, accept, limit=1)
    assert out == Parsed(f"<tool_call>{TIME}</tool_call>", (PARIS,))
    assert _streamed(H, list(text), limit=1)[1] == out


@pytest.mark.parametrize(
    "template, fmt",
    [
        ("{{ tools }} <tool_call> </tool_call>", H),  # Hermes 2 Pro, Qwen2.5, Qwen3
        ("{{ tools }} [AVAILABLE_TOOLS] [TOOL_CALLS]", M),
        ('{{ tools }} <|python_tag|> "parameters" ipython', L),
        ("{{ tools }} anything else", H),
    ],
)
def test_the_format_follows_the_template(template, fmt):
    assert tool_format(template) is fmt


# -- requests ---------------------------------------------------------------------------------
