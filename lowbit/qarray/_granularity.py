"""Granularity: which elements share a scale.

Every granularity resolves, for a given array shape, to a *tile shape*: the block of elements
that one scale covers. The scale then has shape `shape // tile` with the array's ndim, which is
what `QArray` stores. Granularities are frozen dataclasses so they can sit in hashable configs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _axis(axis: int, ndim: int, what: str) -> int:
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis!r} is out of range for an array with ndim={ndim}")
    return axis % ndim


@dataclasses.dataclass(frozen=True)
class PerTensor:
    """One scale for the whole array."""

    def tile(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(shape)


@dataclasses.dataclass(frozen=True)
class PerChannel:
    """One scale per index along `axes` (the kept axes), reducing over the others.

    For a Flax kernel `[in, out]`, `PerChannel(axes=(-1,))` gives one scale per output channel.
    """

    axes: tuple[int, ...] = (-1,)

    def __post_init__(self):
        axes = self.axes
        if (
            not isinstance(axes, tuple)
            or not axes
            or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes)
        ):
            raise ValueError(
                f"PerChannel.axes={axes!r}; accepted: a non-empty tuple of ints, e.g. (-1,)"
            )

    def tile(self, shape: Sequence[int]) -> tuple[int, ...]:
        kept = {_axis(a, len(shape), "PerChannel.axes") for a in self.axes}
        return tuple(1 if i in kept else n for i, n in enumerate(shape))


@dataclasses.dataclass(frozen=True)
class PerGroup:
    """Groups of `size` consecutive elements along `axis`, one scale per group and per index of
    every other axis (sub-channel quantization; `axis` is usually the contraction axis)."""

    size: int
    axis: int = 0

    def __post_init__(self):
        if not _positive_int(self.size):
            raise ValueError(
                f"PerGroup.size={self.size!r}; accepted: a positive int (elements per group), "
                "e.g. 32, 64 or 128"
            )
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise ValueError(f"PerGroup.axis={self.axis!r}; accepted: an int")

    def tile(self, shape: Sequence[int]) -> tuple[int, ...]:
        axis = _axis(self.axis, len(shape), "PerGroup.axis")
        if not isinstance(self.size, int) or self.size <= 0 or shape[axis] % self.size:
            raise ValueError(
                f"group size {self.size!r} does not divide axis {axis} of shape {tuple(shape)}; "
                f"use a group size that divides {shape[axis]}"
            )
        return tuple(self.size if i == axis else 1 for i in range(len(shape)))


@dataclasses.dataclass(frozen=True)
class PerBlock:
    """N-D blocks (e.g. `(128, 128)`) over the trailing `len(block)` axes; leading axes get one
    scale per index."""

    block: tuple[int, ...]

    def __post_init__(self):
        block = self.block
        if not isinstance(block, tuple) or not block or not all(_positive_int(b) for b in block):
            raise ValueError(
                f"PerBlock.block={block!r}; accepted: a non-empty tuple of positive ints, e.g. "
                "(128, 128)"
            )

    def tile(self, shape: Sequence[int]) -> tuple[int, ...]:
        k = len(self.block)
        if k > len(shape):
            raise ValueError(f"block {self.block} has more axes than shape {tuple(shape)}")
        lead = (1,) * (len(shape) - k)
        for n, b in zip(shape[len(shape) - k :], self.block, strict=True):
            if b <= 0 or n % b:
                raise ValueError(
                    f"block {self.block} does not divide the trailing axes of {tuple(shape)}"
                )
        return lead + tuple(self.block)


@dataclasses.dataclass(frozen=True)
class PerToken:
    """One scale per token: reduce over the last (feature) axis only (activations)."""

    def tile(self, shape: Sequence[int]) -> tuple[int, ...]:
        return (1,) * (len(shape) - 1) + (shape[-1],) if shape else ()


Granularity = PerTensor | PerChannel | PerGroup | PerBlock | PerToken
