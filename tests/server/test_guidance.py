"""``response_format`` and ``logit_bias`` validation: what OpenAI documents parses, anything
else is a 400 naming the field."""

import pytest

from lowbit.server import APIError
from lowbit.server._grammar import ANY_OBJECT
from lowbit.server._guidance import MAX_LOGIT_BIAS, Guidance, parse_guidance

VOCAB = 260
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, Guidance()),
        ({"response_format": None, "logit_bias": None}, Guidance()),
        ({"response_format": {"type": "text"}, "logit_bias": {}}, Guidance()),
        ({"response_format": {"type": "json_object"}}, Guidance(schema=ANY_OBJECT)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a-b_1", "schema": SCHEMA, "strict": True},
                }
            },
            Guidance(schema=SCHEMA),
        ),
        # Sorted by id; "7" and "007" are one token (the last wins).
        (
            {"logit_bias": {"9": -100, "7": 1, "007": 2.5}},
            Guidance(logit_bias=((7, 2.5), (9, -100.0))),
        ),
    ],
)
def test_valid_fields_parse(body, expected):
    assert parse_guidance(body, VOCAB) == expected


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a b", "schema": SCHEMA},
                }
            },
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": True},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {}, "strict": 1},
                }
            },
            "response_format.json_schema.strict",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {}, "x": 1},
                }
            },
            "response_format.json_schema.x",
        ),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"260": 1}}, "logit_bias"),
        ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # never converted: no 4300-digit error
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"logit_bias": {"1": False}}, "logit_bias"),
        ({"logit_bias": {"1": None}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ],
)
def test_bad_fields_get_a_400_naming_them(body, param):
    with pytest.raises(APIError) as err:
        parse_guidance(body, VOCAB)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param)
