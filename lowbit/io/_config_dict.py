"""`QuantConfig` to and from plain JSON-ready dicts.

A config is stored by value, never by reference to code: the format by registry name, the
granularity and calibration as tagged dicts (``{"kind": "per_group", "size": 32, "axis": 0}``),
the scale dtype by name. Reading one back only looks names up in fixed tables, so a checkpoint
cannot make the loader run anything.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from lowbit.formats import Format, get_format
from lowbit.qarray import (
    MSE,
    RMS,
    AbsMax,
    AbsMean,
    Fixed,
    MinMax,
    PerBlock,
    Percentile,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QuantConfig,
)

_GRANULARITIES: dict[str, type] = {
    "per_tensor": PerTensor,
    "per_channel": PerChannel,
    "per_group": PerGroup,
    "per_block": PerBlock,
    "per_token": PerToken,
}
_CALIBRATIONS: dict[str, type] = {
    "absmax": AbsMax,
    "absmean": AbsMean,
    "minmax": MinMax,
    "percentile": Percentile,
    "rms": RMS,
    "fixed": Fixed,
    "mse": MSE,
}
_SCALE_DTYPES = ("float32", "float16", "bfloat16")
_CONFIG_KEYS = (
    "format",
    "granularity",
    "calibration",
    "symmetric",
    "rounding",
    "scale_dtype",
    "pack",
)


def _tagged(value: Any, table: dict[str, type], what: str) -> dict[str, Any]:
    for kind, cls in table.items():
        if type(value) is cls:
            out: dict[str, Any] = {"kind": kind}
            for field in dataclasses.fields(cls):
                item = getattr(value, field.name)
                out[field.name] = list(item) if isinstance(item, tuple) else item
            return out
    raise TypeError(
        f"{what} {value!r} has no stored form; accepted types: "
        f"{', '.join(c.__name__ for c in table.values())}"
    )


def _untagged(data: Any, table: dict[str, type], what: str) -> Any:
    if not isinstance(data, dict) or data.get("kind") not in table:
        kind = data.get("kind") if isinstance(data, dict) else data
        raise ValueError(f"{what} kind {kind!r} is unknown; accepted: {', '.join(table)}")
    cls = table[data["kind"]]
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(data) - names - {"kind"}
    if extra:
        raise ValueError(f"{what} {data['kind']!r} has unknown fields {sorted(extra)}")
    kwargs = {}
    for name in names & set(data):
        item = data[name]
        if isinstance(item, list):
            item = tuple(item)
        _check_plain(item, f"{what}.{name}")
        kwargs[name] = item
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} {data!r} is invalid: {err}") from None


def _check_plain(item: Any, where: str) -> None:
    values = item if isinstance(item, tuple) else (item,)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"{where} must hold finite numbers, got {item!r}")


def quant_config_to_dict(config: QuantConfig) -> dict[str, Any]:
    """A `QuantConfig` as a JSON-ready dict.

    Args:
      config: the config; its format must be registered (it is stored by name).
    Returns:
      ``{"format": str, "granularity": {...}, "calibration": {...}, "symmetric": bool,
      "rounding": str, "scale_dtype": str, "pack": bool}``.
    Raises:
      TypeError: if `config` is not a `QuantConfig` or holds a granularity or calibration type
        this module does not know.
      ValueError: if its format is not registered under its name.
    """
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    fmt = get_format(config.format)
    if isinstance(config.format, Format) and get_format(fmt.name) != fmt:
        raise ValueError(f"format {fmt.name!r} is not the registered format of that name")
    return {
        "format": fmt.name,
        "granularity": _tagged(config.granularity, _GRANULARITIES, "granularity"),
        "calibration": _tagged(config.calibration, _CALIBRATIONS, "calibration"),
        "symmetric": bool(config.symmetric),
        "rounding": config.rounding,
        "scale_dtype": np.dtype(config.scale_dtype).name,
        "pack": bool(config.pack),
    }


def quant_config_from_dict(data: dict[str, Any]) -> QuantConfig:
    """Inverse of `quant_config_to_dict`.

    Raises:
      ValueError: naming the key and value that are missing, unknown or out of range (unknown
        format names, granularity or calibration kinds, scale dtypes).
    """
    if not isinstance(data, dict):
        raise ValueError(f"a quant config must be a JSON object, got {type(data).__name__}")
    if set(data) != set(_CONFIG_KEYS):
        raise ValueError(
            f"quant config keys {sorted(data)} differ from the expected {sorted(_CONFIG_KEYS)}"
        )
    if not isinstance(data["format"], str):
        raise ValueError(f"quant config format must be a name, got {data['format']!r}")
    get_format(data["format"])  # raises ValueError listing the accepted names
    if data["scale_dtype"] not in _SCALE_DTYPES:
        raise ValueError(
            f"quant config scale_dtype {data['scale_dtype']!r}; accepted: {_SCALE_DTYPES}"
        )
    for key in ("symmetric", "pack"):
        if not isinstance(data[key], bool):
            raise ValueError(f"quant config {key} must be true or false, got {data[key]!r}")
    try:
        return QuantConfig(
            format=data["format"],
            granularity=_untagged(data["granularity"], _GRANULARITIES, "granularity"),
            calibration=_untagged(data["calibration"], _CALIBRATIONS, "calibration"),
            symmetric=data["symmetric"],
            rounding=data["rounding"],
            scale_dtype=_scale_dtype(data["scale_dtype"]),
            pack=data["pack"],
        )
    except TypeError as err:
        raise ValueError(f"quant config {data!r} is invalid: {err}") from None


def _scale_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
