"""Training twin of `ragged_dot_general`: a `QatWeight` of experts, straight-through backward.

Forward: `ragged_dot_general` on `QatWeight.served()`. Backward (see `_qat`): d tokens =
`g . dequantized experts^T` per row's expert, d value[e] = fake-quantized tokens of expert e
transposed times their `g`. With a `gradient` config both backward products run on quantized
operands: d tokens as an int8 / fp8 ragged dot (`g` per token, experts per (expert, k) channel),
d value as a ragged contraction over rows (tokens and `g` per column, so the scales stay
constant along the contracted rows). `qat_ragged_dot_general` (in `_qat_weight`) checks the
operands and runs this on the weight's parts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.ops._operand import core_dtypes, from_qarray, quantize_activation
from lowbit.ops._qat import companion_config, derived_key, fake_quantized_activation
from lowbit.ops._ragged_dot import BASIC_DIMENSION_NUMBERS, ragged_dot_general
from lowbit.qarray import PerChannel, quantize


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def qat_ragged(x, value, served, group_sizes, key, dims, gradient, options):
    """`ragged_dot_general(x, served, group_sizes, dims, **options)` with the backward above."""
    return ragged_dot_general(x, served, group_sizes, dims, **options)


def _qat_ragged_fwd(x, value, served, group_sizes, key, dims, gradient, options):
    out = qat_ragged(x, value, served, group_sizes, key, dims, gradient, options)
    return out, (x, value, served, group_sizes, key)


def _qat_ragged_bwd(dims, gradient, options, residuals, g):
    x, value, served, group_sizes, key = residuals
    (lc, _), _ = dims.dot_dimension_numbers
    xq = fake_quantized_activation(x, lc, served)
    wq = served.dequantize(value.dtype)
    precision = options.get("precision")
    if gradient is not None and dims == BASIC_DIMENSION_NUMBERS:
        dx, dw = _quantized_ragged_backward(xq, wq, group_sizes, g, gradient, key, precision)
    else:
        fn = lambda a, b: lax.ragged_dot_general(
            a, b, group_sizes, dims, precision=precision, preferred_element_type=jnp.float32
        )
        _, vjp = jax.vjp(fn, xq, wq)
        dx, dw = vjp(g.astype(jnp.float32))
    return dx.astype(x.dtype), dw.astype(value.dtype), None, None, None


qat_ragged.defvjp(_qat_ragged_fwd, _qat_ragged_bwd)

# d w[e] = sum over the rows m of expert e of x[m]^T g[m]: the rows are contracted, raggedly.
_RAGGED_CONTRACTION = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(),
)


def _quantized_ragged_backward(x, w, group_sizes, g, gradient, key, precision):
    """Quantized backward of `ragged_dot(x [m, k], w [e, k, n])` for the basic layout.

    d x = g . w[e(m)]^T runs as a ragged dot with `g` per token and `w` per (expert, k)
    channel; d w runs the ragged contraction over rows with `x` and `g` per column (scales
    constant along the contracted rows).
    """
    if gradient.rounding == "stochastic" and key is None:
        key = derived_key(g, x.shape, w.shape)
    keys = (None, None) if key is None else tuple(jax.random.split(key))
    companion = companion_config(gradient)
    gq = quantize_activation(g, (1,), gradient, key=keys[0])
    wt = jnp.swapaxes(w, 1, 2)  # [e, n, k]: contract n
    wq = quantize_activation(wt, (1,), companion)
    dx = ragged_dot_general(
        gq,
        wq,
        group_sizes,
        BASIC_DIMENSION_NUMBERS,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    xq = from_qarray(quantize(x, companion, granularity=PerChannel(axes=(1,)), pack=False))
    gq_cols = from_qarray(
        quantize(g, gradient, key=keys[1], granularity=PerChannel(axes=(1,)), pack=False)
    )
    xdtype, gdtype, acc_dtype = core_dtypes(xq.kind, gq_cols.kind)
    xv, gv = xq.values, gq_cols.values
    if xdtype is not None:
        xv, gv = xv.astype(xdtype), gv.astype(gdtype)
    acc = lax.ragged_dot_general(
        xv, gv, group_sizes, _RAGGED_CONTRACTION, preferred_element_type=acc_dtype
    ).astype(jnp.float32)
    # acc: [e, k, n]; zero points (asymmetric gradient configs) need per-expert row sums.
    if xq.zero_point is not None or gq_cols.zero_point is not None:
        raise ValueError(
            "quantized ragged backward needs a symmetric gradient config, got "
            f"symmetric=False in {gradient!r}"
        )
    dw = acc * xq.scale.reshape(1, -1, 1) * gq_cols.scale.reshape(1, 1, -1)
    return dx, dw
