"""`conv_general_dilated` with a quantized kernel.

Fast form: the kernel (rhs) is a QArray whose scale varies only along its output-feature axis
(per output channel or per tensor, no zero point). Then

    conv(x, (c_w) s_w) = conv(x, c_w) * s_w            (weight-only: x stays float)
    conv((c_x - z_x) s_x, c_w s_w) = (conv(c_x, c_w) - z_x conv(1, c_w)) * s_x * s_w

The activation is quantized per tensor (its scale must commute with every window) or, for a
`PerToken` config, per example (one scale per batch element, which a convolution never mixes).
`conv(1, c_w)` counts the kernel taps that fall inside the input at each output position, so
zero padding stays exactly zero for asymmetric activations. XLA on CPU runs int8 x int8 -> int32
and fp8 x fp8 -> f32 convolutions directly; conv operands must share a dtype, so weight-only
codes are cast to the activation dtype (exact for integer codes of up to 8 bits in bfloat16,
float16 and float32). Other layouts use `conv_general_dilated_reference`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.formats import get_format
from lowbit.ops._input_scale import reject_input_scale
from lowbit.ops._operand import (
    active_side,
    check_operand,
    dequantized,
    format_kind,
    from_float,
    from_qarray,
    quantized,
)
from lowbit.qarray import (
    PerChannel,
    PerTensor,
    PerToken,
    QArray,
    quantize,
)


def _specs(lhs, rhs, dimension_numbers):
    return lax.conv_dimension_numbers(tuple(lhs.shape), tuple(rhs.shape), dimension_numbers)


def _activation_granularity(x_shape, batch_axis, config, static):
    if static or isinstance(config.granularity, PerTensor):
        return PerTensor()
    if isinstance(config.granularity, PerToken):
        return PerChannel(axes=(batch_axis,))
    return None


def conv_general_dilated_path(
    lhs: Any,
    rhs: Any,
    *,
    dimension_numbers: Any = None,
    batch_group_count: int = 1,
    **params: Any,
) -> str:
    """Which implementation `conv_general_dilated` uses: ``"float"``,
    ``"weight_only_epilogue"``, ``"int8_int32"``, ``"fp8_f32"``, ``"codes_f32"`` or
    ``"reference"``. Static."""
    if not quantized(rhs):
        return "reference" if quantized(lhs) else "float"
    if quantized(lhs) or batch_group_count != 1 or rhs.zero_point is not None:
        return "reference"
    specs = _specs(lhs, rhs, dimension_numbers)
    out_axis = specs.rhs_spec[0]
    if any(n != 1 for a, n in enumerate(rhs.scale.shape) if a != out_axis):
        return "reference"
    wkind = format_kind(rhs.fmt)
    if rhs.activation is None:
        return "weight_only_epilogue" if wkind != "grid" else "codes_f32"
    config = rhs.activation
    fmt = get_format(config.format)
    static = rhs.activation_bounds is not None
    if (
        fmt.block_size is not None
        or _activation_granularity(lhs.shape, specs.lhs_spec[0], config, static) is None
    ):
        return "reference"
    xkind = format_kind(fmt)
    if xkind == wkind == "int":
        return "int8_int32"
    if xkind == wkind == "fp8":
        return "fp8_f32"
    return "codes_f32"


def quantize_conv_input(x, rhs, specs):
    """Quantizes a convolution input as `rhs.activation` asks (per tensor / per example)."""
    config = rhs.activation
    static = rhs.activation_bounds is not None
    granularity = _activation_granularity(x.shape, specs.lhs_spec[0], config, static)
    bounds = None if not static else (rhs.activation_bounds[0], rhs.activation_bounds[1])
    return quantize(x, config, bounds=bounds, granularity=granularity, pack=False)


def _to_out(a: jax.Array, axis: int, out_axis: int, out_ndim: int) -> jax.Array:
    """Per-block values varying only along `axis` → broadcastable along `out_axis`."""
    flat = a.reshape(-1) if a.shape[axis] == a.size else a.reshape(1)
    shape = [1] * out_ndim
    shape[out_axis] = flat.shape[0]
    return flat.reshape(shape)


def _forward(lhs, rhs, params):
    path = conv_general_dilated_path(lhs, rhs, **params)
    if path == "reference":
        return conv_general_dilated_reference(lhs, rhs, **params)
    preferred = params.get("preferred_element_type")
    out_dtype = jnp.dtype(preferred if preferred is not None else lhs.dtype)
    specs = _specs(lhs, rhs, params.get("dimension_numbers"))
    conv_params = dict(params, dimension_numbers=specs)
    x = from_float(lhs)
    if rhs.activation is not None:
        x = from_qarray(quantize_conv_input(lhs, rhs, specs))
    w = from_qarray(rhs)
    if x.kind == w.kind == "int":
        xv, wv, acc_dtype = x.values, w.values, jnp.int32
    elif x.kind == w.kind == "fp8":
        xv, wv, acc_dtype = x.values, w.values, jnp.float32
    elif x.kind == "float" and w.kind != "grid":
        xv, wv, acc_dtype = x.values, w.values.astype(lhs.dtype), jnp.float32
    else:
        xv, wv, acc_dtype = x.values.astype(jnp.float32), w.values.astype(jnp.float32), jnp.float32
    conv = functools.partial(
        lax.conv_general_dilated,
        **dict(
            conv_params,
            preferred_element_type=acc_dtype,
            precision=None if acc_dtype == jnp.int32 else params.get("precision"),
        ),
    )
    acc = conv(xv, wv).astype(jnp.float32)
    out_ndim = acc.ndim
    n_axis, c_axis = specs.out_spec[0], specs.out_spec[1]
    if x.zero_point is not None:
        taps = conv(jnp.ones_like(xv), wv).astype(jnp.float32)
        acc = acc - _to_out(x.zero_point, specs.lhs_spec[0], n_axis, out_ndim) * taps
    if x.scale is not None:
        acc = acc * _to_out(x.scale, specs.lhs_spec[0], n_axis, out_ndim)
    acc = acc * _to_out(w.scale, specs.rhs_spec[0], c_axis, out_ndim)
    return acc.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ste_conv(lhs, rhs, params):
    return _forward(lhs, rhs, dict(params))


def _ste_fwd(lhs, rhs, params):
    return _forward(lhs, rhs, dict(params)), (lhs, rhs)


def _ste_bwd(params, residuals, g):
    # Straight-through the activation's rounding: the gradient of the weight-only convolution.
    lhs, rhs = residuals
    weight = dataclasses.replace(rhs, activation=None, activation_bounds=None)
    plain = dict(params, preferred_element_type=None)
    (dx,) = jax.vjp(lambda x: _forward(x, weight, plain), lhs)[1](g.astype(lhs.dtype))
    return dx, None


_ste_conv.defvjp(_ste_fwd, _ste_bwd)


def hashable_params(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    def freeze(v):
        if isinstance(v, list):
            return tuple(freeze(a) for a in v)
        return v

    return tuple(sorted((k, freeze(v)) for k, v in params.items()))


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array | QArray,
    window_strides: Any,
    padding: Any,
    lhs_dilation: Any = None,
    rhs_dilation: Any = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
    """`lax.conv_general_dilated` with a QArray kernel (weight-only, or w8a8 when the kernel's
    `activation` config is set: per-tensor or per-example dynamic scales, or static bounds).

    Args:
      lhs: [N, C, spatial...] float input (layout per `dimension_numbers`).
      rhs: [O, I, spatial...] QArray kernel with per-output-channel or per-tensor scales.
      Others: as `lax.conv_general_dilated` (also its jaxpr equation params).
    Returns:
      The convolution, dtype `preferred_element_type` or the input's.
    Raises:
      TypeError: for a non-float input.
    """
    params = dict(
        window_strides=window_strides,
        padding=padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )
    check_operand(lhs, "conv_general_dilated", "lhs")
    reject_input_scale("conv_general_dilated", lhs, rhs)
    if not quantized(lhs) and not quantized(rhs):
        return lax.conv_general_dilated(lhs, rhs, **params)
    if active_side(lhs, rhs)[0] == "lhs":
        return _ste_conv(lhs, rhs, hashable_params(params))
    return _forward(lhs, rhs, params)


def conv_general_dilated_reference(
    lhs: jax.Array | QArray, rhs: jax.Array | QArray, **params: Any
) -> jax.Array:
    """Dequantize-then-`lax.conv_general_dilated`; a float input facing a kernel with an
    activation config is quantized as `conv_general_dilated` does first (params as lax's)."""
    preferred = params.get("preferred_element_type")
    float_dtype = rhs.dtype if quantized(lhs) else lhs.dtype
    out_dtype = jnp.dtype(preferred if preferred is not None else float_dtype)
    if active_side(lhs, rhs)[0] == "lhs":
        specs = _specs(lhs, rhs, params.get("dimension_numbers"))
        if (
            _activation_granularity(
                lhs.shape, specs.lhs_spec[0], rhs.activation, rhs.activation_bounds is not None
            )
            is None
        ):
            raise ValueError(
                f"activation granularity {rhs.activation.granularity!r} does not commute with "
                "a convolution; accepted: PerTensor(), PerToken() (one scale per example)"
            )
        lhs = quantize_conv_input(lhs, rhs, specs).dequantize(lhs.dtype)
    lhs_f = dequantized(lhs)
    rhs_f = dequantized(rhs, lhs_f.dtype)
    out = lax.conv_general_dilated(lhs_f, rhs_f, **dict(params, preferred_element_type=None))
    return out.astype(out_dtype)
