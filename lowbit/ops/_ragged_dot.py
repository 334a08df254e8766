"""`ragged_dot_general` with quantized expert weights (mixture-of-experts layers).

Fast form: `lhs: [m, k]` rows sorted by expert, `rhs: [experts, k, n]` (any order of its three
axes), rows grouped by `group_sizes: [experts]`, the ragged axis being the lhs free axis. The
weight scale may vary along the expert and output axes (per expert, per channel) but not along
the contraction; an activation is quantized per row (token) or per tensor. Then

    out[m, n] = s_x[m] s_w[e(m), n] (sum_k v_x v_w - z_w sum_k v_x - z_x sum_k v_w + k z_x z_w)

with one `lax.ragged_dot_general` on stored values (int8 x int8 -> int32 on CPU, fp8 -> f32,
float x codes -> f32) and per-row scales gathered by the row's expert `e(m)`. Other layouts use
`ragged_dot_general_reference` (dequantize, then the float op).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.formats import get_format
from lowbit.ops._dims import expand_axis
from lowbit.ops._input_scale import reject_input_scale
from lowbit.ops._operand import (
    activation_scale_shape,
    active_side,
    as_operand,
    check_operand,
    core_dtypes,
    dequantized,
    format_kind,
    product_dtype,
    quantize_activation,
    quantized,
    reference_product,
)
from lowbit.qarray import QArray

BASIC_DIMENSION_NUMBERS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)


def _check(lhs, rhs):
    if quantized(lhs) and lhs.activation is not None:
        raise ValueError(
            "ragged_dot_general quantizes activations only for a QArray rhs (the expert weights); "
            f"got an lhs {lhs!r} with an activation config"
        )
    check_operand(lhs, "ragged_dot_general", "lhs")
    check_operand(rhs, "ragged_dot_general", "rhs")


def _axes(dims, lhs_shape, rhs_shape):
    """(lhs contracting, lhs ragged, rhs contracting, rhs group, rhs free) for the fast form,
    or None."""
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    if len(lhs_shape) != 2 or len(rhs_shape) != 3 or lb or rb or len(lc) != 1:
        return None
    if len(dims.lhs_ragged_dimensions) != 1 or len(dims.rhs_group_dimensions) != 1:
        return None
    ragged, group = dims.lhs_ragged_dimensions[0], dims.rhs_group_dimensions[0]
    if ragged == lc[0] or group == rc[0]:
        return None
    free = 3 - group - rc[0]
    return lc[0], ragged, rc[0], group, free


def ragged_dot_general_path(
    lhs: Any,
    rhs: Any,
    group_sizes: Any = None,
    ragged_dot_dimension_numbers: Any = BASIC_DIMENSION_NUMBERS,
    **options: Any,
) -> str:
    """Which implementation `ragged_dot_general` uses: ``"float"``, ``"weight_only_epilogue"``,
    ``"int8_int32"``, ``"fp8_f32"``, ``"codes_f32"`` or ``"reference"``. Static.

    Takes the arguments of `ragged_dot_general` (an equation's params as they are); of its
    `options` only `group_offset` (set: ``"reference"``) matters.
    """
    lq, rq = quantized(lhs), quantized(rhs)
    if not lq and not rq:
        return "float"
    axes = _axes(ragged_dot_dimension_numbers, lhs.shape, rhs.shape)
    if axes is None or options.get("group_offset") is not None or not rq:
        return "reference"
    lc, _, rc, _, _ = axes
    if rhs.scale.shape[rc] != 1:
        return "reference"
    wkind = format_kind(rhs.fmt)
    if lq:
        xkind, xscale = format_kind(lhs.fmt), tuple(lhs.scale.shape)
    elif rhs.activation is None:
        return "weight_only_epilogue"
    else:
        xkind = format_kind(get_format(rhs.activation.format))
        try:
            xscale = activation_scale_shape(
                lhs.shape, (lc,), rhs.activation, rhs.activation_bounds is not None
            )
        except ValueError:
            return "reference"
    if xscale[lc] != 1:
        return "reference"
    if xkind == wkind == "int":
        return "int8_int32"
    if xkind == wkind == "fp8":
        return "fp8_f32"
    return "codes_f32"


def _row_groups(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """Expert index of each row, clipped to a valid index, and whether the row is in a group."""
    ends = jnp.cumsum(group_sizes)
    index = jnp.arange(rows, dtype=ends.dtype)
    expert = jnp.searchsorted(ends, index, side="right")
    return jnp.minimum(expert, group_sizes.shape[0] - 1), index < ends[-1]


def _to_rows(a, axes, expert, shape):
    """A per-block array of the weight, constant along its contraction → per row [m, n]
    (gathered by each row's expert)."""
    _, _, rc, group, free = axes
    a = expand_axis(expand_axis(a, group, shape[group]), free, shape[free])
    return jnp.transpose(a, (group, free, rc))[..., 0][expert]


def _x_rows(a, lc, rows):
    """A per-block array of the lhs, constant along its contraction → [m, 1]."""
    a = a if lc == 1 else a.T
    return expand_axis(a, 0, rows)


def ragged_dot_general(
    lhs: jax.Array | QArray,
    rhs: jax.Array | QArray,
    group_sizes: jax.Array,
    ragged_dot_dimension_numbers: Any = BASIC_DIMENSION_NUMBERS,
    precision: Any = None,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
    out_sharding: Any = None,
) -> jax.Array:
    """`lax.ragged_dot_general` with a QArray expert weight (weight-only, or w8a8 when the
    weight's `activation` config is set: per-token dynamic or static activation bounds).

    Args:
      lhs: [m, k] float tokens (rows grouped by expert), or a QArray.
      rhs: [experts, k, n] QArray (per expert, per output channel scales), or float.
      group_sizes: [experts] int32 rows per expert.
      ragged_dot_dimension_numbers, precision, group_offset, out_sharding: as in `lax`.
      preferred_element_type: output dtype (default: the float operand's dtype).
    Returns:
      [m, n]; rows past `sum(group_sizes)` are zero, as in `lax.ragged_dot`.
    Raises:
      TypeError / ValueError: for a non-float operand or an lhs with an activation config.
    """
    _check(lhs, rhs)
    reject_input_scale("ragged_dot_general", lhs, rhs)
    side, _ = active_side(lhs, rhs)
    if not quantized(lhs) and not quantized(rhs):
        options = _lax_options(precision, preferred_element_type, group_offset, out_sharding)
        return lax.ragged_dot_general(
            lhs, rhs, group_sizes, ragged_dot_dimension_numbers, **options
        )
    static = (ragged_dot_dimension_numbers, precision, preferred_element_type, out_sharding)
    if side == "lhs":
        return _ste_ragged(lhs, rhs, group_sizes, group_offset, *static)
    return _forward(lhs, rhs, group_sizes, group_offset, *static)


def _forward(lhs, rhs, group_sizes, group_offset, dims, precision, preferred, out_sharding):
    path = ragged_dot_general_path(lhs, rhs, group_sizes, dims, group_offset=group_offset)
    if path == "reference":
        options = _lax_options(precision, preferred, group_offset, out_sharding)
        return ragged_dot_general_reference(lhs, rhs, group_sizes, dims, **options)
    out_dtype = product_dtype(lhs, rhs, preferred)
    axes = _axes(dims, lhs.shape, rhs.shape)
    lc = axes[0]
    if active_side(lhs, rhs)[0] == "lhs":
        lhs = quantize_activation(lhs, (lc,), rhs.activation, rhs.activation_bounds)
    x, w = as_operand(lhs), as_operand(rhs)
    xdtype, wdtype, acc_dtype = core_dtypes(x.kind, w.kind)
    xv, wv = x.values, w.values
    if xdtype is not None:
        xv, wv = xv.astype(xdtype), wv.astype(wdtype)
    acc = lax.ragged_dot_general(
        xv,
        wv,
        group_sizes,
        dims,
        precision=None if acc_dtype == jnp.int32 else precision,
        preferred_element_type=acc_dtype,
        **_sharding_kwargs(out_sharding),
    ).astype(jnp.float32)
    expert, valid = _row_groups(group_sizes, acc.shape[0])
    to_rows = lambda a: _to_rows(a, axes, expert, rhs.shape)
    x_rows = lambda a: _x_rows(a, lc, acc.shape[0])
    sum_dtype = jnp.int32 if acc_dtype == jnp.int32 else jnp.float32
    if w.zero_point is not None:
        xsum = jnp.sum(x.values.astype(sum_dtype), axis=lc, keepdims=True).astype(jnp.float32)
        acc = acc - to_rows(w.zero_point) * x_rows(xsum)
    if x.zero_point is not None:
        wsum = jnp.sum(w.values.astype(sum_dtype), axis=axes[2], keepdims=True)
        acc = acc - x_rows(x.zero_point) * to_rows(wsum.astype(jnp.float32))
    if x.zero_point is not None and w.zero_point is not None:
        k = float(lhs.shape[lc])
        acc = acc + k * x_rows(x.zero_point) * to_rows(w.zero_point)
    if x.scale is not None:
        acc = acc * x_rows(x.scale)
    acc = acc * to_rows(w.scale)
    return jnp.where(valid[:, None], acc, 0.0).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ste_ragged(lhs, rhs, group_sizes, group_offset, dims, precision, preferred, out_sharding):
    return _forward(lhs, rhs, group_sizes, group_offset, dims, precision, preferred, out_sharding)


def _ste_fwd(lhs, rhs, group_sizes, group_offset, dims, precision, preferred, out_sharding):
    out = _forward(lhs, rhs, group_sizes, group_offset, dims, precision, preferred, out_sharding)
    return out, (lhs, rhs, group_sizes, group_offset)


def _ste_bwd(dims, precision, preferred, out_sharding, residuals, g):
    # Straight-through the activation's rounding: the gradient of the weight-only product.
    lhs, rhs, group_sizes, group_offset = residuals
    weight = dataclasses.replace(rhs, activation=None, activation_bounds=None)
    fn = lambda x: _forward(x, weight, group_sizes, group_offset, dims, precision, None, None)
    (dx,) = jax.vjp(fn, lhs)[1](g.astype(lhs.dtype))
    return dx, None, None, None


_ste_ragged.defvjp(_ste_fwd, _ste_bwd)


def ragged_dot_general_reference(
    lhs: jax.Array | QArray,
    rhs: jax.Array | QArray,
    group_sizes: jax.Array,
    ragged_dot_dimension_numbers: Any = BASIC_DIMENSION_NUMBERS,
    **options: Any,
) -> jax.Array:
    """Dequantize-then-`lax.ragged_dot_general`; a float lhs facing a weight with an
    activation config is quantized exactly as `ragged_dot_general` does first.

    Args:
      lhs, rhs, group_sizes, ragged_dot_dimension_numbers: as `ragged_dot_general`.
      **options: `precision`, `preferred_element_type`, `group_offset`, `out_sharding`, as
        `ragged_dot_general`.
    Returns:
      As `ragged_dot_general`: [m, n] for the basic layout.
    """
    _check(lhs, rhs)
    # The requested output dtype is not the accumulation dtype (`reference_product` widens it).
    out_dtype = product_dtype(lhs, rhs, options.pop("preferred_element_type", None))
    out_sharding = options.pop("out_sharding", None)
    (lc, _), _ = ragged_dot_dimension_numbers.dot_dimension_numbers
    if active_side(lhs, rhs)[0] == "lhs":
        lhs = quantize_activation(lhs, lc, rhs.activation, rhs.activation_bounds).dequantize(
            lhs.dtype
        )
    lhs_f, rhs_f = dequantized(lhs), dequantized(rhs)
    return reference_product(
        lax.ragged_dot_general,
        lhs_f,
        rhs_f,
        group_sizes,
        ragged_dot_dimension_numbers,
        out_dtype=out_dtype,
        **options,
        **_sharding_kwargs(out_sharding),
    )


def ragged_dot(
    lhs: jax.Array | QArray,
    rhs: jax.Array | QArray,
    group_sizes: jax.Array,
    *args: Any,
    **options: Any,
) -> jax.Array:
    """`lax.ragged_dot` with quantized experts: `lhs: [m, k]`, `rhs: [experts, k, n]` QArray,
    `group_sizes: [experts]` → [m, n]. See `ragged_dot_general`.

    `precision`, `preferred_element_type`, `group_offset`: by position (in `lax.ragged_dot`'s
    order, which is `ragged_dot_general`'s after the dimension numbers) or by keyword.
    """
    return ragged_dot_general(lhs, rhs, group_sizes, BASIC_DIMENSION_NUMBERS, *args, **options)


def _sharding_kwargs(out_sharding: Any) -> dict[str, Any]:
    # `lax.ragged_dot_general` takes `out_sharding` only from JAX 0.10 on; pass it only when set.
    return {} if out_sharding is None else {"out_sharding": out_sharding}


def _lax_options(
    precision: Any, preferred_element_type: Any, group_offset: Any, out_sharding: Any
) -> dict[str, Any]:
    """The keyword arguments of `lax.ragged_dot_general` for these options (`out_sharding`
    only when set, see `_sharding_kwargs`)."""
    return dict(
        precision=precision,
        preferred_element_type=preferred_element_type,
        group_offset=group_offset,
        **_sharding_kwargs(out_sharding),
    )
