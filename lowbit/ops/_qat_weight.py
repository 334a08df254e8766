"""`QatWeight`: a float weight that trains, with the quantized form it is served in.

The float `value` is what the optimizer updates; `qarray` is `quantize(value, weight_config)`,
recomputed wherever the weight is built (so forward numerics are exactly those of the served
PTQ model). The recipe parts that must not be traced (`activation`, `gradient`) are static
pytree metadata: a change of recipe is a new jit cache entry, never a stale trace.

The ops that take one (`qat_dot_general`, `qat_conv_general_dilated`, `qat_ragged_dot_general`,
which the engine calls through `QatWeight`'s methods) check their operands here and run the
training twins on the weight's parts: its float value and the served QArray (`_qat`,
`_conv_qat`, `_ragged_dot_qat`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.ops import _dims
from lowbit.ops._conv import hashable_params
from lowbit.ops._conv_qat import qat_conv
from lowbit.ops._operand import quantized
from lowbit.ops._qat import qat_dot
from lowbit.ops._ragged_dot import BASIC_DIMENSION_NUMBERS
from lowbit.ops._ragged_dot_qat import qat_ragged
from lowbit.qarray import ArrayBacked, QArray, QuantConfig, quantize


@typing.final
@dataclasses.dataclass(frozen=True, eq=False)
class QatWeight(ArrayBacked):
    """A float weight with its quantization recipe for quantization-aware training.

    Attributes:
      value: [*shape] float weight; receives the gradients.
      qarray: `quantize(value, weight_config)` with the same logical shape and layout.
      activation: how ops quantize the other operand in the forward pass (None: weight-only).
      gradient: how the two backward matmuls quantize their operands (None: float backward).
    """

    value: jax.Array
    qarray: QArray
    activation: QuantConfig | None = None
    gradient: QuantConfig | None = None

    backing = "value"  # shape and dtype are those of `value`
    engine_priority = 1

    def served(self) -> QArray:
        """The QArray a converted (served) model holds: `qarray` with the activation config."""
        activation = self.activation if self.activation is not None else self.qarray.activation
        return dataclasses.replace(self.qarray, activation=activation)

    def dequantize(self) -> jax.Array:
        """The fake-quantized weight: forward values of `qarray`, gradient straight to `value`."""
        quantized = self.qarray.dequantize(self.value.dtype)
        return self.value + jax.lax.stop_gradient(quantized - self.value)

    # --- the engine's protocol (`EngineValue`) -------------------------------------------------
    def map_layout(self, qarray_fn: Any, float_fn: Any) -> QatWeight:
        """The float op on `value`, the packed op on `qarray`: both stay consistent."""
        return dataclasses.replace(self, value=float_fn(self.value), qarray=qarray_fn(self.qarray))

    def describe(self) -> str:
        return f"QatWeight({self.qarray.describe()})"

    def scan_parts(self, qarray_parts: Any) -> Any:
        parts, rebuild = qarray_parts(self.qarray)
        return (self.value, parts), lambda p: dataclasses.replace(
            self, value=p[0], qarray=rebuild(p[1])
        )

    def scan_output_parts(self, qarray_parts: Any) -> Any:
        parts, restack = qarray_parts(self.qarray)
        return (self.value, parts), lambda p, length: dataclasses.replace(
            self, value=p[0], qarray=restack(p[1], length)
        )

    def shard_parts(self, spec: Any, qarray_parts: Any) -> Any:
        leaves, specs, rebuild = qarray_parts(self.qarray, spec)
        return (
            (self.value, leaves),
            (spec, specs),
            lambda local: dataclasses.replace(self, value=local[0], qarray=rebuild(local[1])),
        )

    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, **kwargs: Any):
        return qat_dot_general(lhs, rhs, dimension_numbers, **kwargs), "qat"

    def conv_general_dilated(self, lhs: Any, rhs: Any, **params: Any):
        return qat_conv_general_dilated(lhs, rhs, **params), "qat"

    def ragged_dot_general(self, lhs: Any, rhs: Any, group_sizes: Any, **params: Any):
        return qat_ragged_dot_general(lhs, rhs, group_sizes, **params), "qat"

    def transpose(self, axes: tuple[int, ...]) -> QatWeight:
        return dataclasses.replace(
            self, value=jnp.transpose(self.value, axes), qarray=self.qarray.transpose(axes)
        )


jax.tree_util.register_dataclass(
    QatWeight, data_fields=["value", "qarray"], meta_fields=["activation", "gradient"]
)


def qat_weight(
    value: jax.Array,
    config: QuantConfig | str,
    *,
    activation: QuantConfig | None = None,
    gradient: QuantConfig | None = None,
    pack_axis: int | None = None,
) -> QatWeight:
    """Wraps a float weight for QAT.

    Args:
      value: [*shape] float weight.
      config: weight `QuantConfig` (or a format name).
      activation: forward activation config, or None for weight-only.
      gradient: backward matmul config (e.g. int8 or fp8_e5m2), or None.
      pack_axis: passed to `quantize`.
    Returns:
      A `QatWeight`.
    Raises:
      TypeError: if `activation` or `gradient` is not a `QuantConfig` or None.
    """
    for name, cfg in (("activation", activation), ("gradient", gradient)):
        if cfg is not None and not isinstance(cfg, QuantConfig):
            raise TypeError(f"{name} must be a QuantConfig or None, got {type(cfg).__name__}")
    return QatWeight(
        value=value,
        qarray=quantize(value, config, pack_axis=pack_axis),
        activation=activation,
        gradient=gradient,
    )


def _split_operands(lhs, rhs, op: str, rhs_only: bool = False):
    """(float operand, QatWeight, whether the weight is the rhs).

    Raises:
      TypeError: unless one operand is a QatWeight and the other a float array (with
        `rhs_only`: the rhs is the weight).
    """
    weights = tuple(isinstance(x, QatWeight) for x in (lhs, rhs))
    floats = tuple(not w and not quantized(x) for w, x in zip(weights, (lhs, rhs), strict=True))
    if weights[1] and floats[0]:
        return lhs, rhs, True
    if weights[0] and floats[1] and not rhs_only:
        return rhs, lhs, False
    wanted = "a float lhs and a QatWeight rhs" if rhs_only else "one QatWeight and one float array"
    raise TypeError(f"{op} needs {wanted}, got {type(lhs).__name__} and {type(rhs).__name__}")


def qat_dot_general(
    lhs: jax.Array | QatWeight,
    rhs: jax.Array | QatWeight,
    dimension_numbers: Any,
    *,
    key: jax.Array | None = None,
    **options: Any,
) -> jax.Array:
    """`dot_general` with a `QatWeight` operand: quantized forward, straight-through backward.

    Args:
      lhs, rhs: one float array (e.g. `x: [batch, in]`) and one `QatWeight` (e.g. `[in, out]`).
      dimension_numbers: as `lax.dot_general`.
      key: PRNG key for stochastic rounding of gradients (see `lowbit.ops._qat`).
      **options: `precision`, `preferred_element_type`, `out_sharding`, as `dot_general`
        (passed to the forward product unchanged; `precision` also to the backward ones).
    Returns:
      Exactly `dot_general(lhs, weight.served())` (or with operands in the given order).
    Raises:
      TypeError: unless exactly one operand is a QatWeight and the other a float array.
    """
    x, weight, weight_rhs = _split_operands(lhs, rhs, "qat_dot_general")
    dims = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
    served = weight.served()
    return qat_dot(x, weight.value, served, key, dims, weight_rhs, weight.gradient, options)


def qat_conv_general_dilated(lhs: jax.Array, rhs: QatWeight, **params: Any) -> jax.Array:
    """`conv_general_dilated` with a `QatWeight` kernel: quantized forward, straight-through
    float backward (d input = conv transpose with the dequantized kernel, d value with the
    fake-quantized input).

    Raises:
      TypeError: unless `rhs` is a QatWeight and `lhs` a float array.
      ValueError: if the weight has a `gradient` config (quantized backward convolutions are
        not provided; use gradient=None for convolution kernels).
    """
    _split_operands(lhs, rhs, "qat_conv_general_dilated", rhs_only=True)
    if rhs.gradient is not None:
        raise ValueError(
            f"gradient={rhs.gradient!r} on a convolution kernel: quantized backward products "
            "exist for dot_general and ragged_dot only; set gradient=None for this kernel"
        )
    return qat_conv(lhs, rhs.value, rhs.served(), hashable_params(params))


def qat_ragged_dot_general(
    lhs: jax.Array,
    rhs: QatWeight,
    group_sizes: jax.Array,
    ragged_dot_dimension_numbers: Any = BASIC_DIMENSION_NUMBERS,
    *,
    key: jax.Array | None = None,
    **options: Any,
) -> jax.Array:
    """`ragged_dot_general` with a `QatWeight` of experts `[experts, k, n]`: quantized forward,
    straight-through backward (quantized backward products with a `gradient` config for the
    basic `lax.ragged_dot` layout; other layouts take the float backward only without one).

    Args:
      lhs: [m, k] float tokens, rows grouped by expert.
      rhs: [experts, k, n] QatWeight.
      group_sizes, ragged_dot_dimension_numbers: as `ragged_dot_general`.
      key: PRNG key for stochastic rounding of gradients (see `_qat`).
      **options: `precision`, `preferred_element_type`, `out_sharding` (and an unset
        `group_offset`), as `ragged_dot_general`; `precision` also for the backward products.
    Returns:
      [m, n], exactly `ragged_dot_general(lhs, rhs.served(), ...)`.
    Raises:
      TypeError: unless `rhs` is a QatWeight and `lhs` a float array.
      ValueError: for a `group_offset`, or a gradient config with a non-basic layout.
    """
    _split_operands(lhs, rhs, "qat_ragged_dot_general", rhs_only=True)
    if options.get("group_offset") is not None:
        raise ValueError("qat_ragged_dot_general does not take a group_offset; got one")
    if rhs.gradient is not None and ragged_dot_dimension_numbers != BASIC_DIMENSION_NUMBERS:
        raise ValueError(
            "a gradient config needs the basic ragged_dot layout (lhs [m, k], rhs [e, k, n]); "
            f"got {ragged_dot_dimension_numbers}"
        )
    dims, served = ragged_dot_dimension_numbers, rhs.served()
    return qat_ragged(lhs, rhs.value, served, group_sizes, key, dims, rhs.gradient, options)
