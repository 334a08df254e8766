"""The user API: quantize params or Flax models by a recipe, run them, calibrate, QAT, convert,
LoRA adapters."""

from lowbit.api._algorithms import AlgorithmOptions
from lowbit.api._budget import (
    BudgetPlan,
    FileBytes,
    Measurements,
    TensorChoice,
    budget_bytes,
    check_budget,
    choose_plan,
    measure_candidates,
    plan_within,
    planned_weights,
)
from lowbit.api._calibrate import METHODS, activation_ranges, calibrate, with_activation_bounds
from lowbit.api._candidate_time import time_candidates
from lowbit.api._fp8 import FP8_PRESETS, Fp8Recipe, fp8_apply, fp8_init, fp8_recipe
from lowbit.api._lora import (
    LoraConfig,
    LoraRule,
    as_lora_config,
    check_adapters,
    lora_apply,
    lora_init,
    lora_merge,
    lora_param_count,
    lora_plan,
)
from lowbit.api._model import QuantizedLinen, QuantizedModel, quantize_model, run
from lowbit.api._prepare import prepare
from lowbit.api._qat import convert, qat
from lowbit.api._quantize import (
    algorithm_weights,
    as_recipe,
    check_decisions,
    fixed_bounds,
    kernel_axes_of,
    quantize,
    quantize_params,
    quantize_weight,
)
from lowbit.api._sparsegpt import sparsegpt_params
from lowbit.api._sparsity import SparseRule, apply_masks, nm_masks, nm_sparsify_params
from lowbit.api._stored import (
    LoweredProgram,
    StoredProgram,
    compile_stored,
    compile_together,
    describe,
    lower_stored,
    program_directory,
    program_key,
)
from lowbit.api._trace import param_uses

__all__ = [
    "BudgetPlan",
    "FileBytes",
    "Measurements",
    "measure_candidates",
    "plan_within",
    "time_candidates",
    "TensorChoice",
    "budget_bytes",
    "check_budget",
    "choose_plan",
    "AlgorithmOptions",
    "FP8_PRESETS",
    "METHODS",
    "SparseRule",
    "Fp8Recipe",
    "LoraConfig",
    "LoraRule",
    "QuantizedLinen",
    "QuantizedModel",
    "activation_ranges",
    "algorithm_weights",
    "apply_masks",
    "calibrate",
    "check_adapters",
    "convert",
    "fp8_apply",
    "fp8_init",
    "fp8_recipe",
    "kernel_axes_of",
    "lora_apply",
    "lora_init",
    "lora_merge",
    "lora_param_count",
    "nm_masks",
    "nm_sparsify_params",
    "param_uses",
    "prepare",
    "qat",
    "quantize",
    "quantize_model",
    "quantize_params",
    "quantize_weight",
    "run",
    "sparsegpt_params",
    "with_activation_bounds",
    "LoweredProgram",
    "StoredProgram",
    "compile_stored",
    "compile_together",
    "lower_stored",
    "describe",
    "program_directory",
    "program_key",
    "as_lora_config",
    "as_recipe",
    "check_decisions",
    "fixed_bounds",
    "lora_plan",
    "planned_weights",
]
