"""Choosing how `dot_general` multiplies: which operand is quantized on the fly, and whether
every scale lines up with the contraction (constant, or in nesting groups along contracting
axes). Static: decided from shapes, formats and scale layouts only.
"""

from __future__ import annotations

import dataclasses

from lowbit.formats import get_format
from lowbit.ops._operand import activation_scale_shape, active_side, format_kind, quantized
from lowbit.qarray import QArray

PATHS = (
    "float",
    "weight_only_epilogue",
    "weight_only_grouped",
    "int8_int32",
    "fp8_f32",
    "codes_f32",
    "reference",
)


@dataclasses.dataclass(frozen=True)
class Plan:
    path: str
    # {index into the contracting lists: number of groups} of the grouped axis pairs.
    groups: tuple[tuple[int, int], ...] = ()


def _side_meta(x, contracting, weight: QArray | None):
    """(kind, scale shape or None) of an operand, including one quantized on the fly."""
    if quantized(x):
        return format_kind(x.fmt), tuple(x.scale.shape)
    if weight is None:
        return "float", None
    config = weight.activation
    static = weight.activation_bounds is not None
    kind = format_kind(get_format(config.format))
    return kind, activation_scale_shape(x.shape, contracting, config, static)


def plan(lhs, rhs, dimension_numbers) -> Plan:
    (lc, rc), _ = dimension_numbers
    side, weight = active_side(lhs, rhs)
    lkind, lscale = _side_meta(lhs, lc, weight if side == "lhs" else None)
    rkind, rscale = _side_meta(rhs, rc, weight if side == "rhs" else None)
    if lkind == "float" and rkind == "float":
        return Plan("float")
    groups: dict[int, int] = {}
    for scale, contracting in ((lscale, lc), (rscale, rc)):
        if scale is None:
            continue
        for pair, axis in enumerate(contracting):
            count = scale[axis]
            if count == 1:
                continue
            # Both sides' groups must nest; the finer grouping is used for both.
            known = groups.get(pair, 1)
            if max(known, count) % min(known, count):
                return Plan("reference")
            groups[pair] = max(known, count)
    if "float" in (lkind, rkind):
        path = "weight_only_grouped" if groups else "weight_only_epilogue"
    elif lkind == rkind == "int":
        path = "int8_int32"
    elif lkind == rkind == "fp8":
        path = "fp8_f32"
    else:
        path = "codes_f32"
    return Plan(path, tuple(sorted(groups.items())))
