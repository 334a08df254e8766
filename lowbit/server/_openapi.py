"""The OpenAPI 3.1 description of the server, served at ``/openapi.json``.

It states what `parse_request` accepts (fields, types, ranges, the neutral values of the fields
it does not implement) and what each endpoint answers, so clients can generate bindings and
schema-driven testers (schemathesis) can check the server against it. The token-id range and
the context come from the served model.
"""

from __future__ import annotations

from typing import Any

from lowbit.server._guidance import MAX_LOGIT_BIAS, SCHEMA_NAME, TOKEN_KEY
from lowbit.server._protocol import _NEUTRAL, MAX_STOP_STRINGS


def _neutral(values: tuple) -> dict[str, Any]:
    return {"enum": list(values)}


def _guidance() -> dict[str, Any]:
    """``response_format`` and ``logit_bias`` (`lowbit.server._guidance`)."""
    only_type = lambda kind: {  # noqa: E731
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"const": kind}},
        "additionalProperties": False,
    }
    json_schema = {
        "type": "object",
        "required": ["type", "json_schema"],
        "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {
                "type": "object",
                "required": ["name", "schema"],
                "properties": {
                    "name": {"type": "string", "pattern": f"^{SCHEMA_NAME}$"},
                    "description": {"type": "string"},
                    "schema": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]},
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    }
    return {
        "response_format": {
            "oneOf": [
                {"type": "null"},
                only_type("text"),
                only_type("json_object"),
                json_schema,
            ]
        },
        "logit_bias": {
            "type": ["object", "null"],
            "propertyNames": {"pattern": f"^{TOKEN_KEY}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "maxProperties": MAX_LOGIT_BIAS,
        },
    }


def _sampling(context: int) -> dict[str, Any]:
    """Fields both endpoints accept."""
    integer_or_null = lambda lo, hi=None: {  # noqa: E731
        "type": ["integer", "null"],
        "minimum": lo,
        **({} if hi is None else {"maximum": hi}),
    }
    return {
        "model": {"type": ["string", "null"]},
        "max_tokens": integer_or_null(1, context),
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": integer_or_null(0),
        "seed": {"type": ["integer", "null"]},
        "stop": {
            "oneOf": [
                {"type": "null"},
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                    "maxItems": MAX_STOP_STRINGS,
                },
            ]
        },
        "n": {"enum": [1, None]},
        "stream": {"type": "boolean"},
        "stream_options": {
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": "boolean"}},
            "additionalProperties": False,
        },
        "user": {"type": "string"},
        "return_token_ids": {"type": "boolean"},
        **_guidance(),
        **{name: _neutral(values) for name, values in _NEUTRAL.items()},
    }


def _error_object() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }


def _answers(ok: str) -> dict[str, Any]:
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {
        "200": {
            "description": ok,
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {},
            },
        },
        "400": {"description": "a malformed or unsupported request", "content": error},
        "401": {"description": "a missing or wrong API key", "content": error},
        "429": {"description": "the queue is full (see Retry-After)", "content": error},
        "503": {"description": "the server is still compiling", "content": error},
        "504": {"description": "the request ran past its deadline", "content": error},
    }


def openapi_document(model: str, vocab: int, context: int) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server of `model` (token ids below `vocab`, `context`
    tokens per request)."""
    sampling = _sampling(context)
    completion = {
        "type": "object",
        "required": ["prompt"],
        "additionalProperties": False,
        "properties": {
            **sampling,
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
                        "minItems": 1,
                        "maxItems": context - 1,
                    },
                ]
            },
        },
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "user", "assistant", "developer"]},
            "content": {"type": "string"},
        },
    }
    chat = {
        "type": "object",
        "required": ["messages"],
        "additionalProperties": False,
        "properties": {
            **sampling,
            "messages": {"type": "array", "items": message, "minItems": 1},
            "max_completion_tokens": sampling["max_tokens"],
        },
    }
    body = lambda name: {  # noqa: E731
        "required": True,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }
    plain = lambda text: {"200": {"description": text}}  # noqa: E731
    return {
        "openapi": "3.1.0",
        "info": {"title": f"lowbit serve: {model}", "version": "1"},
        "paths": {
            "/v1/completions": {
                "post": {"requestBody": body("CompletionRequest"), "responses": _answers("text")}
            },
            "/v1/chat/completions": {
                "post": {"requestBody": body("ChatRequest"), "responses": _answers("a message")}
            },
            "/v1/models": {"get": {"responses": plain("the served model")}},
            "/health": {"get": {"responses": {**plain("ok"), "503": {"description": "loading"}}}},
            "/metrics": {"get": {"responses": plain("Prometheus text")}},
        },
        "components": {
            "schemas": {
                "CompletionRequest": completion,
                "ChatRequest": chat,
                "Error": _error_object(),
            }
        },
    }
