"""`lowbit.algorithms.quantize_params` / `quantize_model` / `quantize_with_report`: the one
`lowbit.quantize_params` / `lowbit.quantize_model` now takes their calibration data, and these
only translate their keyword arguments and warn."""

from __future__ import annotations

import warnings
from typing import Any

from lowbit.algorithms import AlgorithmReport
from lowbit.api._algorithms import AlgorithmOptions
from lowbit.api._model import quantize_model
from lowbit.api._quantize import quantize_params
from lowbit.recipes import Recipe

# Keyword arguments of the old entry points that are now `AlgorithmOptions` fields.
_OPTION_FIELDS = ("row_mask", "statistics", "sequential", "on_batch", "on_weight")


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"lowbit.algorithms.{old} is deprecated: lowbit.{new} takes calibration data itself "
        "(calibration=batches; padding masks, precomputed statistics, sequential passes and "
        "progress in algorithm_options=lowbit.api.AlgorithmOptions(...); "
        "report=lowbit.algorithms.AlgorithmReport() to have it filled)",
        DeprecationWarning,
        stacklevel=3,
    )


def _split(options: dict[str, Any]) -> dict[str, Any]:
    fields = {k: options.pop(k) for k in _OPTION_FIELDS if k in options}
    if fields:
        options["algorithm_options"] = AlgorithmOptions(**fields)
    return options


def deprecated_quantize_with_report(
    params: Any, recipe: Recipe | str, **options: Any
) -> tuple[Any, AlgorithmReport]:
    """Deprecated: ``lowbit.quantize_params(params, recipe, ..., report=AlgorithmReport())``."""
    _warn("quantize_with_report", "quantize_params(..., report=AlgorithmReport())")
    report = AlgorithmReport()
    return quantize_params(params, recipe, report=report, **_split(options)), report


def deprecated_quantize_params(params: Any, recipe: Recipe | str, **options: Any) -> Any:
    """Deprecated: `lowbit.quantize_params` (fn=..., calibration=batches)."""
    _warn("quantize_params", "quantize_params")
    return quantize_params(params, recipe, **_split(options))


def deprecated_quantize_model(model: Any, recipe: Recipe | str, **options: Any) -> Any:
    """Deprecated: `lowbit.quantize_model` (calibration=batches)."""
    _warn("quantize_model", "quantize_model")
    return quantize_model(model, recipe, **_split(options))
