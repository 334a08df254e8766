"""`quantize`: float array → `QArray`, with granularity, calibration, rounding and packing.

The math, per block (one scale each; see `QArray`):

  symmetric:   scale = bound / fmt.max_value,          codes = encode(x / scale)
  asymmetric:  scale = (hi - lo) / (fmt.max - fmt.min), zero_point = fmt.min - lo / scale,
               codes = encode(x / scale + zero_point)
  MX (E8M0):   scale = 2**(floor(log2 bound) - floor(log2 fmt.max_value))   (OCP MX v1.0)
  NVFP4:       tensor_scale = global bound / (fmt.max_value * 448),
               scale = e4m3(bound / fmt.max_value / tensor_scale)

Guards: a block whose bound is zero (all zeros) or not finite gets scale 1, so it decodes to exact
zeros and never to NaN; in a format without a zero level (``int1``: ±1) such a block gets scale
0 instead, so it still decodes to zeros. Non-finite elements do not enter any bound; NaN encodes
to code 0's grid value nearest zero and ±Inf saturate to the largest magnitude of their block.

Checked on concrete inputs (`check_values`; a traced input cannot be inspected, see there): an
input with no finite element at all (all NaN / ±Inf) is refused rather than quantized to
zeros, and so are negative values under an explicitly symmetric unsigned format.

Unsigned formats (``uint1`` .. ``uint8``) default to asymmetric quantization with a zero point:
their grid ``[0, 2**bits - 1]`` has no negative values, so a symmetric scale (zero point fixed
at code 0) can only represent non-negative data. ``symmetric=True`` with an unsigned format is
accepted for data known to be non-negative (e.g. after a ReLU) and refused where the data or a
`Fixed` calibration shows negative values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from lowbit.formats import Format, GGUFBlockFormat, get_format
from lowbit.gguf import encode as gguf_encode
from lowbit.qarray._calibration import MSE, AbsMax, Calibration, Fixed, MinMax
from lowbit.qarray._granularity import Granularity, PerGroup, PerTensor
from lowbit.qarray._qarray import QArray, broadcast_blocks

ROUNDINGS = ("nearest", "stochastic")
_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """How to quantize one array. Frozen and hashable: safe as static jit metadata.

    Attributes:
      format: element format name (or `Format`), e.g. ``"int8"``, ``"nf4"``, ``"mxfp4"``.
      granularity: which elements share a scale. Block formats (MX, NVFP4) force groups of
        their block size along `granularity.axis` if it is a `PerGroup`, else the last axis.
      calibration: how each block's bounds are chosen.
      symmetric: symmetric (no zero point) or asymmetric (with a zero point). Asymmetric needs
        an integer format. None (the default) picks asymmetric for unsigned integer formats
        (``uint*``), whose grid has no negative values, and symmetric for every other format;
        the config stores the resolved bool. ``symmetric=True`` with an unsigned format is for
        non-negative data only (see the module docstring).
      rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (needs a PRNG key).
      scale_dtype: dtype of stored float scales.
      pack: pack sub-byte codes densely into uint8 (the default; False keeps one code a byte).
    """

    format: str | Format = "int8"
    granularity: Granularity = PerTensor()
    calibration: Calibration = AbsMax()
    symmetric: bool | None = None
    rounding: str = "nearest"
    scale_dtype: Any = jnp.float32
    pack: bool = True

    def __post_init__(self):
        fmt = get_format(self.format)  # raises on unknown names
        if not isinstance(self.granularity, Granularity):
            raise TypeError(
                f"QuantConfig.granularity={self.granularity!r} is a "
                f"{type(self.granularity).__name__}, not a granularity; accepted: PerTensor(), "
                "PerChannel(axes), PerGroup(size, axis), PerBlock(block), PerToken() (text "
                "forms such as 'per_group:128' are for recipe JSON: "
                "lowbit.recipes.parse_granularity)"
            )
        if not isinstance(self.calibration, Calibration):
            raise TypeError(
                f"QuantConfig.calibration={self.calibration!r} is a "
                f"{type(self.calibration).__name__}, not a calibration; accepted: AbsMax(), "
                "AbsMean(), MinMax(), Percentile(q), RMS(), Fixed(lo, hi), MSE() (text forms "
                "such as 'percentile,99.9' are for recipe JSON: lowbit.qarray.parse_calibration)"
            )
        _check_fixed_block(fmt, self.granularity)
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r}; accepted: {ROUNDINGS}")
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", not _unsigned_int(fmt))
        elif not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric={self.symmetric!r}; accepted: True, False or None")
        if (
            self.symmetric
            and _unsigned_int(fmt)
            and isinstance(self.calibration, Fixed)
            and self.calibration.lo < 0
        ):
            raise ValueError(
                f"symmetric=True with unsigned format {fmt.name!r} represents [0, hi] only, but "
                f"the Fixed calibration's lo={self.calibration.lo} is negative: negative values "
                "would all become 0. Use symmetric=False (a zero point) or a signed format"
            )
        if not self.symmetric and (not hasattr(fmt, "qmin") or fmt.block_size is not None):
            raise ValueError(
                f"symmetric=False needs an integer format (a zero point in code units); "
                f"format {fmt.name!r} is symmetric only"
            )
        dtype = np.dtype(self.scale_dtype)
        if dtype not in (np.float32, np.float16, jnp.bfloat16):
            raise ValueError(f"scale_dtype={dtype}; accepted: float32, float16, bfloat16")
        object.__setattr__(self, "scale_dtype", dtype)


def _check_fixed_block(fmt: Format, granularity: Granularity) -> None:
    """A block format (MX, NVFP4) fixes its group size; a `PerGroup` may only pick the axis."""
    if fmt.block_size is None or not isinstance(granularity, PerGroup):
        return
    if granularity.size != fmt.block_size:
        rule = (
            "MX formats share one E8M0 scale per 32 elements (OCP MX v1.0)"
            if fmt.scale_encoding == "e8m0"
            else f"its blocks share one {fmt.scale_encoding} scale per {fmt.block_size} elements"
        )
        raise ValueError(
            f"QuantConfig.granularity=PerGroup({granularity.size}) contradicts format "
            f"{fmt.name!r}: {rule}, so its group size is fixed at {fmt.block_size}. Use "
            f"PerGroup({fmt.block_size}, axis={granularity.axis}) to choose the axis, or leave "
            "granularity at its default (blocks along the last axis)"
        )


def _unsigned_int(fmt: Format) -> bool:
    """An integer format whose grid has no negative values (``uint*``)."""
    return hasattr(fmt, "qmin") and fmt.block_size is None and fmt.min_value >= 0


def _check_input(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"quantize expects a floating-point array, got dtype {x.dtype}; cast it first "
            "(x.astype(jnp.float32))"
        )
    if x.size == 0:
        raise ValueError(
            f"quantize got an empty array of shape {tuple(x.shape)}: there are no values to "
            "choose a scale from; keep empty arrays in float"
        )
    return x


def _quantize_scalar(
    x: jax.Array, fmt: Format, config: QuantConfig, key: Any, bounds: Any
) -> QArray:
    """A 0-d array as a 0-d QArray: one code, one scale (and zero point), all of shape ().

    Sub-byte codes stay one a byte (there is no axis to pack two along).
    """
    if fmt.block_size is not None or isinstance(fmt, GGUFBlockFormat):
        size = fmt.block_size or fmt.block.block_size
        raise ValueError(
            f"quantize got a 0-d array (a scalar), but format {fmt.name!r} stores blocks of "
            f"{size} elements; keep the scalar in float or use a format without fixed blocks "
            "such as 'int8'"
        )
    q = quantize(x.reshape(1), dataclasses.replace(config, pack=False), key=key, bounds=bounds)
    return dataclasses.replace(
        q,
        codes=q.codes.reshape(()),
        scale=q.scale.reshape(()),
        zero_point=None if q.zero_point is None else q.zero_point.reshape(()),
        shape=(),
        packed_axis=None,
    )


@functools.partial(jax.jit, static_argnums=1)
def _finite_summary(x: jax.Array, want_min: bool) -> tuple[jax.Array, jax.Array]:
    """(any finite element, smallest finite element or +inf) of x, in one pass."""
    finite = jnp.isfinite(x)
    lowest = jnp.min(jnp.where(finite, x, jnp.inf)) if want_min else jnp.float32(jnp.inf)
    return jnp.any(finite), lowest


def check_values(x: Any, config: QuantConfig) -> None:
    """Refuses concrete values no scale can represent; traced values pass unchecked.

    Two cases would otherwise quantize silently to something else:

      * no finite element at all (all NaN or ±Inf): there is no bound to derive a scale from, and
        the result would decode to zeros (or saturated values) standing for garbage;
      * a negative value under ``symmetric=True`` with an unsigned format: its grid starts at
        code 0 = 0.0, so every negative value would become 0.

    Inside `jax.jit` (a traced `x`) values cannot be inspected: there an all-NaN block decodes to
    zeros and negatives under a symmetric unsigned format saturate to 0, as the module docstring
    says. `lowbit.quantize` checks each weight before its compiled quantizer runs.

    Args:
      x: [...] float array (not checked if traced).
      config: the config it is about to be quantized with.
    Raises:
      ValueError: saying which case, what was received and how to fix it.
    """
    if isinstance(x, jax.core.Tracer):
        return
    x = jnp.asarray(x)
    if x.size == 0 or not jnp.issubdtype(x.dtype, jnp.floating):
        return  # `_check_input` reports these
    fmt = get_format(config.format)
    unsigned_symmetric = bool(config.symmetric and _unsigned_int(fmt))
    # A concrete x can still meet an enclosing trace (a constant inside a jitted function):
    # evaluate it now rather than stage the reduction into that trace.
    with jax.ensure_compile_time_eval():
        any_finite, lowest = _finite_summary(x, unsigned_symmetric)
    if not bool(any_finite):
        raise ValueError(
            f"quantize got an array of shape {tuple(x.shape)} with no finite value (all NaN or "
            "±Inf): no scale represents it, and quantizing would hide the NaNs as zeros. Fix "
            "the values upstream (e.g. a diverged step) or keep this array in float"
        )
    if unsigned_symmetric and float(lowest) < 0:
        raise ValueError(
            f"format {fmt.name!r} is unsigned and symmetric=True fixes its zero point at code 0, "
            f"so it represents only values >= 0, but this array (shape {tuple(x.shape)}) has "
            f"negative values down to {float(lowest):g}, which would all become 0. Use "
            "symmetric=False (the default for unsigned formats: a zero point per block) or a "
            f"signed format such as {fmt.name[1:]!r}"
        )


def _tile(config: QuantConfig, fmt: Format, shape: tuple[int, ...]) -> tuple[int, ...]:
    if fmt.block_size is None:
        return config.granularity.tile(shape)
    axis = config.granularity.axis if isinstance(config.granularity, PerGroup) else -1
    _check_fixed_block(fmt, config.granularity)
    return PerGroup(fmt.block_size, axis).tile(shape)


def _shard_shape(x: jax.Array) -> tuple[int, ...] | None:
    """The shape of one device's piece of `x`, or None when it is not split (or unknown)."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return tuple(x.sharding.shard_shape(x.shape))
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(spec):
        return None
    sizes = dict(sharding.mesh.shape)
    shape = []
    for n, entry in zip(x.shape, list(spec) + [None] * (x.ndim - len(spec)), strict=True):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        shape.append(n // math.prod(sizes[name] for name in names))
    return tuple(shape)


def check_tiles_within_shards(x: jax.Array, tile: tuple[int, ...]) -> None:
    """Refuses a group that would straddle two devices' pieces of a sharded `x`: the codes of
    one scale would live on two devices, a layout the sharded types cannot express."""
    pieces = _shard_shape(x)
    if pieces is None:
        return
    for axis, (n, piece, t) in enumerate(zip(x.shape, pieces, tile, strict=True)):
        # A block spanning the whole axis is fine: its scale is one reduction across shards.
        if piece != n and t != n and piece % t:
            raise ValueError(
                f"a block of {t} along axis {axis} straddles two shards: axis {axis} "
                f"(size {n}) is split over devices into pieces of {piece}. Choose a group "
                f"size that divides {piece}, or shard another axis of this weight"
            )


def blocks_view(x: jax.Array, tile: tuple[int, ...]) -> jax.Array:
    """x: [n_0, ..., n_k] → [n_0/t_0, ..., n_k/t_k, prod(tile)], one row per block."""
    inter = [d for n, t in zip(x.shape, tile, strict=True) for d in (n // t, t)]
    perm = list(range(0, 2 * x.ndim, 2)) + list(range(1, 2 * x.ndim, 2))
    grid = tuple(n // t for n, t in zip(x.shape, tile, strict=True))
    return x.reshape(inter).transpose(perm).reshape(*grid, math.prod(tile))


def _float_scale(bound_range: jax.Array, denom: float, empty: float = 1.0) -> jax.Array:
    """bound / denom; `empty` where that is zero or not finite (a block with no range)."""
    return _guard_scale(bound_range / denom, denom, empty)


def _range_scale(lo: jax.Array, hi: jax.Array, denom: float) -> jax.Array:
    """(hi - lo) / denom, the asymmetric scale, also where ``hi - lo`` overflows.

    Finite bounds near float32's maximum of opposite signs overflow ``hi - lo``; then the scale
    is ``hi / denom - lo / denom``, clamped to the largest float32 for a one-step grid
    (``uint1``), whose scale cannot span that range (its grid end saturates). A non-finite
    bound still gives the empty scale, as in `_float_scale`.
    """
    width = hi - lo
    overflow = jnp.isinf(width) & jnp.isfinite(lo) & jnp.isfinite(hi)
    split = jnp.minimum(hi / denom - lo / denom, jnp.finfo(jnp.float32).max)
    return _guard_scale(jnp.where(overflow, split, width / denom), denom, 1.0)


def _guard_scale(scale: jax.Array, denom: float, empty: float) -> jax.Array:
    # Near float32's maximum, the grid's ends decoded (`scale * denom`, and past it by the zero
    # point's rounding) can round up to inf: a scale a few ulps smaller keeps every decoded code
    # finite, the largest values saturating instead. Other scales are left bit for bit.
    margin = 2.0**-16
    overshoot = jnp.isfinite(scale) & ~jnp.isfinite(scale * (denom * (1 + margin)))
    scale = jnp.where(overshoot, scale * (1 - margin), scale)
    return jnp.where(jnp.isfinite(scale) & (scale > 0), scale, empty)


def _empty_scale(fmt: Format) -> float:
    # Scale of a block with a zero bound: 1 decodes its zero codes to exact zeros. A grid without
    # a zero level (int1: ±1) would decode them to ±1, so such a block gets scale 0 instead.
    return 1.0 if 0.0 in fmt.levels() else 0.0


def _scales(fmt, config, lo, hi, global_amax):
    """Returns (stored_scale, scale_f32, zero_point or None, tensor_scale or None)."""
    if not config.symmetric:
        denom = fmt.max_value - fmt.min_value
        scale = _range_scale(lo, hi, denom).astype(config.scale_dtype)
        scale32 = scale.astype(jnp.float32)
        zero_point = (fmt.min_value - lo / scale32).astype(config.scale_dtype)
        return scale, scale32, zero_point, None
    amax = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    if fmt.scale_encoding == "e8m0":
        emax = math.floor(math.log2(fmt.max_value))
        safe = jnp.where(jnp.isfinite(amax) & (amax > 0), amax, 0.0)
        # frexp gives safe = m * 2**e with m in [0.5, 1): floor(log2(safe)) = e - 1, exactly.
        _, e = jnp.frexp(safe)
        exponent = jnp.where(safe > 0, e - 1 - emax, -127)
        exponent = jnp.clip(exponent, -127, 127)
        return (exponent + 127).astype(jnp.uint8), jnp.ldexp(jnp.float32(1), exponent), None, None
    if fmt.scale_encoding == "e4m3":
        tensor_scale = _float_scale(global_amax, fmt.max_value * _E4M3_MAX)
        block = jnp.clip(amax / fmt.max_value / tensor_scale, 0.0, _E4M3_MAX)
        block = jnp.where(jnp.isfinite(block), block, 0.0).astype(jnp.float8_e4m3fn)
        block32 = block.astype(jnp.float32)
        scale32 = jnp.where(block32 > 0, block32, 1.0) * tensor_scale
        return block, scale32, None, tensor_scale
    scale = _float_scale(amax, fmt.max_value, _empty_scale(fmt)).astype(config.scale_dtype)
    return scale, scale.astype(jnp.float32), None, None


def _round_stochastic(fmt: Format, y: jax.Array, key: jax.Array) -> jax.Array:
    """Rounds y to a neighbouring grid value with probability proportional to proximity."""
    levels = jnp.asarray(fmt.levels(), jnp.float32)
    y = jnp.clip(y, levels[0], levels[-1])
    upper_idx = jnp.clip(jnp.searchsorted(levels, y, side="left"), 0, levels.shape[0] - 1)
    lower_idx = jnp.clip(upper_idx - 1, 0, levels.shape[0] - 1)
    upper, lower = levels[upper_idx], levels[lower_idx]
    gap = jnp.where(upper > lower, upper - lower, 1.0)
    p_up = jnp.where(upper > lower, (y - lower) / gap, 1.0)
    take_up = jax.random.uniform(key, y.shape) < p_up
    return jnp.where(take_up, upper, lower)


# Scales past this have a reciprocal below float32's smallest normal number. Compiled, XLA
# divides by a broadcast scale as a product with its reciprocal, which the CPU flushes to zero:
# every code of such a block became the zero point (uint3 of values near float32's max).
_HUGE_SCALE = 2.0**100


def _encode(fmt, config, x, scale32, zero_point, key):
    # Both sides by 2**-8 where the scale is huge: exact (a power of two), and the quotient's
    # reciprocal stays normal however it is computed.
    by = jnp.where(scale32 > _HUGE_SCALE, jnp.float32(2.0**-8), jnp.float32(1.0))
    y = (x * by) / (scale32 * by)
    if zero_point is not None:
        y = y + zero_point.astype(jnp.float32)
    # NaN → 0 so no garbage code escapes; ±Inf saturate.
    y = jnp.where(jnp.isnan(y), 0.0, y)
    if config.symmetric:
        # Restricted range: keep the grid symmetric (int8 codes in [-127, 127]), so a symmetric
        # scale never produces the extra negative code of two's complement.
        y = jnp.clip(y, -fmt.max_value, fmt.max_value)
    if config.rounding == "stochastic":
        if key is None:
            raise ValueError("rounding='stochastic' needs a PRNG key: quantize(..., key=key)")
        y = _round_stochastic(fmt, y, key)
    return fmt.encode(y)


def quantize(
    x: jax.Array,
    config: QuantConfig | str | Format | None = None,
    *,
    key: jax.Array | None = None,
    bounds: tuple[jax.Array, jax.Array] | None = None,
    pack_axis: int | None = None,
    **overrides: Any,
) -> QArray:
    """Quantizes a float array.

    Args:
      x: [...] float array (any float dtype; it becomes the QArray's logical dtype).
      config: a `QuantConfig`, or a format name / `Format` (then `overrides` fill the config).
      key: PRNG key, needed for stochastic rounding.
      bounds: explicit `(lo, hi)` per block (shape of the scale), overriding calibration —
        for static activation scales and delayed scaling from an amax history.
      pack_axis: axis to pack sub-byte codes along (default: the last axis of size > 1).
      **overrides: `QuantConfig` fields, e.g. `granularity=PerGroup(64)`.
    Returns:
      A `QArray` with the shape and dtype of `x` (a 0-d `x` gives a 0-d QArray, its one code
      unpacked).
    Raises:
      ValueError: for a non-float or empty input, a 0-d input under a block format, an
        unknown format, a group size that does not divide, an axis out of range, stochastic
        rounding without a key, and (concrete inputs only, see `check_values`) an input with
        no finite value or negative values under a symmetric unsigned format.
    """
    if config is None:
        config = QuantConfig(**{"format": "int8", **overrides})
    elif isinstance(config, str | Format):
        config = QuantConfig(format=config, **overrides)
    elif overrides:
        config = dataclasses.replace(config, **overrides)
    fmt = get_format(config.format)
    x = _check_input(x)
    check_values(x, config)
    if x.ndim == 0:
        return _quantize_scalar(x, fmt, config, key, bounds)
    if isinstance(fmt, GGUFBlockFormat):
        return _quantize_gguf_blocks(x, fmt, config, pack_axis)
    check_tiles_within_shards(x, _tile(config, fmt, x.shape))
    if isinstance(x, jax.core.Tracer):
        return _quantize_tiles(x, config, key, bounds, pack_axis)
    return _quantize_tiles_compiled(x, config, key, bounds, pack_axis)


def _quantize_tiles(
    x: jax.Array,
    config: QuantConfig,
    key: jax.Array | None,
    bounds: tuple[jax.Array, jax.Array] | None,
    pack_axis: int | None,
) -> QArray:
    """`quantize` of an element format's checked input (`x` ``[...]``, at least one axis)."""
    fmt = get_format(config.format)
    logical_shape, logical_dtype = x.shape, x.dtype
    x32 = x.astype(jnp.float32)
    tile = _tile(config, fmt, x.shape)
    grid = tuple(n // t for n, t in zip(x.shape, tile, strict=True))

    blocks = blocks_view(x32, tile)
    if bounds is None:
        calibration = config.calibration
        if isinstance(calibration, MSE):

            def round_trip(b, lo, hi):
                fixed = dataclasses.replace(config, calibration=MinMax(), rounding="nearest")
                _, s32, zp, _ = _scales(fmt, fixed, lo, hi, jnp.max(jnp.abs(hi)))
                codes = _encode(
                    fmt, fixed, b, s32[..., None], None if zp is None else zp[..., None], None
                )
                values = fmt.decode(codes)
                if zp is not None:
                    values = values - zp[..., None].astype(jnp.float32)
                return values * s32[..., None]

            lo, hi = calibration.bounds(
                blocks, fmt=fmt, symmetric=config.symmetric, round_trip=round_trip
            )
        else:
            lo, hi = calibration.bounds(blocks, fmt=fmt, symmetric=config.symmetric)
    else:
        lo = jnp.broadcast_to(jnp.asarray(bounds[0], jnp.float32), grid)
        hi = jnp.broadcast_to(jnp.asarray(bounds[1], jnp.float32), grid)
    global_amax = jnp.max(jnp.maximum(jnp.abs(lo), jnp.abs(hi)))
    stored, scale32, zero_point, tensor_scale = _scales(fmt, config, lo, hi, global_amax)

    codes = _encode(
        fmt,
        config,
        x32,
        broadcast_blocks(scale32, x.shape),
        None if zero_point is None else broadcast_blocks(zero_point, x.shape),
        key,
    )
    packed_axis = None
    if fmt.bits < 8 and config.pack:
        packed_axis = _pack_axis(pack_axis, logical_shape)
        codes = fmt.pack(codes, packed_axis)
    if tensor_scale is not None:
        tensor_scale = tensor_scale.reshape((1,) * len(logical_shape))
    return QArray(
        codes=codes,
        scale=stored,
        zero_point=zero_point,
        tensor_scale=tensor_scale,
        format=fmt.name,
        shape=logical_shape,
        dtype=logical_dtype,
        packed_axis=packed_axis,
        scale_encoding=fmt.scale_encoding,
    )


# A concrete input's quantization as one program a (shape, config): run op by op, a new shape
# compiled some 40 small programs (about 1 s), and every call dispatched each of them. Traced
# inputs take `_quantize_tiles` inline, as part of the caller's program.
_quantize_tiles_compiled = jax.jit(_quantize_tiles, static_argnums=(1, 4))


def _quantize_gguf_blocks(
    x: jax.Array, fmt: GGUFBlockFormat, config: QuantConfig, pack_axis: int | None
) -> QArray:
    """A GGUF block format: the blocks (scales inside) along one axis, as llama.cpp encodes them.

    The block axis is `pack_axis`, else the granularity's axis for `PerGroup`, else axis 0 (the
    contraction axis of a Flax ``[in, out]`` kernel). The QArray's scale is a unit placeholder.
    """
    ndim = x.ndim
    if ndim == 0:
        raise ValueError(f"format {fmt.name!r} needs at least one axis, got a scalar")
    axis = pack_axis
    if axis is None:
        axis = config.granularity.axis if isinstance(config.granularity, PerGroup) else 0
    if not -ndim <= axis < ndim:
        raise ValueError(f"format {fmt.name!r}: block axis {axis} is out of range for {x.shape}")
    axis %= ndim
    if x.shape[axis] % fmt.block.block_size:
        raise ValueError(
            f"format {fmt.name!r} needs axis {axis} of shape {tuple(x.shape)} to be a multiple of "
            f"{fmt.block.block_size} (its block size); use a GGUF type with smaller blocks "
            "(q5_0, q5_1, iq4_nl: 32) or another format for this weight"
        )
    if isinstance(x, jax.core.Tracer):
        codes = fmt.pack(x.astype(jnp.float32), axis)
    else:
        # Concrete: the codec's own compiled, chunked encoder (one compile per row length).
        rows = np.moveaxis(np.asarray(x, np.float32), axis, -1)
        codes = jnp.moveaxis(jnp.asarray(gguf_encode(fmt.ggml_type, rows)), -1, axis)
    return QArray(
        codes=codes,
        scale=jnp.ones((1,) * ndim, jnp.uint8),
        zero_point=None,
        tensor_scale=None,
        format=fmt.name,
        shape=x.shape,
        dtype=x.dtype,
        packed_axis=axis,
    )


def _pack_axis(pack_axis: int | None, shape: tuple[int, ...]) -> int:
    ndim = len(shape)
    if pack_axis is None:
        big = [i for i, n in enumerate(shape) if n > 1]
        return big[-1] if big else ndim - 1
    if not -ndim <= pack_axis < ndim:
        raise ValueError(f"pack_axis={pack_axis} is out of range for shape {shape}")
    return pack_axis % ndim


def dequantize(q: QArray, dtype: Any = None) -> jax.Array:
    """`q.dequantize(dtype)`: the float array a QArray stands for."""
    return q.dequantize(dtype)
