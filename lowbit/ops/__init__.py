"""Quantized primitives: the math run when a `lax` primitive meets a `QArray` or `QatWeight`.

Each op takes the arguments of its `jax.lax` primitive (the jaxpr equation params), with a
`QArray` (PTQ), `QatWeight` (QAT) or `LoraWeight` (adapters) where a float array would be, and
has a `*_reference` twin (dequantize, then the float op) and a `*_path` function naming the
implementation it picks.
"""

from lowbit.ops._conv import (
    conv_general_dilated,
    conv_general_dilated_path,
    conv_general_dilated_reference,
)
from lowbit.ops._conv_qat import qat_conv_general_dilated
from lowbit.ops._cpu_kernels import (
    KERNEL_PATHS,
    MIN_WEIGHT_ELEMENTS,
    attach_kernel_layout,
    attach_kernel_layouts,
)
from lowbit.ops._dot_general import PATHS, dot_general, dot_general_path, dot_general_reference
from lowbit.ops._fp8_scaling import (
    Fp8LayoutError,
    Fp8Scaling,
    Fp8State,
    Fp8Weight,
    fp8_dot_general,
)
from lowbit.ops._lora_weight import (
    LoraLayoutError,
    LoraWeight,
    is_lora_weight,
    lora_dot_general,
    lora_dot_general_path,
    lora_init,
)
from lowbit.ops._operand import quantize_activation
from lowbit.ops._qat import qat_dot_general
from lowbit.ops._qat_weight import QatWeight, is_qat_weight, qat_weight
from lowbit.ops._ragged_dot import (
    ragged_dot,
    ragged_dot_general,
    ragged_dot_general_path,
    ragged_dot_general_reference,
)
from lowbit.ops._ragged_dot_qat import qat_ragged_dot_general

__all__ = [
    "KERNEL_PATHS",
    "Fp8LayoutError",
    "Fp8Scaling",
    "Fp8State",
    "Fp8Weight",
    "LoraLayoutError",
    "LoraWeight",
    "MIN_WEIGHT_ELEMENTS",
    "PATHS",
    "QatWeight",
    "attach_kernel_layout",
    "attach_kernel_layouts",
    "conv_general_dilated",
    "conv_general_dilated_path",
    "conv_general_dilated_reference",
    "dot_general",
    "dot_general_path",
    "dot_general_reference",
    "fp8_dot_general",
    "is_lora_weight",
    "is_qat_weight",
    "lora_dot_general",
    "lora_dot_general_path",
    "lora_init",
    "qat_conv_general_dilated",
    "qat_dot_general",
    "qat_ragged_dot_general",
    "qat_weight",
    "quantize_activation",
    "ragged_dot",
    "ragged_dot_general",
    "ragged_dot_general_path",
    "ragged_dot_general_reference",
]
