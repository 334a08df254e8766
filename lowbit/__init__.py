"""lowbit: quantization for JAX.

Quantized weights are a pytree value, `QArray`, that flows through an unmodified model in place
of a float array; a small jaxpr interpreter (`run`) evaluates the model with them. Recipes say
which parameters get which formats. See the README for a tour.
"""

__version__ = "0.1.0"

from lowbit import algorithms
from lowbit.api import calibrate, convert, qat, quantize, quantize_model, quantize_params, run
from lowbit.engine import EngineFallbackError, EngineReport, interpret, trace_report
from lowbit.formats import FORMATS, Format, format_names, get_format
from lowbit.io import (
    CheckpointError,
    GGUFError,
    import_gguf,
    load_checkpoint,
    save_checkpoint,
)
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
from lowbit.recipes import Recipe, Rule, preset, preset_names

__all__ = [
    "FORMATS",
    "MSE",
    "RMS",
    "AbsMax",
    "AbsMean",
    "CheckpointError",
    "EngineFallbackError",
    "EngineReport",
    "GGUFError",
    "Fixed",
    "Format",
    "MinMax",
    "PerBlock",
    "PerChannel",
    "PerGroup",
    "PerTensor",
    "PerToken",
    "Percentile",
    "QArray",
    "QuantConfig",
    "Recipe",
    "Rule",
    "algorithms",
    "calibrate",
    "convert",
    "dequantize",
    "fake_quant",
    "format_names",
    "get_format",
    "import_gguf",
    "interpret",
    "load_checkpoint",
    "preset",
    "preset_names",
    "qat",
    "quantize",
    "quantize_model",
    "quantize_params",
    "run",
    "save_checkpoint",
    "trace_report",
]
