"""Signal-to-quantization-noise ratio of quantized weights and of the layer outputs they give.

    SQNR(x, y) = 10 log10( sum x^2 / sum (x - y)^2 )    dB

Each extra bit of a uniform quantizer adds about 6.02 dB; int8 per-channel weights sit near
40 dB, 4-bit group-wise near 20 dB.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.eval._tree import named_leaves
from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray, QuantConfig, quantize


def sqnr_db(reference: Any, approx: Any) -> float:
    """SQNR of `approx` against `reference`, in dB (computed in float64).

    Args:
      reference: [...] float, the original.
      approx: [...] float, same shape, e.g. the dequantized weight.
    Returns:
      dB; ``inf`` when the two are identical (no noise, including both all-zero), ``-inf`` when
      the reference is all zero but the approximation is not.
    Raises:
      ValueError: if the shapes differ.
    """
    x = np.asarray(reference, np.float64)
    y = np.asarray(approx, np.float64)
    if x.shape != y.shape:
        raise ValueError(f"sqnr_db needs equal shapes; got {x.shape} and {y.shape}")
    signal = float(np.sum(x * x))
    noise = float(np.sum((x - y) ** 2))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


@jax.jit
def _dequantize(q: QArray) -> jax.Array:
    # One compiled program per weight layout instead of many eager ops.
    return q.dequantize(jnp.float32)


def _pairs(float_params: Any, quant_params: Any) -> list[tuple[str, jax.Array, QArray]]:
    floats = named_leaves(float_params)
    pairs = []
    for path, leaf in named_leaves(quant_params).items():
        if path.endswith("/inner"):
            # Held rotated (`lowbit.ops.HadamardInput`: ``Hᵀ W``): not comparable to ``W``
            # element by element.
            continue
        if isinstance(leaf, PreparedQArray):
            leaf = leaf.logical()
        if not isinstance(leaf, QArray):
            continue
        if path not in floats:
            raise ValueError(
                f"quantized parameter {path!r} has no float counterpart; the two trees must "
                "come from the same model"
            )
        ref = floats[path]
        if isinstance(ref, QArray):
            ref = _dequantize(ref)
        if tuple(ref.shape) != leaf.shape:
            raise ValueError(
                f"parameter {path!r}: float shape {tuple(ref.shape)} != quantized {leaf.shape}"
            )
        pairs.append((path, jnp.asarray(ref, jnp.float32), leaf))
    return pairs


def weight_sqnr(float_params: Any, quant_params: Any) -> dict[str, float]:
    """SQNR (dB) of every quantized weight against its float original.

    Args:
      float_params: the float parameter pytree.
      quant_params: the same tree with some leaves replaced by QArrays.
    Returns:
      ``{path: dB}`` for each QArray leaf, in tree order.
    Raises:
      ValueError: if a quantized path or shape has no float counterpart.
    """
    return {
        path: sqnr_db(ref, _dequantize(q)) for path, ref, q in _pairs(float_params, quant_params)
    }


def _activation(x: jax.Array, q: QArray) -> jax.Array:
    """The other operand as a weight's consumer sees it (quantized when `q.activation` says)."""
    config = q.activation
    if not isinstance(config, QuantConfig):
        return x
    bounds = None
    if q.activation_bounds is not None:
        bounds = (q.activation_bounds[0], q.activation_bounds[1])
    return quantize(x, config, bounds=bounds).dequantize(jnp.float32)


@functools.partial(jax.jit, static_argnums=3)
def _layer_outputs(
    x: jax.Array, ref: jax.Array, q: QArray, axis: int
) -> tuple[jax.Array, jax.Array]:
    k = q.shape[axis]
    w_ref = jnp.moveaxis(ref, axis, 0).reshape(k, -1)
    w_q = jnp.moveaxis(q.dequantize(jnp.float32), axis, 0).reshape(k, -1)
    return x @ w_ref, _activation(x, q) @ w_q


def contraction_axis(path: str, ndim: int) -> int:
    """The weight axis a layer contracts: the last for embedding tables (the tied logits
    projection ``x @ E.T``), else the first (``[in, out]`` kernels)."""
    return ndim - 1 if path.rsplit("/", 1)[-1] == "embedding" else 0


def output_sqnr(
    float_params: Any,
    quant_params: Any,
    *,
    rows: int = 32,
    seed: int = 0,
    inputs: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """SQNR (dB) of each quantized layer's output against the float layer's output.

    Each weight is applied to a calibration batch, contracting the axis of `contraction_axis`:
    ``y = x @ W`` with ``x: [rows, W.shape[axis]]``. The quantized side quantizes `x` as the
    weight's `activation` config says (w8a8), so the number covers both operands' error.

    Args:
      float_params: the float parameter pytree.
      quant_params: the same tree with some leaves replaced by QArrays.
      rows: calibration rows per layer when `inputs` has none for it.
      seed: seed of the standard-normal calibration batch.
      inputs: optional ``{path: [rows, k] float}`` real activations per layer.
    Returns:
      ``{path: dB}`` for each QArray leaf with ndim >= 2, in tree order.
    Raises:
      ValueError: if the trees do not match, or an input has the wrong width.
    """
    inputs = dict(inputs or {})
    key = jax.random.key(seed)
    result = {}
    for i, (path, ref, q) in enumerate(_pairs(float_params, quant_params)):
        if q.ndim < 2:
            continue
        axis = contraction_axis(path, q.ndim)
        k = q.shape[axis]
        x = inputs.get(path)
        if x is None:
            x = jax.random.normal(jax.random.fold_in(key, i), (rows, k), jnp.float32)
        x = jnp.asarray(x, jnp.float32)
        if x.ndim != 2 or x.shape[1] != k:
            raise ValueError(f"inputs[{path!r}] has shape {tuple(x.shape)}; expected [rows, {k}]")
        result[path] = sqnr_db(*_layer_outputs(x, ref, q, axis))
    return result
