"""Training twin of `conv_general_dilated`: a `QatWeight` kernel, straight-through backward.

Forward: `conv_general_dilated` on `QatWeight.served()`. Backward: the float convolution
transposes, d input with the dequantized kernel and d value with the fake-quantized input.
Quantized backward convolutions are not provided: a kernel with a `gradient` config is refused
(by `qat_conv_general_dilated` in `_qat_weight`, which runs this on the weight's parts).
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from lowbit.ops._conv import conv_general_dilated, quantize_conv_input


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def qat_conv(x, value, served, params):
    """`conv_general_dilated(x, served, **dict(params))` with the backward above; `params` as
    `hashable_params` gives them."""
    return conv_general_dilated(x, served, **dict(params))


def _qat_conv_fwd(x, value, served, params):
    return qat_conv(x, value, served, params), (x, value, served)


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


qat_conv.defvjp(_qat_conv_fwd, _qat_conv_bwd)
