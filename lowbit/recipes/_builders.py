"""Rule builders shared by the presets: one quantization choice expanded to the weight layouts
found in JAX models.

Which parameters: 2-D and larger weights whose path ends in

  * ``kernel`` — Flax layout ``[..., in, out]`` (Linear ``[in, out]``, Conv ``[kh, kw, in, out]``,
    stacked ``[layers, in, out]``): per-channel scales over ``out`` (axis -1), groups along ``in``
    (axis -2), the contraction axis;
  * ``embedding`` — ``[vocab, dim]``: one scale per row (a lookup gathers whole rows and their
    scales), groups along ``dim`` (the contraction axis of ``attend``);
  * ``weight`` — PyTorch / Hugging Face layout ``[out, in]``: per-channel over ``out`` (axis
    -2), groups along ``in`` (axis -1).

Biases and norm scales are 1-D and stay in float (`Rule.min_ndim` = 2). Groups use negative
axes, so a stacked ``[layers, in, out]`` kernel gets per-layer group scales as is; per-channel
and per-tensor choices get per-layer scales through `Rule.stacked_axes` when asked.
"""

from __future__ import annotations

import functools
import re

from lowbit.qarray import (
    AbsMax,
    Calibration,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QuantConfig,
)
from lowbit.recipes._rule import Rule

# path regex -> (per-channel kept axis, group axis)
LAYOUTS = (
    (r".*embedding", 0, -1),
    (r".*kernel", -1, -2),
    (r".*weight", -2, -1),
)


def layout_axes(path: str) -> tuple[int, int] | None:
    """(per-channel kept axis, group axis) of the first `LAYOUTS` entry naming `path`, or None."""
    return next(((c, g) for pattern, c, g in LAYOUTS if re.fullmatch(pattern, path)), None)


def contraction_axis(path: str, ndim: int) -> int | None:
    """The axis a parameter at `path` with `ndim` axes is contracted over by its matmul layout
    (`LAYOUTS`: a ``kernel`` over -2, an ``embedding`` used as the output head and a PyTorch
    ``weight`` over -1), as a non-negative index; None for a path no layout names."""
    axes = layout_axes(path)
    return None if axes is None else axes[1] % ndim


def weight_config(
    fmt: str,
    *,
    channel_axis: int,
    group_axis: int,
    group_size: int | None = None,
    per_tensor: bool = False,
    symmetric: bool = True,
    calibration: Calibration | None = None,
) -> QuantConfig:
    """A weight config for one layout: per-tensor, per-channel, or groups of `group_size`."""
    if per_tensor:
        granularity = PerTensor()
    elif group_size is None:
        granularity = PerChannel(axes=(channel_axis,))
    else:
        granularity = PerGroup(group_size, axis=group_axis)
    return QuantConfig(
        format=fmt,
        granularity=granularity,
        calibration=calibration or AbsMax(),
        symmetric=symmetric,
    )


def activation_config(
    fmt: str,
    *,
    per_tensor: bool = False,
    group_size: int | None = None,
    calibration: Calibration | None = None,
) -> QuantConfig:
    """Dynamic activation quantization: one scale per token unless `per_tensor`, or one per
    `group_size` consecutive features of a token (along the last, contracted axis)."""
    if per_tensor and group_size is not None:
        raise ValueError(
            f"activation_config({fmt!r}): per_tensor=True and group_size={group_size!r} ask for "
            "two granularities; pass one of them"
        )
    if per_tensor:
        granularity = PerTensor()
    elif group_size is not None:
        granularity = PerGroup(group_size, axis=-1)
    else:
        granularity = PerToken()
    return QuantConfig(format=fmt, granularity=granularity, calibration=calibration or AbsMax())


def matmul_rules(
    fmt: str,
    *,
    group_size: int | None = None,
    per_tensor: bool = False,
    symmetric: bool = True,
    calibration: Calibration | None = None,
    activation: QuantConfig | None = None,
    gradient: QuantConfig | None = None,
    static_activation: bool = False,
    stacked_axes: int = 0,
    path_prefix: str = "",
) -> tuple[Rule, ...]:
    """One rule per weight layout (see module docstring), all quantizing to `fmt`.

    Args:
      fmt: weight format name.
      group_size: groups along the contraction axis, or None for per-channel scales.
      per_tensor: one scale per weight (per layer when stacked).
      symmetric: symmetric (no zero point) or asymmetric weights.
      calibration: weight calibration (default absmax).
      activation: dynamic/static activation config, or None for weight-only.
      gradient: QAT gradient config, or None.
      static_activation: calibrate activation bounds.
      stacked_axes: leading layer axes of every matched weight.
      path_prefix: regex prefix restricting the rules (e.g. ``"decoder/"``).
    Returns:
      Three rules, for ``embedding``, ``kernel`` and ``weight`` paths.
    """
    # The layouts differ only in which axes hold channels and groups.
    weight = functools.partial(
        weight_config,
        fmt,
        group_size=group_size,
        per_tensor=per_tensor,
        symmetric=symmetric,
        calibration=calibration,
    )
    return tuple(
        Rule(
            path=path_prefix + path,
            weight=weight(channel_axis=channel_axis, group_axis=group_axis),
            activation=activation,
            gradient=gradient,
            static_activation=static_activation,
            stacked_axes=stacked_axes,
        )
        for path, channel_axis, group_axis in LAYOUTS
    )
