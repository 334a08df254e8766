"""fp8 training matmuls with delayed, static or dynamic scaling (Transformer-Engine style).

`Fp8Weight` is a float weight with its fp8 state: an amax history per tensor for the weight,
the activation it meets and the gradient that comes back. `fp8_dot_general` quantizes the
activation and the weight to the forward format (e4m3) and the output gradient to the
gradient format (e5m2) with scales

    scale = amax * 2**margin / max_finite(format)           (a value x is stored as x / scale)

where `amax` is, per mode: ``"delayed"`` the max over the history (the current tensor's amax
on the very first step, when the history is still empty), ``"static"`` the first amax ever seen,
then frozen, ``"dynamic"`` the current tensor's amax. The new histories (the current amax
pushed in, oldest dropped) come back as the *gradient* of the state: `jax.grad` with respect to
the state returns the next state, so a train step threads it like any other output, inside
`jit` and `scan` (the state of stacked layers is stacked alike).

The products are computed on the fp8-rounded values in float32 (exactly what an fp8 x fp8 ->
f32 kernel computes, up to summation order); straight-through gradients flow to the float
operands.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from lowbit.qarray import ArrayBacked, NoRule

MODES = ("delayed", "static", "dynamic")
WEIGHT_AXES = ("tensor", "channel")
FORMATS = ("float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Scaling:
    """How an fp8 matmul scales its operands.

    Attributes:
      history_length: steps of amax history kept per tensor (>= 1).
      margin: scales are multiplied by ``2**margin`` (headroom against growth between steps).
      forward_format: activations and weights (``"float8_e4m3fn"``).
      gradient_format: output gradients (``"float8_e5m2"``).
      weight_mode, activation_mode, gradient_mode: one of `MODES` each.
      weight_axes: ``"tensor"`` (one scale) or ``"channel"`` (one per output channel, the
        weight's last axis); activations and gradients are scaled per tensor.

    Raises:
      ValueError: naming the field, the value and the accepted values.
    """

    history_length: int = 16
    margin: int = 0
    forward_format: str = "float8_e4m3fn"
    gradient_format: str = "float8_e5m2"
    weight_mode: str = "delayed"
    activation_mode: str = "delayed"
    gradient_mode: str = "delayed"
    weight_axes: str = "tensor"

    def __post_init__(self):
        n = self.history_length
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(
                f"Fp8Scaling.history_length: {n!r}; accepted: an int >= 1 (steps of amax history)"
            )
        if not isinstance(self.margin, int) or isinstance(self.margin, bool):
            raise ValueError(f"Fp8Scaling.margin: {self.margin!r}; accepted: an int")
        for field in ("forward_format", "gradient_format"):
            if getattr(self, field) not in FORMATS:
                raise ValueError(
                    f"Fp8Scaling.{field}: {getattr(self, field)!r}; accepted: {FORMATS}"
                )
        for field in ("weight_mode", "activation_mode", "gradient_mode"):
            if getattr(self, field) not in MODES:
                raise ValueError(f"Fp8Scaling.{field}: {getattr(self, field)!r}; accepted: {MODES}")
        if self.weight_axes not in WEIGHT_AXES:
            raise ValueError(
                f"Fp8Scaling.weight_axes: {self.weight_axes!r}; accepted: {WEIGHT_AXES}"
            )


def max_finite(fmt: str) -> float:
    return float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max)


def amax_of(x: jax.Array, channel: bool = False) -> jax.Array:
    """max |x| ignoring non-finite values: [] per tensor, [last axis] per channel."""
    a = jnp.where(jnp.isfinite(x), jnp.abs(x.astype(jnp.float32)), 0.0)
    return jnp.max(a.reshape(-1, a.shape[-1]), axis=0) if channel else jnp.max(a)


def scale_from(history: jax.Array, current: jax.Array, mode: str, margin: int, fmt: str):
    """The step size for this call. history: [length, *shape]; current: [*shape] amax."""
    if mode == "dynamic":
        amax = current
    else:
        past = jnp.max(history, axis=0)
        amax = jnp.where(past > 0, past, current)  # an empty history: the current amax
    scale = amax * (2.0**margin) / max_finite(fmt)
    return jnp.where(amax > 0, scale, 1.0)


def push(history: jax.Array, current: jax.Array, mode: str) -> jax.Array:
    """The next history: `current` pushed in front (static: set once, then frozen)."""
    rolled = jnp.concatenate([current[None].astype(history.dtype), history[:-1]], axis=0)
    if mode == "static":
        return jnp.where(jnp.any(history > 0), history, rolled)
    return rolled


def _qdq(x: jax.Array, scale: jax.Array, fmt: str) -> jax.Array:
    """x rounded to `fmt` at step `scale` (saturating, nearest-even), back in x's dtype."""
    limit = max_finite(fmt)
    scaled = jnp.clip(x.astype(jnp.float32) / scale, -limit, limit)
    return (scaled.astype(getattr(jnp, fmt)).astype(jnp.float32) * scale).astype(x.dtype)


# The amax histories of one weight's matmul, newest first, as a plain dict (so a state
# collection saves with `save_checkpoint` and loads back as is):
#   "weight":     [*stacked, length] or [*stacked, length, out] (per channel) float32
#   "activation": [*stacked, length] float32
#   "gradient":   [*stacked, length] float32
Fp8State = dict[str, jax.Array]


def init_state(shape: tuple[int, ...], scaling: Fp8Scaling, stacked_axes: int = 0) -> Fp8State:
    """Empty histories for a weight of `shape` whose first `stacked_axes` axes are layers."""
    lead = tuple(shape[:stacked_axes])
    n = scaling.history_length
    per = (shape[-1],) if scaling.weight_axes == "channel" else ()
    zeros = lambda *s: jnp.zeros((*lead, n, *s), jnp.float32)
    return {"weight": zeros(*per), "activation": zeros(), "gradient": zeros()}


@typing.final
@dataclasses.dataclass(frozen=True, eq=False)
class Fp8Weight(ArrayBacked):
    """A float weight trained through fp8 matmuls, with its amax state.

    Attributes:
      value: [*shape] float weight (receives gradients).
      state: its `Fp8State` dict (receives the next state as its gradient).
      scaling: static `Fp8Scaling`.
    """

    value: jax.Array
    state: Fp8State
    scaling: Fp8Scaling = Fp8Scaling()

    backing = "value"  # shape and dtype are those of `value`
    engine_priority = 2

    def dequantize(self) -> jax.Array:
        """The weight rounded as the forward pass sees it, straight-through to `value`."""
        s = self.scaling
        channel = s.weight_axes == "channel"
        current = amax_of(lax.stop_gradient(self.value), channel)
        scale = scale_from(self.state["weight"], current, s.weight_mode, s.margin, s.forward_format)
        rounded = _qdq(lax.stop_gradient(self.value), scale, s.forward_format)
        return self.value + lax.stop_gradient(rounded - self.value)

    # --- the engine's protocol (`EngineValue`) -------------------------------------------------
    def map_layout(self, qarray_fn: Any, float_fn: Any) -> Fp8Weight:
        """Layout ops that leave the shape alone (copies, casts) keep the fp8 state; others
        dequantize the weight (counted)."""
        return self.map_backing(qarray_fn, float_fn, "an fp8-scaled weight")

    def describe(self) -> str:
        return f"Fp8Weight(shape={tuple(self.shape)}, {self.scaling.weight_mode})"

    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, **kwargs: Any):
        try:
            return fp8_dot_general(lhs, rhs, dimension_numbers), "fp8_scaled"
        except Fp8LayoutError as err:
            raise NoRule(str(err)) from None


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["value", "state"], meta_fields=["scaling"])


