"""Operands of a quantized dot: what enters the core product, and the activation quantizer.

Every operand is brought to the form `x = (values - zero_point) * scale`, where `values` is what
the core `lax.dot_general` reads:

  * ``"float"``: a float array (scale 1, no zero point);
  * ``"int"``:   int8 integer codes (uint8 codes are shifted by -128 into int8 and the shift is
                 folded into the zero point, so every integer format up to 8 bits meets an int8
                 matmul);
  * ``"fp8"``:   float8 codes as stored (fp8 matmuls read them directly);
  * ``"grid"``:  the decoded grid values as float32 (other formats, e.g. NF4 or fp4).

The scale is per block (`QArray.scale_values()`, tensor scale folded in), the zero point per
block in code units.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import Format, IntFormat, get_format
from lowbit.qarray import PerChannel, PerGroup, PerTensor, PerToken, QArray, QuantConfig, quantize

KINDS = ("float", "int", "fp8", "grid")


def format_kind(fmt: Format) -> str:
    """How codes of `fmt` enter a matmul: ``"int"``, ``"fp8"`` or ``"grid"``."""
    if isinstance(fmt, IntFormat):
        return "int"
    dtype = np.dtype(fmt.code_dtype)
    if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        return "fp8"
    return "grid"


def quantized(x: Any) -> bool:
    """Whether an operand of a quantized product is stored quantized (a `QArray`), else a
    float array. The one place `lowbit.ops`' products tell their operands' kinds apart."""
    return isinstance(x, QArray)


def check_operand(x: Any, op: str, name: str) -> None:
    """Raises unless `x` (argument `name` of `op`) is a float array or a `QArray`.

    Raises:
      TypeError: naming the op, the argument and what it got.
    """
    if quantized(x):
        return
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{op} {name} must be a float array or a QArray, got "
            f"{type(x).__name__} with dtype {getattr(x, 'dtype', None)}"
        )


def active_side(lhs: Any, rhs: Any) -> tuple[str | None, QArray | None]:
    """Which float operand gets quantized on the fly (``"lhs"`` / ``"rhs"``), and the QArray
    whose `activation` config asks for it; (None, None) when neither is."""
    lq, rq = quantized(lhs), quantized(rhs)
    if rq and not lq and rhs.activation is not None:
        return "lhs", rhs
    if lq and not rq and lhs.activation is not None:
        return "rhs", lhs
    return None, None


def dequantized(x: Any, dtype: Any = None) -> jax.Array:
    """`x` as a float array: a QArray dequantized (to `dtype`, default its logical dtype), a
    float array as it is (cast to `dtype` when given)."""
    if quantized(x):
        return x.dequantize() if dtype is None else x.dequantize(dtype)
    return x if dtype is None else x.astype(dtype)


@dataclasses.dataclass(frozen=True)
class Operand:
    """One side of a dot in the form `(values - zero_point) * scale` (see module docstring).

    Attributes:
      values: [*shape] float, int8 or float8 array read by the core matmul.
      kind: one of KINDS.
      shape: logical shape.
      scale: [s_0, ..., s_{n-1}] float32 per-block scale, or None (float operand).
      zero_point: like `scale`, float32 in code units, or None.
    """

    values: jax.Array
    kind: str
    shape: tuple[int, ...]
    scale: jax.Array | None = None
    zero_point: jax.Array | None = None


def from_float(x: jax.Array) -> Operand:
    return Operand(values=x, kind="float", shape=tuple(x.shape))


def from_qarray(q: QArray) -> Operand:
    """Splits a QArray into matmul-ready values, scale and zero point."""
    fmt = q.fmt
    kind = format_kind(fmt)
    codes = q.unpacked_codes()
    zero_point = None if q.zero_point is None else q.zero_point.astype(jnp.float32)
    if kind == "int":
        if fmt.bits == 8 and fmt.is_signed:
            values = codes
        elif fmt.qmax <= 127:
            values = fmt.to_int(codes).astype(jnp.int8)
        else:
            # uint8: x = (c - z) s = ((c - 128) - (z - 128)) s.
            values = (fmt.to_int(codes) - 128).astype(jnp.int8)
            base = jnp.zeros(q.scale.shape, jnp.float32) if zero_point is None else zero_point
            zero_point = base - 128.0
    elif kind == "fp8":
        values = codes
    else:
        values = fmt.decode(codes)
    return Operand(
        values=values,
        kind=kind,
        shape=tuple(q.shape),
        scale=q.scale_values(),
        zero_point=zero_point,
    )


def as_operand(x: Any) -> Operand:
    """`x` (a QArray or a float array) in the form the core product reads."""
    return from_qarray(x) if quantized(x) else from_float(x)


def activation_granularity(
    shape: Sequence[int], contracting: Sequence[int], config: QuantConfig, static: bool
):
    """The granularity an operand quantized on the fly gets in a dot.

    Per token means one scale per index of the non-contracting axes, so the scale factors out
    of the contraction. `PerGroup(size)` (and block formats) group the last contracting axis
    (one scale per token and group), which the grouped dot handles. Static bounds are one pair
    for the whole tensor.

    Raises:
      ValueError: for PerChannel / PerBlock activation granularities.
    """
    fmt = get_format(config.format)
    ndim = len(shape)
    keep = tuple(a for a in range(ndim) if a not in set(contracting))
    if fmt.block_size is not None or isinstance(config.granularity, PerGroup):
        if not contracting:
            raise ValueError(
                f"activation granularity {config.granularity!r} (format {fmt.name!r}) groups the "
                "contracting axis, but this operand has none"
            )
        size = fmt.block_size or config.granularity.size
        return PerGroup(size, contracting[-1])
    if static or isinstance(config.granularity, PerTensor):
        return PerTensor()
    if isinstance(config.granularity, PerToken):
        return PerChannel(axes=keep) if keep else PerTensor()
    raise ValueError(
        f"activation granularity {config.granularity!r} is not supported for an operand "
        "quantized inside a dot; accepted: PerTensor(), PerToken(), PerGroup(size) along the "
        "contracting axis"
    )


def activation_scale_shape(
    shape: Sequence[int], contracting: Sequence[int], config: QuantConfig, static: bool
) -> tuple[int, ...]:
    """Static scale shape `quantize_activation` produces (for choosing a path)."""
    tile = activation_granularity(shape, contracting, config, static).tile(tuple(shape))
    return tuple(n // t for n, t in zip(shape, tile, strict=True))


def quantize_activation(
    x: jax.Array,
    contracting: Sequence[int],
    config: QuantConfig,
    bounds: jax.Array | None = None,
    *,
    key: jax.Array | None = None,
) -> QArray:
    """Quantizes the float operand of a dot so its scale factors out of the contraction.

    Args:
      x: [...] float operand.
      contracting: its contracting axes in the dot.
      config: the activation `QuantConfig` (format, symmetric, calibration, rounding).
      bounds: [2] float32 static `(lo, hi)`, or None for dynamic (per call) bounds.
      key: PRNG key for stochastic rounding.
    Returns:
      An unpacked `QArray` of `x`'s shape.
    Raises:
      ValueError: for an unsupported granularity, or stochastic rounding without a key.
    """
    granularity = activation_granularity(x.shape, contracting, config, bounds is not None)
    pair = None if bounds is None else (bounds[0], bounds[1])
    return quantize(x, config, key=key, bounds=pair, granularity=granularity, pack=False)


def product_dtype(lhs: Any, rhs: Any, preferred_element_type: Any) -> np.dtype:
    """The output dtype of a product with quantized operands: `preferred_element_type`, else the
    float operand's dtype, else the operands' logical dtypes promoted."""
    if preferred_element_type is not None:
        return jnp.dtype(preferred_element_type)
    floats = [x.dtype for x in (lhs, rhs) if not quantized(x)]
    return jnp.dtype(floats[0] if floats else jnp.result_type(lhs.dtype, rhs.dtype))


def reference_product(
    op: Callable[..., jax.Array],
    lhs_f: jax.Array,
    rhs_f: jax.Array,
    *args: Any,
    out_dtype: Any,
    **kwargs: Any,
) -> jax.Array:
    """``op(lhs_f, rhs_f, *args, **kwargs)`` on dequantized operands, as a reference path
    computes it: accumulated in at least `out_dtype` (never narrower than the operands), then
    cast to `out_dtype`.

    Args:
      op: the float `lax` product (`lax.dot_general`, `lax.ragged_dot_general`).
      lhs_f, rhs_f: the dequantized operands.
      *args, **kwargs: the product's other arguments (not `preferred_element_type`).
      out_dtype: the output dtype.
    """
    accumulate = jnp.promote_types(jnp.result_type(lhs_f, rhs_f), out_dtype)
    return op(lhs_f, rhs_f, *args, preferred_element_type=accumulate, **kwargs).astype(out_dtype)


def core_dtypes(lkind: str, rkind: str) -> tuple[Any, Any, Any]:
    """The core product of two operands of these kinds (`KINDS`): (lhs values dtype, or None
    to keep them as stored; rhs ...; accumulation dtype). int8 x int8 accumulates in int32,
    fp8 x fp8 and anything with a float operand in float32 as stored; other pairs are cast to
    float32 first."""
    if lkind == rkind == "int":
        return None, None, jnp.int32
    if lkind == rkind == "fp8" or "float" in (lkind, rkind):
        return None, None, jnp.float32
    return jnp.float32, jnp.float32, jnp.float32
