"""Rounding better than nearest: GPTQ, AWQ, SmoothQuant and HQQ, on statistics from the engine.

`capture` streams per-weight input statistics (Gram matrix, mean/max |x|) from the float model
on calibration batches; `rounding_for(rule.algorithm)` is each algorithm's implementation
(`needs_data`, `round(...)`), which `lowbit.quantize_params` / `lowbit.quantize_model` run for
every rule that carries one (`lowbit.recipes.GPTQ`, `HQQ`, `AWQ`, `SmoothQuant`). AWQ and
SmoothQuant scales are folded into the preceding norm or linear layer where the probe shows it
is exact (`_smooth`); AWQ also searches a clipping range per scale block (`_clip`).
`sparsegpt_matrix` prunes one matrix to N:M with the same statistics (SparseGPT).

Routed experts (``[E, in, out]`` weights of a ``ragged_dot``) get statistics per expert, from
only the rows routed to it: GPTQ and the clip search run per expert; AWQ / SmoothQuant fold one
scale shared by all experts (the router, left in float, absorbs it too); SparseGPT prunes each
expert on its own statistics.

This layer sits below `lowbit.api`. The names `quantize_params`, `quantize_model` and
`quantize_with_report` (deprecated: use `lowbit.quantize_params` / `lowbit.quantize_model`),
`algorithm_weights` and `sparsegpt_params` live in `lowbit.api`; they are still reachable here,
resolved on first use so that this module imports nothing above it.
"""

import importlib

from lowbit.algorithms._capture import CalibrationError, Statistics, WeightStats, capture
from lowbit.algorithms._gptq import gptq_matrix
from lowbit.algorithms._hqq import hqq_qarray
from lowbit.algorithms._knapsack import bounds as knapsack_bounds
from lowbit.algorithms._knapsack import solve as solve_knapsack
from lowbit.algorithms._knapsack import solve_timed as solve_knapsack_timed
from lowbit.algorithms._rounding import (
    IMPLEMENTED,
    AlgorithmReport,
    Context,
    GptqRounding,
    HqqRounding,
    NearestRounding,
    Rounding,
    check_algorithm,
    first_rounding,
    folds,
    gptq_one,
    rounding_for,
    sample_rows,
)
from lowbit.algorithms._sensitivity import Measured, measure, output_error, output_sensitivity
from lowbit.algorithms._sparsegpt import prune_one, sparsegpt_matrix
from lowbit.algorithms._walk import activation_rows, batch_args, kept_rows, walk_batch

# Names defined in `lowbit.api`, above this layer: {name: attribute of lowbit.api}.
_FROM_API = {
    "algorithm_weights": "algorithm_weights",
    "quantize_model": "deprecated_quantize_model",
    "quantize_params": "deprecated_quantize_params",
    "quantize_with_report": "deprecated_quantize_with_report",
    "sparsegpt_params": "sparsegpt_params",
}


def __getattr__(name: str):
    if name in _FROM_API:
        return getattr(importlib.import_module("lowbit.api"), _FROM_API[name])
    raise AttributeError(f"module 'lowbit.algorithms' has no attribute {name!r}")


__all__ = [
    "IMPLEMENTED",
    "Measured",
    "knapsack_bounds",
    "measure",
    "output_error",
    "output_sensitivity",
    "solve_knapsack",
    "solve_knapsack_timed",
    "AlgorithmReport",
    "CalibrationError",
    "Context",
    "GptqRounding",
    "HqqRounding",
    "NearestRounding",
    "Rounding",
    "Statistics",
    "WeightStats",
    "activation_rows",
    "batch_args",
    "algorithm_weights",
    "capture",
    "check_algorithm",
    "first_rounding",
    "folds",
    "gptq_matrix",
    "gptq_one",
    "hqq_qarray",
    "kept_rows",
    "prune_one",
    "quantize_model",
    "quantize_params",
    "quantize_with_report",
    "rounding_for",
    "sample_rows",
    "sparsegpt_matrix",
    "sparsegpt_params",
    "walk_batch",
]
