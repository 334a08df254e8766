"""lowbit: quantization for JAX.

Quantized weights are a pytree value, `QArray`, that flows through an unmodified model in place
of a float array; a small jaxpr interpreter (`run`) evaluates the model with them. Recipes say
which parameters get which formats. See the README for a tour.
"""

from lowbit import algorithms
from lowbit._version import __version__ as __version__
from lowbit.api import (
    Fp8Recipe,
    LoraConfig,
    LoraRule,
    SparseRule,
    apply_masks,
    calibrate,
    convert,
    fp8_apply,
    fp8_init,
    fp8_recipe,
    lora_apply,
    lora_init,
    lora_merge,
    lora_param_count,
    nm_masks,
    nm_sparsify_params,
    prepare,
    qat,
    quantize,
    quantize_model,
    quantize_params,
    run,
)
from lowbit.engine import EngineFallbackError, EngineReport, interpret, kernel_axes, trace_report
from lowbit.formats import FORMATS, Format, format_names, get_format
from lowbit.gguf import GGUFError
from lowbit.io import (
    CheckpointError,
    export_gguf,
    import_gguf,
    load_adapted_checkpoint,
    load_adapters,
    load_checkpoint,
    save_adapters,
    save_checkpoint,
)
from lowbit.models import generate
from lowbit.qarray import (
    MSE,
    RMS,
    AbsMax,
    AbsMean,
    Fixed,
    MinMax,
    PerBlock,
    Percentile,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QArray,
    QuantConfig,
    dequantize,
    fake_quant,
)
from lowbit.recipes import KVCacheConfig, Recipe, Rule, preset, preset_names

__all__ = [
    "algorithms",
    # formats and the quantized array (lowbit.formats, lowbit.qarray)
    "FORMATS",
    "Format",
    "format_names",
    "get_format",
    "QArray",
    "QuantConfig",
    "dequantize",
    "fake_quant",
    # how a scale is chosen: granularity, then calibration
    "PerTensor",
    "PerChannel",
    "PerGroup",
    "PerBlock",
    "PerToken",
    "AbsMax",
    "AbsMean",
    "Fixed",
    "MinMax",
    "MSE",
    "Percentile",
    "RMS",
    # recipes
    "Recipe",
    "Rule",
    "KVCacheConfig",
    "preset",
    "preset_names",
    # quantizing and running a model (lowbit.api, lowbit.engine)
    "quantize",
    "quantize_model",
    "quantize_params",
    "calibrate",
    "prepare",
    "run",
    "interpret",
    "kernel_axes",
    "trace_report",
    "EngineReport",
    "EngineFallbackError",
    # training: QAT, LoRA, fp8, sparsity
    "qat",
    "convert",
    "LoraConfig",
    "LoraRule",
    "lora_init",
    "lora_apply",
    "lora_merge",
    "lora_param_count",
    "Fp8Recipe",
    "fp8_recipe",
    "fp8_init",
    "fp8_apply",
    "SparseRule",
    "nm_masks",
    "nm_sparsify_params",
    "apply_masks",
    # files (lowbit.io) and generation (lowbit.models)
    "save_checkpoint",
    "load_checkpoint",
    "load_adapted_checkpoint",
    "save_adapters",
    "load_adapters",
    "CheckpointError",
    "export_gguf",
    "import_gguf",
    "GGUFError",
    "generate",
]
