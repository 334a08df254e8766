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

This layer sits below `lowbit.api`, which holds the entry points that run it
(`lowbit.quantize_params`, `lowbit.api.algorithm_weights`, `lowbit.api.sparsegpt_params`).
"""

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
    Nearest,
    NearestRounding,
    Rescaled,
    Rounding,
    check_algorithm,
    first_rounding,
    folds,
    gptq_one,
    rounding_for,
    sample_rows,
)
from lowbit.algorithms._sensitivity import (
    Measured,
    measure,
    output_error,
    output_sensitivity,
    stored_nbytes,
)
from lowbit.algorithms._smooth import (
    apply_factors,
    fold_factors,
    input_scales,
    plan_folds,
    scale_leaf,
)
from lowbit.algorithms._sparsegpt import prune_one, sparsegpt_matrix
from lowbit.algorithms._spread import (
    check_same_everywhere,
    held_whole,
    local_copy,
    plan_spread,
    spanning_processes,
    stats_span_processes,
)
from lowbit.algorithms._walk import activation_rows, batch_args, kept_rows, walk_batch

__all__ = [
    "IMPLEMENTED",
    "Measured",
    "knapsack_bounds",
    "measure",
    "output_error",
    "output_sensitivity",
    "solve_knapsack",
    "solve_knapsack_timed",
    "stored_nbytes",
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
    "capture",
    "check_algorithm",
    "first_rounding",
    "folds",
    "gptq_matrix",
    "gptq_one",
    "hqq_qarray",
    "kept_rows",
    "prune_one",
    "rounding_for",
    "sample_rows",
    "sparsegpt_matrix",
    "walk_batch",
    "Nearest",
    "Rescaled",
    "apply_factors",
    "check_same_everywhere",
    "fold_factors",
    "held_whole",
    "input_scales",
    "local_copy",
    "plan_folds",
    "plan_spread",
    "scale_leaf",
    "spanning_processes",
    "stats_span_processes",
]
