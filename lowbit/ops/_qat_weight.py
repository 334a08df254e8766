"""`QatWeight`: a float weight that trains, with the quantized form it is served in.

The float `value` is what the optimizer updates; `qarray` is `quantize(value, weight_config)`,
recomputed wherever the weight is built (so forward numerics are exactly those of the served
PTQ model). The recipe parts that must not be traced (`activation`, `gradient`) are static
pytree metadata: a change of recipe is a new jit cache entry, never a stale trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.qarray import QArray, QuantConfig, quantize


@dataclasses.dataclass(frozen=True, eq=False)
class QatWeight:
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

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.value.dtype

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    def served(self) -> QArray:
        """The QArray a converted (served) model holds: `qarray` with the activation config."""
        activation = self.activation if self.activation is not None else self.qarray.activation
        return dataclasses.replace(self.qarray, activation=activation)

    def dequantize(self) -> jax.Array:
        """The fake-quantized weight: forward values of `qarray`, gradient straight to `value`."""
        quantized = self.qarray.dequantize(self.value.dtype)
        return self.value + jax.lax.stop_gradient(quantized - self.value)

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


def is_qat_weight(x: Any) -> bool:
    return isinstance(x, QatWeight)
