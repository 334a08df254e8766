"""`QuantConfig` to and from plain JSON-ready dicts, in the text forms recipes use.

A config is stored by value: the format by registry name, granularity and calibration in the
text forms of `lowbit.recipes` (``"per_group:32:1"``, ``"fixed,-6.0,6.0"``), the scale dtype by
name — the same spelling a recipe's JSON uses, so a checkpoint and its recipe read alike.
Reading one back only parses those strings, so a checkpoint cannot make the loader run code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lowbit.formats import Format, get_format
from lowbit.qarray import QuantConfig
from lowbit.recipes import format_calibration, format_granularity, parse_config

_KEYS = tuple(f.name for f in dataclasses.fields(QuantConfig))


def quant_config_to_dict(config: QuantConfig) -> dict[str, Any]:
    """A `QuantConfig` as a JSON-ready dict.

    Args:
      config: the config; its format must be registered (it is stored by name).
    Returns:
      ``{"format": "int8", "granularity": "per_token", "calibration": "fixed,-6.0,6.0",
      "symmetric": false, "rounding": "nearest", "scale_dtype": "float32", "pack": true}``.
    Raises:
      TypeError: if `config` is not a `QuantConfig`, or holds a granularity or calibration
        type that has no text form.
      ValueError: if its format object is not the one registered under its name.
    """
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    fmt = get_format(config.format)
    if isinstance(config.format, Format) and get_format(fmt.name) != fmt:
        raise ValueError(f"format {fmt.name!r} is not the registered format of that name")
    return {
        "format": fmt.name,
        "granularity": format_granularity(config.granularity),
        "calibration": format_calibration(config.calibration),
        "symmetric": bool(config.symmetric),
        "rounding": config.rounding,
        "scale_dtype": np.dtype(config.scale_dtype).name,
        "pack": bool(config.pack),
    }


def quant_config_from_dict(data: Any, field: str = "activation") -> QuantConfig:
    """Inverse of `quant_config_to_dict`.

    Args:
      data: the dict, with exactly the `QuantConfig` field names as keys.
      field: what the config is, for errors.
    Raises:
      ValueError: naming `field`, the key and the value that is missing, unknown or out of
        range (unknown format names, granularity or calibration forms, scale dtypes).
    """
    if not isinstance(data, dict) or set(data) != set(_KEYS):
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{field}: a stored quant config has keys {sorted(_KEYS)}, got {keys}")
    return parse_config(data, field)
