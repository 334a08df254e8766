"""Rounding better than nearest: GPTQ, AWQ, SmoothQuant and HQQ, on statistics from the engine.

`capture` streams per-weight input statistics (Gram matrix, mean/max |x|) from the float model
on calibration batches; `quantize_params` / `quantize_model` apply the recipe, running each
rule's algorithm (`lowbit.recipes.GPTQ`, `HQQ`, `AWQ`, `SmoothQuant`) on its weights; AWQ and
SmoothQuant scales are folded into the preceding norm or linear layer where the probe shows
it is exact; AWQ also searches a clipping range per scale block. `sparsegpt_params` prunes to
N:M with the same statistics (SparseGPT).
"""

from lowbit.algorithms._apply import (
    AlgorithmReport,
    algorithm_weights,
    quantize_model,
    quantize_params,
    quantize_with_report,
    sample_rows,
)
from lowbit.algorithms._capture import CalibrationError, Statistics, WeightStats, capture
from lowbit.algorithms._gptq import gptq_matrix
from lowbit.algorithms._hqq import hqq_qarray
from lowbit.algorithms._sparsegpt import sparsegpt_matrix, sparsegpt_params

__all__ = [
    "AlgorithmReport",
    "CalibrationError",
    "Statistics",
    "WeightStats",
    "algorithm_weights",
    "capture",
    "gptq_matrix",
    "hqq_qarray",
    "quantize_model",
    "quantize_params",
    "quantize_with_report",
    "sample_rows",
    "sparsegpt_matrix",
    "sparsegpt_params",
]
