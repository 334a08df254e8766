"""The JSON forms of rules and configs (a `Recipe` is its rules in JSON: `Recipe.to_json`), and
the text forms of configs that only JSON and presets accept.

Text forms (parsed here, at the edge, into typed objects at once):

  format:       a registered format name, ``"int8"``, ``"uint4"``, ...
  granularity:  ``"per_tensor"``, ``"per_channel:-1"`` (kept axes, comma separated),
                ``"per_group:128"`` or ``"per_group:128:1"`` (size[:axis]),
                ``"per_block:128x128"``, ``"per_token"``
  calibration:  as `lowbit.qarray.parse_calibration`, plus ``"mse,1.0,0.9,..."`` (custom grid)
  scale_dtype:  ``"float32"``, ``"float16"``, ``"bfloat16"``
  a whole config may be just a format name: ``"int4"``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from lowbit import qarray
from lowbit.formats import format_names, get_format
from lowbit.qarray import QuantConfig
from lowbit.recipes._algorithm import algorithm_to_dict, parse_algorithm
from lowbit.recipes._rule import Rule
from lowbit.recipes._text_form import field_errors

_GRANULARITY_FORMS = (
    "per_tensor | per_channel:a[,b] | per_group:size[:axis] | per_block:AxB | per_token"
)


def format_granularity(g) -> str:
    if isinstance(g, qarray.PerTensor):
        return "per_tensor"
    if isinstance(g, qarray.PerChannel):
        return "per_channel:" + ",".join(str(a) for a in g.axes)
    if isinstance(g, qarray.PerGroup):
        return f"per_group:{g.size}" + ("" if g.axis == 0 else f":{g.axis}")
    if isinstance(g, qarray.PerBlock):
        return "per_block:" + "x".join(str(b) for b in g.block)
    if isinstance(g, qarray.PerToken):
        return "per_token"
    raise TypeError(f"unknown granularity {g!r}")


def parse_granularity(text: str, field: str = "granularity"):
    """Parses a granularity text form (see module docstring).

    Raises:
      ValueError: naming `field`, the text and the accepted forms.
    """
    name, _, rest = str(text).strip().partition(":")
    make = None
    try:
        if name == "per_tensor" and not rest:
            make = qarray.PerTensor
        elif name == "per_token" and not rest:
            make = qarray.PerToken
        elif name == "per_channel":
            axes = tuple(int(a) for a in rest.split(",")) if rest else (-1,)
            make = functools.partial(qarray.PerChannel, axes=axes)
        elif name == "per_group":
            parts = [int(p) for p in rest.split(":")]
            if len(parts) in (1, 2):
                make = functools.partial(qarray.PerGroup, *parts)
        elif name == "per_block" and rest:
            block = tuple(int(b) for b in rest.split("x"))
            make = functools.partial(qarray.PerBlock, block=block)
    except ValueError:
        make = None
    if make is not None:
        try:
            return make()
        except ValueError as err:  # well-formed, but a size or axis out of range
            raise ValueError(f"{field}: {text!r}: {err}") from None
    raise ValueError(f"{field}: {text!r} is not a granularity; accepted: {_GRANULARITY_FORMS}")


def format_calibration(c) -> str:
    if isinstance(c, qarray.AbsMax):
        return "absmax" if c.clip == 1.0 else f"absmax,{c.clip!r}"
    if isinstance(c, qarray.AbsMean):
        return f"absmean,{c.multiplier!r}"
    if isinstance(c, qarray.MinMax):
        return "minmax"
    if isinstance(c, qarray.Percentile):
        return f"percentile,{c.q!r}"
    if isinstance(c, qarray.RMS):
        return f"rms,{c.multiplier!r}"
    if isinstance(c, qarray.Fixed):
        return f"fixed,{c.lo!r},{c.hi!r}"
    if isinstance(c, qarray.MSE):
        return "mse" if c == qarray.MSE() else "mse," + ",".join(repr(r) for r in c.grid)
    raise TypeError(f"unknown calibration {c!r}")


def parse_calibration_field(text: str, field: str = "calibration"):
    """`parse_calibration` with the custom MSE grid form and the field name in errors."""
    parts = [p.strip() for p in str(text).split(",")]
    with field_errors(field):
        if parts[0].lower() == "mse" and len(parts) > 1:
            return qarray.MSE(grid=tuple(_grid_ratio(p, text) for p in parts[1:]))
        return qarray.parse_calibration(text)


def _grid_ratio(part: str, text: str) -> float:
    """One clip ratio of an ``"mse,r1,r2,..."`` grid; the error says what the form is."""
    try:
        return float(part)
    except ValueError:
        what = "an empty ratio" if not part else f"ratio {part!r}, not a number"
        raise ValueError(
            f"{text!r} has {what}; accepted: 'mse' (the default grid) or 'mse,' followed by "
            "comma-separated positive clip ratios, e.g. 'mse,1.0,0.95,0.9'"
        ) from None


def config_to_dict(config: QuantConfig) -> dict[str, Any]:
    return {
        "format": get_format(config.format).name,
        "granularity": format_granularity(config.granularity),
        "calibration": format_calibration(config.calibration),
        "symmetric": config.symmetric,
        "rounding": config.rounding,
        "scale_dtype": np.dtype(config.scale_dtype).name,
        "pack": config.pack,
    }


def parse_config(value: Any, field: str) -> QuantConfig | None:
    """A config from JSON: None, a format name, or a dict of `QuantConfig` fields in text form.

    Raises:
      ValueError: naming `field` (e.g. ``Rule.weight.format``), the value and what is accepted.
    """
    if value is None or isinstance(value, QuantConfig):
        return value
    if isinstance(value, str):
        value = {"format": value}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{field}: {value!r} is not a config; accepted: null, a format name, or "
            f"an object with keys {[f.name for f in dataclasses.fields(QuantConfig)]}"
        )
    known = {f.name for f in dataclasses.fields(QuantConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{field}: unknown keys {unknown}; accepted: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    if "format" in value:
        name = value["format"]
        if not isinstance(name, str) or name not in set(format_names()):
            raise ValueError(
                f"{field}.format: {name!r} is not a format; accepted: {', '.join(format_names())}"
            )
        kwargs["format"] = name
    if "granularity" in value:
        kwargs["granularity"] = parse_granularity(value["granularity"], f"{field}.granularity")
    if "calibration" in value:
        kwargs["calibration"] = parse_calibration_field(
            value["calibration"], f"{field}.calibration"
        )
    for key in ("symmetric", "pack"):
        if key in value:
            if not isinstance(value[key], bool):
                raise ValueError(f"{field}.{key}: {value[key]!r}; accepted: true or false")
            kwargs[key] = value[key]
    if "rounding" in value:
        kwargs["rounding"] = value["rounding"]
    if "scale_dtype" in value:
        names = ("float32", "float16", "bfloat16")
        if value["scale_dtype"] not in names:
            raise ValueError(f"{field}.scale_dtype: {value['scale_dtype']!r}; accepted: {names}")
        kwargs["scale_dtype"] = jnp.dtype(value["scale_dtype"])
    with field_errors(field):
        return QuantConfig(**kwargs)


def rule_to_dict(rule: Rule) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Rule):
        if not f.init:  # `select` is derived from the other fields
            continue
        value = getattr(rule, f.name)
        if isinstance(value, QuantConfig):
            value = config_to_dict(value)
        elif f.name == "algorithm":
            value = None if value is None else algorithm_to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def parse_rule(value: Any, field: str) -> Rule:
    if not isinstance(value, Mapping):
        raise ValueError(f"{field}: {value!r} is not an object with Rule fields")
    known = {f.name for f in dataclasses.fields(Rule) if f.init}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{field}: unknown keys {unknown}; accepted: {sorted(known)}")
    kwargs = dict(value)
    for key in ("weight", "activation", "gradient"):
        if key in kwargs:
            kwargs[key] = parse_config(kwargs[key], f"Rule.{key}")
    if "algorithm" in kwargs:
        kwargs["algorithm"] = parse_algorithm(kwargs["algorithm"])
    if kwargs.get("ops") is not None:
        if not isinstance(kwargs["ops"], list | tuple):
            raise ValueError(f"Rule.ops: {kwargs['ops']!r}; accepted: a list of op names or null")
        kwargs["ops"] = tuple(kwargs["ops"])
    if "static_activation" in kwargs and not isinstance(kwargs["static_activation"], bool):
        raise ValueError(
            f"Rule.static_activation: {kwargs['static_activation']!r}; accepted: true or false"
        )
    try:
        return Rule(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{field}: {err}") from None