class Fp8LayoutError(ValueError):
    """The weight is used in a way the fp8 matmul does not cover (the engine then falls back)."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fp8_dot(x, w, state, dims, weight_rhs, scaling):
    return _fp8_fwd(x, w, state, dims, weight_rhs, scaling)[0]


def _fp8_fwd(x, w, state, dims, weight_rhs, scaling):
    s = scaling
    channel = s.weight_axes == "channel"
    ax, aw = amax_of(x), amax_of(w, channel)
    sx = scale_from(state["activation"], ax, s.activation_mode, s.margin, s.forward_format)
    sw = scale_from(state["weight"], aw, s.weight_mode, s.margin, s.forward_format)
    xq, wq = _qdq(x, sx, s.forward_format), _qdq(w, sw, s.forward_format)
    pair = (xq, wq) if weight_rhs else (wq, xq)
    out = lax.dot_general(*pair, dims, preferred_element_type=jnp.float32).astype(x.dtype)
    return out, (xq, wq, state, ax, aw)


def _fp8_bwd(dims, weight_rhs, scaling, residuals, g):
    s = scaling
    xq, wq, state, ax, aw = residuals
    ag = amax_of(g)
    sg = scale_from(state["gradient"], ag, s.gradient_mode, s.margin, s.gradient_format)
    gq = _qdq(g, sg, s.gradient_format)
    pair = (xq, wq) if weight_rhs else (wq, xq)
    _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims).astype(g.dtype), *pair)
    da, db = vjp(gq)
    dx, dw = (da, db) if weight_rhs else (db, da)
    new_state = {
        "weight": push(state["weight"], aw, s.weight_mode),
        "activation": push(state["activation"], ax, s.activation_mode),
        "gradient": push(state["gradient"], ag, s.gradient_mode),
    }
    return dx.astype(xq.dtype), dw.astype(wq.dtype), new_state


_fp8_dot.defvjp(_fp8_fwd, _fp8_bwd)


def fp8_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, **_: Any) -> jax.Array:
    """`lax.dot_general` with one operand an `Fp8Weight`, through fp8 rounding (see module doc).

    Args:
      lhs, rhs: one `Fp8Weight` (without dot batch dimensions) and one float array.
      dimension_numbers: as for `lax.dot_general`.
    Returns:
      The product in the float operand's dtype. Its VJP gives straight-through gradients to
      both float operands and the next `Fp8State` as the state's cotangent.
    Raises:
      Fp8LayoutError: for dot batch dimensions, or a per-channel weight whose last axis is
        contracted.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    weight_rhs = isinstance(rhs, Fp8Weight)
    weight, x = (rhs, lhs) if weight_rhs else (lhs, rhs)
    wc = rc if weight_rhs else lc
    if not isinstance(x, jax.Array | np.ndarray):
        raise Fp8LayoutError("the other operand is not a float array")
    if lb or rb:
        raise Fp8LayoutError("has dot batch dimensions")
    if weight.scaling.weight_axes == "channel" and weight.ndim - 1 in tuple(wc):
        raise Fp8LayoutError("contracts the weight's channel (last) axis")
    if weight.state["activation"].ndim != 1:
        raise Fp8LayoutError("holds the state of several stacked layers")
    dims = ((tuple(lc), tuple(rc)), ((), ()))
    return _fp8_dot(x, weight.value, weight.state, dims, weight_rhs, weight.scaling)
