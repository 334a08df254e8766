"""A weight's `input_scale`: applied to the other operand of a dot, before anything else.

A `QArray` (or `PreparedQArray`) with ``input_scale`` stands for ``dequantize(codes) * s``
with `s` varying along the weight's contracted axes only. The dot

    x · (codes_value * s) == (x * s) · codes_value

so the ops multiply the float operand by `s` (moved onto its own contracting axes) and then
run the weight without it, on every path (kernels, integer and float cores, STE gradients):
the activation quantizer sees ``x * s``, which is the point of SmoothQuant's scale where no
layer of the model can absorb it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from lowbit.ops import _dims


def _stored(x: Any) -> bool:
    """Whether `x` is a stored weight (a QArray, or its prepared layout): one that has an
    `input_scale` field, which a float operand has not."""
    return hasattr(x, "input_scale")


def _scaled_weight(x: Any) -> bool:
    return _stored(x) and x.input_scale is not None


def strip_input_scale(x: Any) -> Any:
    """`x` without its input scale (as the path choice sees a weight: the scale, applied to
    the other operand first, changes no path)."""
    return dataclasses.replace(x, input_scale=None) if _scaled_weight(x) else x


def _scale_operand(x, scale, x_axes: tuple[int, ...], w_axes: tuple[int, ...]):
    """`x` multiplied by `scale` (laid out along the weight's axes) along `x_axes`, where
    `x_axes[i]` is contracted with the weight's `w_axes[i]`."""
    others = [a for a in range(scale.ndim) if a not in w_axes]
    if any(scale.shape[a] != 1 for a in others):
        raise ValueError(
            f"a weight's input_scale {tuple(scale.shape)} varies along axes {others} that this "
            f"dot does not contract ({w_axes}); it must be 1 there"
        )
    pairs = sorted(zip(x_axes, w_axes, strict=True))  # in the order of x's axes
    values = jnp.transpose(jnp.squeeze(scale, others), [sorted(w_axes).index(w) for _, w in pairs])
    shape = [1] * x.ndim
    for xa, wa in pairs:
        shape[xa] = scale.shape[wa]
    return (x.astype(jnp.float32) * values.astype(jnp.float32).reshape(shape)).astype(x.dtype)


def apply_input_scale(lhs: Any, rhs: Any, dimension_numbers: Any) -> tuple[Any, Any]:
    """(lhs, rhs) with a weight's `input_scale` moved onto the float operand.

    Raises:
      ValueError: when both operands are quantized (there is no float operand to scale) or the
        scale varies along an axis the dot does not contract.
    """
    if not (_scaled_weight(lhs) or _scaled_weight(rhs)):
        return lhs, rhs
    if _stored(lhs) and _stored(rhs):
        raise ValueError(
            "a dot of two quantized operands where one has an input_scale: the scale applies to "
            "a float operand; dequantize one side or drop the scale (SmoothQuant in-op scales "
            "are for weight x activation products)"
        )
    dims = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
    (lc, rc), _ = dims
    if _scaled_weight(rhs):
        return _scale_operand(lhs, rhs.input_scale, tuple(lc), tuple(rc)), strip_input_scale(rhs)
    return strip_input_scale(lhs), _scale_operand(rhs, lhs.input_scale, tuple(rc), tuple(lc))


def reject_input_scale(op: str, *operands: Any) -> None:
    """Raises for an operand with an `input_scale` in an op that does not apply one.

    Raises:
      ValueError: naming the op and what to do instead.
    """
    if any(_scaled_weight(x) for x in operands):
        raise ValueError(
            f"{op}: a weight with an input_scale (SmoothQuant's in-op scale) is applied only by "
            "dot_general / einsum products; requantize this weight without it (a rule whose "
            "algorithm folds no in-op scale, e.g. SmoothQuant(in_op=False))"
        )
