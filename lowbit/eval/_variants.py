"""Quantized variants of a reference model for evaluation: `lowbit.serving.apply_recipe`
calibrated on the evaluation's calibration set (`lowbit.eval.calibration_text`, disjoint from
the evaluation text).

Models and recipes are read by `lowbit.serving` (model specs: `lowbit.serving.load_model`;
recipe specs: `lowbit.serving.load_recipe`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowbit.eval._calibration_set import calibrator
from lowbit.serving import LoadedModel, apply_recipe


def quantize_variant(
    loaded: LoadedModel,
    float_params: Any,
    recipe_spec: str,
    *,
    calibration_file: str | None = None,
    calibration_sequences: int | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    on_weight: Callable[[int, int], None] | None = None,
    on_report: Callable[[Any], None] | None = None,
) -> tuple[Any, Any]:
    """The parameters of `loaded` under a recipe, ready to run (`lowbit.serving.apply_recipe`).

    Recipes whose rules run a data-driven algorithm (GPTQ, ...) are calibrated on the default
    calibration set or on `calibration_file` (`calibrator`); the statistics are cached per model
    and calibration set, so recipes of one model share one calibration pass.

    Args:
      loaded: the float model.
      float_params: its float parameters (``nnx.split(model)[1]``).
      recipe_spec: a preset name, a recipe JSON path, ``"float"`` or ``"gguf"``.
      calibration_file: a text file to calibrate on instead of the default speeches.
      calibration_sequences: number of calibration sequences (default 128 of 512 tokens; for
        an encoder, sentences: default 4096).
      on_batch / on_weight: progress callbacks ``(done, total)``.
      on_report: called with the `lowbit.algorithms.AlgorithmReport` of a recipe with
        algorithms (what every such weight got).
    Returns:
      ``(params, recipe)``: a pure-dict parameter tree with QArrays where the recipe quantizes,
      and the `Recipe` (None for ``"gguf"``).
    Raises:
      ValueError: for ``"gguf"`` on a model not read from a GGUF file, or a bad recipe.
    """
    return apply_recipe(
        loaded,
        float_params,
        recipe_spec,
        calibrate=calibrator(calibration_file, calibration_sequences, on_batch=on_batch),
        on_weight=on_weight,
        on_report=on_report,
    )
