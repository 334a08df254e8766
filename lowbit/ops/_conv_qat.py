"""Training twin of `conv_general_dilated`: a `QatWeight` kernel, straight-through backward.

Forward: `conv_general_dilated` on `QatWeight.served()`. Backward: the float convolution
transposes, d input with the dequantized kernel and d value with the fake-quantized input.
Quantized backward convolutions are not provided: a kernel with a `gradient` config is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax

from lowbit.ops._conv import conv_general_dilated, hashable_params, quantize_conv_input
from lowbit.ops._qat_weight import QatWeight
from lowbit.qarray import QArray


def qat_conv_general_dilated(lhs: jax.Array, rhs: QatWeight, **params: Any) -> jax.Array:
    """`conv_general_dilated` with a `QatWeight` kernel: quantized forward, straight-through
    float backward (d input = conv transpose with the dequantized kernel, d value with the
    fake-quantized input).

    Raises:
      TypeError: unless `rhs` is a QatWeight and `lhs` a float array.
      ValueError: if the weight has a `gradient` config (quantized backward convolutions are
        not provided; use gradient=None for convolution kernels).
    """
    if not isinstance(rhs, QatWeight) or isinstance(lhs, QatWeight | QArray):
        raise TypeError(
            "qat_conv_general_dilated needs a float lhs and a QatWeight rhs, got "
            f"{type(lhs).__name__} and {type(rhs).__name__}"
        )
    if rhs.gradient is not None:
        raise ValueError(
            f"gradient={rhs.gradient!r} on a convolution kernel: quantized backward products "
            "exist for dot_general and ragged_dot only; set gradient=None for this kernel"
        )
    return _qat_conv(lhs, rhs.value, rhs.served(), hashable_params(params))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _qat_conv(x, value, served, params):
    return conv_general_dilated(x, served, **dict(params))


def _qat_conv_fwd(x, value, served, params):
    return _qat_conv(x, value, served, params), (x, value, served)


def _qat_conv_bwd(params, residuals, g):
    x, value, served = residuals
    specs = lax.conv_dimension_numbers(x.shape, value.shape, dict(params).get("dimension_numbers"))
    xq = x
    if served.activation is not None:
        xq = quantize_conv_input(x, served, specs).dequantize(x.dtype)
    wq = served.dequantize(value.dtype)
    plain = dict(params, preferred_element_type=None)
    _, vjp = jax.vjp(lambda a, b: lax.conv_general_dilated(a, b, **plain), xq, wq)
    dx, dw = vjp(g.astype(x.dtype))
    return dx.astype(x.dtype), dw.astype(value.dtype), None


_qat_conv.defvjp(_qat_conv_fwd, _qat_conv_bwd)
