"""`fake_quant`: quantize-then-dequantize with a straight-through gradient.

Forward: `dequantize(quantize(x, config))`. Backward: the identity (the straight-through
estimator), or, with `clip_gradient=True`, the identity inside each block's clipping range
[lo, hi] and zero outside it (values that were clipped get no gradient, as in PACT / LSQ-style
training).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lowbit.qarray._qarray import broadcast_blocks
from lowbit.qarray._quantize import QuantConfig, quantize


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_quant(x, config: QuantConfig, clip_gradient: bool):
    return quantize(x, config).dequantize(x.dtype)


def _fwd(x, config, clip_gradient):
    q = quantize(x, config)
    if not clip_gradient:
        return q.dequantize(x.dtype), None
    # Representable range per element: the grid's ends mapped back through scale / zero point.
    fmt = q.fmt
    scale = broadcast_blocks(q.scale_values(), q.shape)
    zero = (
        0.0 if q.zero_point is None else broadcast_blocks(q.zero_point.astype(jnp.float32), q.shape)
    )
    # Symmetric quantization uses the restricted range [-max, max] (see `quantize`).
    grid_min = -fmt.max_value if config.symmetric else fmt.min_value
    lo = (grid_min - zero) * scale
    hi = (fmt.max_value - zero) * scale
    inside = (x >= lo) & (x <= hi)
    return q.dequantize(x.dtype), inside


def _bwd(config, clip_gradient, inside, g):
    if inside is None:
        return (g,)
    return (jnp.where(inside, g, jnp.zeros_like(g)),)


_fake_quant.defvjp(_fwd, _bwd)


def fake_quant(
    x: jax.Array, config: QuantConfig | str = "int8", *, clip_gradient: bool = False, **overrides
) -> jax.Array:
    """Quantize-dequantize `x` with a straight-through gradient.

    Args:
      x: [...] float.
      config: a `QuantConfig` or a format name (with `overrides` as its fields).
      clip_gradient: zero the gradient of elements outside their block's representable range.
    Returns:
      [...] same shape and dtype as `x`, on the quantization grid.
    """
    if not isinstance(config, QuantConfig):
        config = QuantConfig(format=config, **overrides)
    elif overrides:
        config = dataclasses.replace(config, **overrides)
    if config.rounding != "nearest":
        raise ValueError("fake_quant supports rounding='nearest' only (it takes no PRNG key)")
    return _fake_quant(x, config, clip_gradient)
