"""`QatWeight`: a float weight that trains, with the quantized form it is served in.

The float `value` is what the optimizer updates; `qarray` is `quantize(value, weight_config)`,
recomputed wherever the weight is built (so forward numerics are exactly those of the served
PTQ model). The recipe parts that must not be traced (`activation`, `gradient`) are static
pytree metadata: a change of recipe is a new jit cache entry, never a stale trace.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import jax
import jax.numpy as jnp

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

    # The QAT ops import this module: they are imported where they are used.
    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, **kwargs: Any):
        from lowbit.ops._qat import qat_dot_general

        return qat_dot_general(lhs, rhs, dimension_numbers, **kwargs), "qat"

    def conv_general_dilated(self, lhs: Any, rhs: Any, **params: Any):
        from lowbit.ops._conv_qat import qat_conv_general_dilated

        return qat_conv_general_dilated(lhs, rhs, **params), "qat"

    def ragged_dot_general(self, lhs: Any, rhs: Any, group_sizes: Any, **params: Any):
        from lowbit.ops._ragged_dot_qat import qat_ragged_dot_general

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
