"""Calibration: how a block's clipping bounds are chosen from its values.

A calibrator is a frozen dataclass with `bounds(blocks, fmt=..., symmetric=...)` mapping
`blocks: [*scale_shape, block_elems] float32` to `(lo, hi)`, each `[*scale_shape]`. Non-finite
elements never enter a bound (they are masked first), so a NaN or Inf in one block leaves every
other block's scale untouched and its own block's scale finite. Strings such as
``"fixed,-6,6"`` are parsed at the edges by `parse_calibration`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from lowbit.formats import Format


def _finite_abs(blocks: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), 0.0)


def _finite_mean(blocks: jax.Array, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Mean of `fn(blocks)` over each block's finite elements (0 for a block with none)."""
    finite = jnp.isfinite(blocks)
    count = jnp.maximum(jnp.sum(finite, axis=-1), 1)
    return jnp.sum(jnp.where(finite, fn(blocks), 0.0), axis=-1) / count


def _finite_min_max(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    finite = jnp.isfinite(blocks)
    lo = jnp.min(jnp.where(finite, blocks, jnp.inf), axis=-1)
    hi = jnp.max(jnp.where(finite, blocks, -jnp.inf), axis=-1)
    empty = ~jnp.any(finite, axis=-1)
    return jnp.where(empty, 0.0, lo), jnp.where(empty, 0.0, hi)


def _check_positive(field: str, value: object) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not 0.0 < value < float("inf"):
        raise ValueError(f"{field}={value!r}; accepted: a positive finite number")


class _PositiveFields:
    """A calibrator whose `positive` fields must each be a positive finite number, checked on
    construction (``ValueError`` naming ``<Class>.<field>``)."""

    positive: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for field in self.positive:
            _check_positive(f"{type(self).__name__}.{field}", getattr(self, field))


def _symmetric(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    return -amax, amax


@dataclasses.dataclass(frozen=True)
class AbsMax(_PositiveFields):
    """Bound = `clip` × max |x| (`clip` < 1 clips outliers)."""

    clip: float = 1.0

    positive = ("clip",)

    def bounds(self, blocks: jax.Array, *, fmt: Format, symmetric: bool):
        if not symmetric:
            lo, hi = _finite_min_max(blocks)
            return self.clip * lo, self.clip * hi
        return _symmetric(self.clip * jnp.max(_finite_abs(blocks), axis=-1))


@dataclasses.dataclass(frozen=True)
class AbsMean(_PositiveFields):
    """Bound = `multiplier` × mean |x|: BitNet b1.58's ternary scale (with `fmt.max_value` 1,
    scale = mean |x| and codes = clip(round(x / scale), -1, 1))."""

    multiplier: float = 1.0

    positive = ("multiplier",)

    def bounds(self, blocks: jax.Array, *, fmt: Format, symmetric: bool):
        amean = _finite_mean(blocks, jnp.abs)
        amax = self.multiplier * amean * fmt.max_value
        if symmetric:
            return _symmetric(amax)
        return -amax, amax


@dataclasses.dataclass(frozen=True)
class MinMax:
    """Bounds = [min x, max x] (asymmetric); symmetric use takes max(|min|, |max|)."""

    def bounds(self, blocks: jax.Array, *, fmt: Format, symmetric: bool):
        lo, hi = _finite_min_max(blocks)
        if symmetric:
            return _symmetric(jnp.maximum(-lo, hi))
        return lo, hi


@dataclasses.dataclass(frozen=True)
class Percentile:
    """Bound = the `q`-th percentile of |x| (symmetric) or the (100-q, q) percentiles of x."""

    q: float = 99.9

    def __post_init__(self):
        q = self.q
        if isinstance(q, bool) or not isinstance(q, int | float) or not 50.0 <= q <= 100.0:
            raise ValueError(
                f"Percentile.q={q!r}; accepted: a percentile in [50, 100] (the bound is the q-th "
                "percentile of |x|, e.g. 99.9)"
            )

    def bounds(self, blocks: jax.Array, *, fmt: Format, symmetric: bool):
        finite = jnp.isfinite(blocks)
        if symmetric:
            values = jnp.where(finite, jnp.abs(blocks), jnp.nan)
            amax = jnp.nanpercentile(values, self.q, axis=-1)
            return _symmetric(jnp.where(jnp.isnan(amax), 0.0, amax))
        values = jnp.where(finite, blocks, jnp.nan)
        lo = jnp.nanpercentile(values, 100.0 - self.q, axis=-1)
        hi = jnp.nanpercentile(values, self.q, axis=-1)
        return jnp.where(jnp.isnan(lo), 0.0, lo), jnp.where(jnp.isnan(hi), 0.0, hi)


@dataclasses.dataclass(frozen=True)
class RMS(_PositiveFields):
    """Bound = `multiplier` × root-mean-square of x (robust to rare outliers)."""

    multiplier: float = 3.0

    positive = ("multiplier",)

    def bounds(self, blocks: jax.Array, *, fmt: Format, symmetric: bool):
        amax = self.multiplier * jnp.sqrt(_finite_mean(blocks, lambda b: b * b))
        if symmetric:
            return _symmetric(amax)
        lo, hi = _finite_min_max(blocks)
        return jnp.maximum(lo, -amax), jnp.minimum(hi, amax)


@dataclasses.dataclass(frozen=True)
class Fixed:
    """Constant bounds [lo, hi] for every block (static ranges, MaxText's ``"fixed,lo,hi"``)."""

    lo: float
    hi: float

    def __post_init__(self):
        finite = all(
            isinstance(v, int | float) and not isinstance(v, bool) and abs(v) < float("inf")
            for v in (self.lo, self.hi)
        )
        if not finite or not self.lo < self.hi:
            raise ValueError(
                f"Fixed calibration needs finite numbers lo < hi, got lo={self.lo!r}, "
                f"hi={self.hi!r}"
            )

    def bounds(self, blocks: jax.Array, *, fmt: Format, symmetric: bool):
        shape = blocks.shape[:-1]
        if symmetric:
            return _symmetric(jnp.full(shape, max(-self.lo, self.hi), jnp.float32))
        return jnp.full(shape, self.lo, jnp.float32), jnp.full(shape, self.hi, jnp.float32)


# The grid search needs to round-trip a block at candidate bounds; `_quantize` injects that
# function so this module stays below it.
RoundTrip = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class MSE:
    """Searches clip ratios r in `grid` (bounds = r × min/max bounds) per block and keeps the
    one with the least squared reconstruction error."""

    grid: tuple[float, ...] = tuple(round(1.0 - 0.025 * i, 4) for i in range(21))

    def __post_init__(self):
        if not isinstance(self.grid, tuple) or not self.grid:
            raise ValueError(f"MSE.grid={self.grid!r}; accepted: a non-empty tuple of clip ratios")
        for ratio in self.grid:
            _check_positive("MSE.grid ratio", ratio)

    def bounds(self, blocks: jax.Array, *, fmt: Format, symmetric: bool, round_trip: RoundTrip):
        lo0, hi0 = MinMax().bounds(blocks, fmt=fmt, symmetric=symmetric)
        target = jnp.where(jnp.isfinite(blocks), blocks, 0.0)
        best_err = jnp.full(lo0.shape, jnp.inf, jnp.float32)
        best_lo, best_hi = lo0, hi0
        for ratio in self.grid:
            lo, hi = ratio * lo0, ratio * hi0
            err = jnp.sum((round_trip(target, lo, hi) - target) ** 2, axis=-1)
            better = err < best_err
            best_err = jnp.where(better, err, best_err)
            best_lo = jnp.where(better, lo, best_lo)
            best_hi = jnp.where(better, hi, best_hi)
        return best_lo, best_hi


Calibration = AbsMax | AbsMean | MinMax | Percentile | RMS | Fixed | MSE

_NAMES = {
    "absmax": AbsMax,
    "absmean": AbsMean,
    "minmax": MinMax,
    "percentile": Percentile,
    "rms": RMS,
    "mse": MSE,
}


def parse_calibration(text: str) -> Calibration:
    """Parses ``"absmax"``, ``"absmax,0.9"``, ``"minmax"``, ``"percentile,99.99"``, ``"rms,4"``,
    ``"mse"`` or ``"fixed,lo,hi"`` (``"fixed,hi"`` means [-hi, hi]).

    Raises:
      ValueError: naming the text and the accepted forms.
    """
    parts = [p.strip() for p in str(text).split(",")]
    name, args = parts[0].lower(), parts[1:]
    accepted = (
        "absmax[,clip] | absmean[,k] | minmax | percentile[,q] | rms[,k] | mse | fixed,lo,hi"
        " | fixed,hi"
    )
    try:
        values = [float(a) for a in args]
    except ValueError:
        values = None
    make = None
    if values is not None:
        if name == "fixed" and len(values) in (1, 2):
            lo, hi = (-abs(values[0]), abs(values[0])) if len(values) == 1 else values
            make = functools.partial(Fixed, lo, hi)
        elif name in ("minmax", "mse"):
            make = None if values else _NAMES[name]
        elif name in _NAMES and len(values) <= 1:
            make = functools.partial(_NAMES[name], *values)
    if make is not None:
        try:
            return make()
        except ValueError as err:  # parsed, but out of range: say which bound
            raise ValueError(f"calibration {text!r}: {err}") from None
    raise ValueError(f"calibration {text!r} does not parse; accepted: {accepted}")
