"""The user API: quantize params or Flax models by a recipe, run them, calibrate, QAT, convert."""

from lowbit.api._calibrate import METHODS, activation_ranges, calibrate, with_activation_bounds
from lowbit.api._model import QuantizedLinen, QuantizedModel, quantize_model, run
from lowbit.api._qat import convert, prepare, qat
from lowbit.api._quantize import quantize, quantize_params, quantize_weight
from lowbit.api._trace import param_uses

__all__ = [
    "METHODS",
    "QuantizedLinen",
    "QuantizedModel",
    "activation_ranges",
    "calibrate",
    "convert",
    "param_uses",
    "prepare",
    "qat",
    "quantize",
    "quantize_model",
    "quantize_params",
    "quantize_weight",
    "run",
    "with_activation_bounds",
]
