"""The OpenAPI 3.1 description of the server, served at ``/openapi.json``.

It states what `parse_request` accepts (fields, types, ranges, the neutral values of the fields
it does not implement) and what each endpoint answers, so clients can generate bindings and
schema-driven testers (schemathesis) can check the server against it. The token-id range and
the context come from the served model.
"""

from __future__ import annotations

from typing import Any

from lowbit.server._embeddings import ENCODING_FORMATS, MAX_INPUTS
from lowbit.server._guidance import MAX_LOGIT_BIAS, SCHEMA_NAME, TOKEN_KEY
from lowbit.server._protocol import MAX_LOGPROBS, MAX_STOP_STRINGS, NEUTRAL_FIELDS
from lowbit.server._tool_request import MAX_TOOLS


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


def _sampling(context: int, choices: int) -> dict[str, Any]:
    """Fields both endpoints accept (`choices`: the most `n` may be)."""
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
        "n": integer_or_null(1, choices),
        "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "stream": {"type": "boolean"},
        "stream_options": {
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": "boolean"}},
            "additionalProperties": False,
        },
        "user": {"type": "string"},
        "return_token_ids": {"type": "boolean"},
        **_guidance(),
        **{name: _neutral(values) for name, values in NEUTRAL_FIELDS.items()},
    }


def _tool_messages() -> list[dict[str, Any]]:
    """An assistant's message (maybe of tool calls only) and a tool's result."""
    call = {
        "type": "object",
        "required": ["id", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": "string", "description": "a JSON object"},
                },
            },
        },
    }
    assistant = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": ["string", "null"], "description": "null only with tool_calls"},
            "tool_calls": {"type": ["array", "null"], "items": call},
        },
    }
    tool = {
        "type": "object",
        "required": ["role", "content", "tool_call_id"],
        "properties": {
            "role": {"const": "tool"},
            "content": {"type": "string"},
            "tool_call_id": {"type": "string"},
        },
    }
    return [assistant, tool]


def _tool_fields() -> dict[str, Any]:
    """``tools``, ``tool_choice`` (none, auto, required or a named function) and
    ``parallel_tool_calls``."""
    function = {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"], "description": "a JSON Schema"},
            "strict": {"type": ["boolean", "null"]},
        },
    }
    tool = {
        "type": "object",
        "required": ["type", "function"],
        "additionalProperties": False,
        "properties": {"type": {"const": "function"}, "function": function},
    }
    return {
        "tools": {"type": ["array", "null"], "items": tool, "maxItems": MAX_TOOLS},
        "tool_choice": {
            "oneOf": [
                {"enum": ["none", "auto", "required", None]},
                {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string"}},
                        },
                    },
                },
            ],
            "description": "required (or a named function, one of tools): the answer is "
            "decoded under a grammar that admits only calls (that one function's)",
        },
        "parallel_tool_calls": {"type": ["boolean", "null"]},
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


def _embeddings(vocab: int, dim: int, tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``/v1/embeddings``' request schema and path item (vectors of `dim`, inputs of at most
    `tokens` tokens)."""
    ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
        "minItems": 1,
        "maxItems": tokens,
    }
    many = lambda item: {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_INPUTS}  # noqa: E731
    text = {"type": "string", "minLength": 1}
    request = {
        "type": "object",
        "required": ["input"],
        "additionalProperties": False,
        "properties": {
            "model": {"type": ["string", "null"]},
            "input": {"oneOf": [text, many(text), ids, many(ids)]},
            "encoding_format": {"enum": [*ENCODING_FORMATS, None]},
            "dimensions": {"enum": [dim, None]},
            "user": {"type": ["string", "null"]},
        },
    }
    vector = {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}
    item = {
        "type": "object",
        "required": ["object", "index", "embedding"],
        "properties": {
            "object": {"const": "embedding"},
            "index": {"type": "integer"},
            "embedding": vector,
        },
    }
    answer = {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": item},
            "model": {"type": "string"},
            "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"]},
        },
    }
    answers = _answers("the vectors")
    answers["200"] = {
        "description": "the vectors",
        "content": {"application/json": {"schema": answer}},
    }
    body = {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/EmbeddingRequest"}}
        },
    }
    return request, {"post": {"requestBody": body, "responses": answers}}


def openapi_document(
    model: str,
    vocab: int,
    context: int,
    choices: int = 1,
    *,
    embedding_dim: int | None = None,
    embedding_tokens: int | None = None,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server of `model` (token ids below `vocab`, `context`
    tokens per request, up to `choices` choices per request; with `embedding_dim`,
    ``/v1/embeddings`` of vectors that wide and inputs of at most `embedding_tokens` tokens)."""
    sampling = _sampling(context, choices)
    top_logprobs = {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS}
    completion = {
        "type": "object",
        "required": ["prompt"],
        "additionalProperties": False,
        "properties": {
            **sampling,
            # false is taken for null, as before log-probabilities were served.
            "logprobs": {"oneOf": [top_logprobs, {"const": False}]},
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
            "role": {"enum": ["system", "user", "developer"]},
            "content": {"type": "string"},
        },
    }
    chat = {
        "type": "object",
        "required": ["messages"],
        "additionalProperties": False,
        "properties": {
            **sampling,
            # top_logprobs needs logprobs true (a 400 otherwise, which a schema cannot state).
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": top_logprobs,
            "messages": {
                "type": "array",
                "items": {"oneOf": [message, *_tool_messages()]},
                "minItems": 1,
            },
            **_tool_fields(),
            "max_completion_tokens": sampling["max_tokens"],
        },
    }
    body = lambda name: {  # noqa: E731
        "required": True,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }
    plain = lambda text: {"200": {"description": text}}  # noqa: E731
    document = {
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
    if embedding_dim is not None:
        schema, path = _embeddings(vocab, embedding_dim, embedding_tokens or context)
        document["paths"]["/v1/embeddings"] = path
        document["components"]["schemas"]["EmbeddingRequest"] = schema
    return document
