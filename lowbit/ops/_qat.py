"""Training twins of the quantized ops: products with a `QatWeight`, straight-through backward.

Forward: exactly the served op on `QatWeight.served()` (so a converted PTQ model reproduces the
trained model bit for bit). Backward, with `g` the output cotangent (straight-through estimator
through both quantizers):

    d activation = g . dequantized weight
    d value      = fake-quantized activation^T . g

If the weight carries a `gradient` config (e.g. int8, or fp8_e5m2), those two dot_generals are
computed quantized, as AQT does: `g` is quantized per token of each backward product with that
config (its rounding, e.g. stochastic), the other operand per channel with the same config and
round-to-nearest (fp8_e5m2 gradients meet fp8_e4m3fn operands), and the product runs on stored
codes (int8 x int8 -> int32, fp8 x fp8 -> f32). Stochastic rounding takes `key`; without one a
key is derived from `jax.random.key(0)`, the shapes and the bits of `sum(g)`, so it is
deterministic for a given step yet changes from step to step.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.ops import _dims
from lowbit.ops._conv import conv_general_dilated, hashable_params, quantize_conv_input
from lowbit.ops._dot_general import dot_general
from lowbit.ops._operand import from_qarray, quantize_activation
from lowbit.ops._qat_weight import QatWeight
from lowbit.ops._ragged_dot import BASIC_DIMENSION_NUMBERS, ragged_dot_general
from lowbit.qarray import PerChannel, QArray, QuantConfig, quantize


def _split(lhs, rhs, op: str):
    """(float operand, QatWeight, whether the weight is the rhs)."""
    if isinstance(rhs, QatWeight) and not isinstance(lhs, QatWeight | QArray):
        return lhs, rhs, True
    if isinstance(lhs, QatWeight) and not isinstance(rhs, QatWeight | QArray):
        return rhs, lhs, False
    raise TypeError(
        f"{op} needs one QatWeight and one float array, got {type(lhs).__name__} and "
        f"{type(rhs).__name__}"
    )


def _companion(config: QuantConfig) -> QuantConfig:
    """The config for the non-gradient operand of a quantized backward product."""
    fmt = "fp8_e4m3fn" if str(config.format) == "fp8_e5m2" else config.format
    return dataclasses.replace(config, format=fmt, rounding="nearest")


def _derived_key(g: jax.Array, *static: Any) -> jax.Array:
    digest = zlib.crc32(repr(static).encode()) & 0x7FFFFFFF
    word = lax.bitcast_convert_type(jnp.sum(g.astype(jnp.float32)), jnp.uint32)
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), digest), word)


def _quantized_product(g, other, dims, config, key, precision):
    """dot_general(g, other, dims) with both operands quantized per their free axes."""
    (gc, oc), _ = dims
    gq = quantize_activation(g, gc, config, key=key)
    oq = quantize_activation(other, oc, _companion(config))
    return dot_general(gq, oq, dims, precision=precision, preferred_element_type=jnp.float32)


def _backward_products(a, b, dims, g, gradient, key, precision):
    """(d a, d b) for out = dot_general(a, b, dims), float or quantized per `gradient`."""
    (ac, bc), (ab, bb) = dims
    afree = _dims.free_axes(a.ndim, ac, ab)
    bfree = _dims.free_axes(b.ndim, bc, bb)
    nb, na = len(ab), len(afree)
    g_batch = tuple(range(nb))
    g_afree = tuple(range(nb, nb + na))
    g_bfree = tuple(range(nb + na, g.ndim))
    da_dims = ((g_bfree, bfree), (g_batch, bb))
    db_dims = ((g_afree, afree), (g_batch, ab))
    # Axis of `a` (resp. `b`) each output axis of the backward product stands for.
    da_axes = list(ab) + list(afree) + [ac[bc.index(r)] for r in sorted(bc)]
    db_axes = list(bb) + list(bfree) + [bc[ac.index(r)] for r in sorted(ac)]
    if gradient is None:
        product = lambda x, y, d: lax.dot_general(
            x, y, d, precision=precision, preferred_element_type=jnp.float32
        )
        da, db = product(g, b, da_dims), product(g, a, db_dims)
    else:
        if gradient.rounding == "stochastic" and key is None:
            key = _derived_key(g, a.shape, b.shape, dims)
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        da = _quantized_product(g, b, da_dims, gradient, keys[0], precision)
        db = _quantized_product(g, a, db_dims, gradient, keys[1], precision)
    da = jnp.transpose(da, tuple(np.argsort(da_axes))).astype(a.dtype)
    db = jnp.transpose(db, tuple(np.argsort(db_axes))).astype(b.dtype)
    return da, db


def _fake_quantized_activation(x, contracting, served: QArray):
    if served.activation is None:
        return x
    return quantize_activation(
        x, contracting, served.activation, served.activation_bounds
    ).dequantize(x.dtype)


# --- dot_general --------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _qat_dot(x, value, served, key, dims, weight_rhs, gradient, precision, preferred, sharding):
    lhs, rhs = (x, served) if weight_rhs else (served, x)
    return dot_general(
        lhs, rhs, dims, precision=precision, preferred_element_type=preferred, out_sharding=sharding
    )


def _qat_dot_fwd(x, value, served, key, dims, weight_rhs, gradient, precision, preferred, sharding):
    out = _qat_dot(
        x, value, served, key, dims, weight_rhs, gradient, precision, preferred, sharding
    )
    return out, (x, value, served, key)


def _qat_dot_bwd(dims, weight_rhs, gradient, precision, preferred, sharding, residuals, g):
    x, value, served, key = residuals
    (lc, rc), _ = dims
    xq = _fake_quantized_activation(x, lc if weight_rhs else rc, served)
    wq = served.dequantize(value.dtype)
    if weight_rhs:
        dx, dw = _backward_products(xq, wq, dims, g, gradient, key, precision)
    else:
        dw, dx = _backward_products(wq, xq, dims, g, gradient, key, precision)
    return dx.astype(x.dtype), dw.astype(value.dtype), None, None


_qat_dot.defvjp(_qat_dot_fwd, _qat_dot_bwd)


def qat_dot_general(
    lhs: jax.Array | QatWeight,
    rhs: jax.Array | QatWeight,
    dimension_numbers: Any,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    key: jax.Array | None = None,
) -> jax.Array:
    """`dot_general` with a `QatWeight` operand: quantized forward, straight-through backward.

    Args:
      lhs, rhs: one float array (e.g. `x: [batch, in]`) and one `QatWeight` (e.g. `[in, out]`).
      dimension_numbers, precision, preferred_element_type, out_sharding: as `lax.dot_general`.
      key: PRNG key for stochastic rounding of gradients (see module docstring).
    Returns:
      Exactly `dot_general(lhs, weight.served())` (or with operands in the given order).
    Raises:
      TypeError: unless exactly one operand is a QatWeight and the other a float array.
    """
    x, weight, weight_rhs = _split(lhs, rhs, "qat_dot_general")
    dims = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
    return _qat_dot(
        x,
        weight.value,
        weight.served(),
        key,
        dims,
        weight_rhs,
        weight.gradient,
        precision,
        preferred_element_type,
        out_sharding,
    )


# --- ragged_dot ---------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _qat_ragged(x, value, served, group_sizes, key, dims, gradient, precision, preferred, sharding):
    return ragged_dot_general(
        x,
        served,
        group_sizes,
        dims,
        precision=precision,
        preferred_element_type=preferred,
        out_sharding=sharding,
    )


def _qat_ragged_fwd(
    x, value, served, group_sizes, key, dims, gradient, precision, preferred, sharding
):
    out = _qat_ragged(
        x, value, served, group_sizes, key, dims, gradient, precision, preferred, sharding
    )
    return out, (x, value, served, group_sizes, key)


def _qat_ragged_bwd(dims, gradient, precision, preferred, sharding, residuals, g):
    x, value, served, group_sizes, key = residuals
    (lc, _), _ = dims.dot_dimension_numbers
    xq = _fake_quantized_activation(x, lc, served)
    wq = served.dequantize(value.dtype)
    if gradient is not None and dims == BASIC_DIMENSION_NUMBERS:
        dx, dw = _quantized_ragged_backward(xq, wq, group_sizes, g, gradient, key, precision)
    else:
        fn = lambda a, b: lax.ragged_dot_general(
            a, b, group_sizes, dims, precision=precision, preferred_element_type=jnp.float32
        )
        _, vjp = jax.vjp(fn, xq, wq)
        dx, dw = vjp(g.astype(jnp.float32))
    return dx.astype(x.dtype), dw.astype(value.dtype), None, None, None


_qat_ragged.defvjp(_qat_ragged_fwd, _qat_ragged_bwd)

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
        key = _derived_key(g, x.shape, w.shape)
    keys = (None, None) if key is None else tuple(jax.random.split(key))
    companion = _companion(gradient)
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
    acc_dtype = jnp.int32 if xq.kind == gq_cols.kind == "int" else jnp.float32
    xv, gv = xq.values, gq_cols.values
    if acc_dtype == jnp.float32 and (xq.kind, gq_cols.kind) != ("fp8", "fp8"):
        xv, gv = xv.astype(jnp.float32), gv.astype(jnp.float32)
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


def qat_ragged_dot_general(
    lhs: jax.Array,
    rhs: QatWeight,
    group_sizes: jax.Array,
    ragged_dot_dimension_numbers: Any = BASIC_DIMENSION_NUMBERS,
    precision: Any = None,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
    out_sharding: Any = None,
    key: jax.Array | None = None,
) -> jax.Array:
    """`ragged_dot_general` with a `QatWeight` of experts `[experts, k, n]`: quantized forward,
    straight-through backward (quantized backward products with a `gradient` config for the
    basic `lax.ragged_dot` layout; other layouts take the float backward only without one).

    Raises:
      TypeError: unless `rhs` is a QatWeight and `lhs` a float array.
      ValueError: for a `group_offset`, or a gradient config with a non-basic layout.
    """
    if not isinstance(rhs, QatWeight) or isinstance(lhs, QatWeight | QArray):
        raise TypeError(
            "qat_ragged_dot_general needs a float lhs and a QatWeight rhs, got "
            f"{type(lhs).__name__} and {type(rhs).__name__}"
        )
    if group_offset is not None:
        raise ValueError("qat_ragged_dot_general does not take a group_offset; got one")
    if rhs.gradient is not None and ragged_dot_dimension_numbers != BASIC_DIMENSION_NUMBERS:
        raise ValueError(
            "a gradient config needs the basic ragged_dot layout (lhs [m, k], rhs [e, k, n]); "
            f"got {ragged_dot_dimension_numbers}"
        )
    return _qat_ragged(
        lhs,
        rhs.value,
        rhs.served(),
        group_sizes,
        key,
        ragged_dot_dimension_numbers,
        rhs.gradient,
        precision,
        preferred_element_type,
        out_sharding,
    )


# --- conv_general_dilated -----------------------------------------------------------------------
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
