"""The request fields that steer which tokens may come next: ``response_format`` (a JSON
schema every answer must match) and ``logit_bias`` (per-token offsets to the logits), validated
into a `Guidance`.

What each accepts is what OpenAI's API documents; the OpenAPI document
(`lowbit.server._openapi`) states the same shapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from lowbit.server._grammar import ANY_OBJECT
from lowbit.server._protocol import bad

# The most ``logit_bias`` entries a request may carry.
MAX_LOGIT_BIAS = 1024
# A ``logit_bias`` key: a token id in decimal (nine digits bound the conversion).
TOKEN_KEY = "[0-9]{1,9}"
# OpenAI's rule for ``response_format.json_schema.name``.
SCHEMA_NAME = "[A-Za-z0-9_-]{1,64}"
_FORMAT = "response_format"
_SCHEMA = f"{_FORMAT}.json_schema"


@dataclasses.dataclass(frozen=True)
class Guidance:
    """What a request asks of its tokens beyond sampling.

    Attributes:
      schema: the JSON schema the answer must match (`ANY_OBJECT` for ``json_object``), or
        None for free text.
      logit_bias: ``(token id, bias)`` pairs added to the logits at every step, by id.
    """

    schema: dict[str, Any] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


def _keys(value: dict, allowed: set[str], name: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise bad(f"{name}.{extra[0]}", f"is not a field of {name} (it takes {sorted(allowed)})")


def _schema(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad(_FORMAT, "must be an object with a type: text, json_object or json_schema")
    kind = value.get("type")
    if kind in ("text", "json_object"):
        _keys(value, {"type"}, _FORMAT)
        return None if kind == "text" else ANY_OBJECT
    if kind != "json_schema":
        raise bad(f"{_FORMAT}.type", f"must be text, json_object or json_schema, got {kind!r}")
    _keys(value, {"type", "json_schema"}, _FORMAT)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad(_SCHEMA, "must be an object with a name and a schema", code="missing_field")
    _keys(spec, {"name", "description", "schema", "strict"}, _SCHEMA)
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(SCHEMA_NAME, name):
        raise bad(f"{_SCHEMA}.name", "must be 1 to 64 letters, digits, '_' or '-'")
    if not isinstance(spec.get("description", ""), str):
        raise bad(f"{_SCHEMA}.description", "must be a string")
    if not isinstance(spec.get("strict", False), bool | None):  # not 1: 1 == True
        raise bad(f"{_SCHEMA}.strict", "must be true, false or null")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad(f"{_SCHEMA}.schema", "must be a JSON schema object", code="missing_field")
    return schema


def _logit_bias(value: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad("logit_bias", "must be an object mapping token ids (strings) to numbers")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not re.fullmatch(TOKEN_KEY, key) or int(key) >= vocab:
            raise bad(
                "logit_bias",
                f"key {json.dumps(key)} is not a token id: give ids below {vocab} as strings",
            )
        if (
            isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not math.isfinite(bias)
            or not -100 <= bias <= 100
        ):
            raise bad("logit_bias", f"the bias of token {key} must be a number in [-100, 100]")
        out[int(key)] = float(bias)  # "7" and "07" are one token
    return tuple(sorted(out.items()))


def parse_guidance(body: dict[str, Any], vocab: int) -> Guidance:
    """The ``response_format`` and ``logit_bias`` of a request body (token ids below `vocab`).

    Raises:
      APIError: 400 naming the field for a malformed one.
    """
    return Guidance(
        schema=_schema(body.get(_FORMAT)), logit_bias=_logit_bias(body.get("logit_bias"), vocab)
    )
