"""MaxText's mixed-precision (``intmp``) JSON as a `Recipe`.

The JSON maps a layer-path regex (or ``"__default__"``) to
``{"w_bits", "a_bits", "w_scale", "a_scale", "tile_size"}``:

  * ``w_bits`` — weight bits (int, symmetric), or null to keep the weight in float;
  * ``a_bits`` — activation bits (dynamic, per token), or null for weight-only;
  * ``w_scale`` / ``a_scale`` — absmax clipping ratio (1.0 = no clipping);
  * ``tile_size`` — -1 for per-channel scales, else groups of that size along the contraction
    axis (MaxText's sub-channel tiling).

Keys missing in an entry come from ``"__default__"``, whose own missing keys are
``w_bits=null, a_bits=null, w_scale=1, a_scale=1, tile_size=-1``. An entry with ``w_bits``
null keeps its layers in float (activation quantization rides on a quantized weight, so an
inherited ``a_bits`` does not apply; setting ``a_bits`` in that entry itself is an error).

MaxText matches its regexes with `re.fullmatch` against the *module* path and the last matching
entry wins; our rules match *parameter* paths and the first match wins. So each regex becomes a
rule matching the module path plus one parameter name (``(?:regex)/[^/]*kernel``), entries
are emitted in reverse order, and the default comes last (restricted, like every entry, to the
weight layouts of the presets: ``kernel``, ``embedding``, ``weight``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lowbit._untrusted import load_json, read_text
from lowbit.qarray import AbsMax, QuantConfig
from lowbit.recipes._builders import LAYOUTS, activation_config, weight_config
from lowbit.recipes._recipe import Recipe
from lowbit.recipes._rule import Rule

DEFAULT = "__default__"
_KEYS = ("w_bits", "a_bits", "w_scale", "a_scale", "tile_size")
_BASE = {"w_bits": None, "a_bits": None, "w_scale": 1.0, "a_scale": 1.0, "tile_size": -1}


def _check_entry(name: str, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, Mapping):
        raise ValueError(f"intmp[{name!r}]: {entry!r} is not an object with keys {_KEYS}")
    unknown = sorted(set(entry) - set(_KEYS))
    if unknown:
        raise ValueError(f"intmp[{name!r}]: unknown keys {unknown}; accepted: {list(_KEYS)}")
    for key in ("w_bits", "a_bits"):
        bits = entry.get(key)
        if bits is not None and (not isinstance(bits, int) or not 1 <= bits <= 8):
            raise ValueError(f"intmp[{name!r}].{key}: {bits!r}; accepted: null or an int 1..8")
    for key in ("w_scale", "a_scale"):
        if key in entry and not (isinstance(entry[key], int | float) and 0 < entry[key] <= 1):
            raise ValueError(f"intmp[{name!r}].{key}: {entry[key]!r}; accepted: a number in (0, 1]")
    tile = entry.get("tile_size", -1)
    if not isinstance(tile, int) or (tile != -1 and tile <= 0):
        raise ValueError(f"intmp[{name!r}].tile_size: {tile!r}; accepted: -1 or a positive int")
    return dict(entry)


def _rules(prefix: str, entry: dict[str, Any], name: str, own: Mapping) -> tuple[Rule, ...]:
    """Rules for one entry; `prefix` is the regex for everything before the parameter name and
    `own` the keys the entry sets itself (not inherited from the default)."""
    if entry["w_bits"] is None:
        # A float weight keeps the whole layer float; an inherited a_bits does not apply.
        if own.get("a_bits") is not None:
            raise ValueError(
                f"intmp[{name!r}]: a_bits={entry['a_bits']} with w_bits=null; activation "
                "quantization rides on a quantized weight, so set w_bits too"
            )
        return (Rule(path=prefix),)
    activation: QuantConfig | None = None
    if entry["a_bits"] is not None:
        activation = activation_config(
            f"int{entry['a_bits']}", calibration=AbsMax(float(entry["a_scale"]))
        )
    tile = entry["tile_size"]
    return tuple(
        Rule(
            path=prefix + suffix,
            weight=weight_config(
                f"int{entry['w_bits']}",
                channel_axis=channel_axis,
                group_axis=group_axis,
                group_size=None if tile == -1 else tile,
                calibration=AbsMax(float(entry["w_scale"])),
            ),
            activation=activation,
        )
        for suffix, channel_axis, group_axis in ((p[2:], c, g) for p, c, g in LAYOUTS)
    )


def preset_from_maxtext_json(source: str | os.PathLike | Mapping[str, Any]) -> Recipe:
    """Builds a recipe from MaxText's mixed-precision JSON (see module docstring).

    Args:
      source: a path to the JSON file, JSON text, or the parsed dict.
    Returns:
      A `Recipe` named ``"intmp"``.
    Raises:
      ValueError: naming the entry and key that do not parse, and what is accepted.
    """
    if isinstance(source, Mapping):
        data = source
    else:
        text = str(source)
        where = "intmp JSON"
        if not text.lstrip().startswith("{"):
            where = f"intmp JSON file {text!r}"
            text = read_text(text)
        data = load_json(text, where)
    if not isinstance(data, Mapping):
        raise ValueError(f"intmp JSON must be an object of regex -> config, got {data!r}")
    default = dict(_BASE)
    if DEFAULT in data:
        default.update(_check_entry(DEFAULT, data[DEFAULT]))
    rules: list[Rule] = []
    # MaxText lets the last matching regex win; we let the first matching rule win.
    for regex, entry in reversed([(k, v) for k, v in data.items() if k != DEFAULT]):
        own = _check_entry(regex, entry)
        rules.extend(_rules(f"(?:{regex})/[^/]*", {**default, **own}, regex, own))
    if default["w_bits"] is not None or default["a_bits"] is not None:
        rules.extend(_rules(".*", default, DEFAULT, default))
    return Recipe(rules=tuple(rules), name="intmp")
