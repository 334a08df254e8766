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

Here the products run on a weight's parts (float value, served QArray); `qat_dot_general`,
which takes the `QatWeight` itself, checks its operands in `_qat_weight`.
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
from lowbit.ops._dot_general import dot_general
from lowbit.ops._operand import quantize_activation
from lowbit.qarray import QArray, QuantConfig


def companion_config(config: QuantConfig) -> QuantConfig:
    """The config for the non-gradient operand of a quantized backward product."""
    fmt = "fp8_e4m3fn" if str(config.format) == "fp8_e5m2" else config.format
    return dataclasses.replace(config, format=fmt, rounding="nearest")


def derived_key(g: jax.Array, *static: Any) -> jax.Array:
    digest = zlib.crc32(repr(static).encode()) & 0x7FFFFFFF
    word = lax.bitcast_convert_type(jnp.sum(g.astype(jnp.float32)), jnp.uint32)
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), digest), word)


def _quantized_product(g, other, dims, config, key, precision):
    """dot_general(g, other, dims) with both operands quantized per their free axes."""
    (gc, oc), _ = dims
    gq = quantize_activation(g, gc, config, key=key)
    oq = quantize_activation(other, oc, companion_config(config))
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
            key = derived_key(g, a.shape, b.shape, dims)
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        da = _quantized_product(g, b, da_dims, gradient, keys[0], precision)
        db = _quantized_product(g, a, db_dims, gradient, keys[1], precision)
    da = jnp.transpose(da, tuple(np.argsort(da_axes))).astype(a.dtype)
    db = jnp.transpose(db, tuple(np.argsort(db_axes))).astype(b.dtype)
    return da, db


def fake_quantized_activation(x, contracting, served: QArray):
    if served.activation is None:
        return x
    return quantize_activation(
        x, contracting, served.activation, served.activation_bounds
    ).dequantize(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def qat_dot(x, value, served, key, dims, weight_rhs, gradient, options):
    """`dot_general` of float `x` and `served` (the weight's QArray, rhs if `weight_rhs`) by
    normalized `dims`, with the straight-through backward above: d value from `value`'s dtype,
    `gradient` the backward config (None: float), `key` for its stochastic rounding."""
    lhs, rhs = (x, served) if weight_rhs else (served, x)
    return dot_general(lhs, rhs, dims, **options)


def _qat_dot_fwd(x, value, served, key, dims, weight_rhs, gradient, options):
    out = qat_dot(x, value, served, key, dims, weight_rhs, gradient, options)
    return out, (x, value, served, key)


def _qat_dot_bwd(dims, weight_rhs, gradient, options, residuals, g):
    x, value, served, key = residuals
    (lc, rc), _ = dims
    xq = fake_quantized_activation(x, lc if weight_rhs else rc, served)
    wq = served.dequantize(value.dtype)
    precision = options.get("precision")
    if weight_rhs:
        dx, dw = _backward_products(xq, wq, dims, g, gradient, key, precision)
    else:
        dw, dx = _backward_products(wq, xq, dims, g, gradient, key, precision)
    return dx.astype(x.dtype), dw.astype(value.dtype), None, None


qat_dot.defvjp(_qat_dot_fwd, _qat_dot_bwd)
