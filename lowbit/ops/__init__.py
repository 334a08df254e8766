"""Quantized primitives: the math run when a `lax` primitive meets a `QArray` or `QatWeight`.

Each op takes the arguments of its `jax.lax` primitive (the jaxpr equation params), with a
`QArray` (PTQ), `QatWeight` (QAT) or `LoraWeight` (adapters) where a float array would be, and
has a `*_reference` twin (dequantize, then the float op) and a `*_path` function naming the
implementation it picks.
Served weights may be `PreparedQArray`s (`prepare_weights`): the CPU kernels' layout in place
of the codes, used by the linear layer they were prepared for, logical everywhere else.
"""

from lowbit.ops._conv import (
    conv_general_dilated,
    conv_general_dilated_path,
    conv_general_dilated_reference,
)
from lowbit.ops._cpu_kernels import KERNEL_PATHS, MIN_WEIGHT_ELEMENTS
from lowbit.ops._cpu_kernels import contract_axis as linear_contraction_axis
from lowbit.ops._dot_general import (
    PATHS,
    DotPlan,
    dot_general,
    dot_general_path,
    dot_general_reference,
    plan_dot_general,
)
from lowbit.ops._fp8_scaling import (
    Fp8LayoutError,
    Fp8Scaling,
    Fp8State,
    Fp8Weight,
    fp8_dot_general,
)
from lowbit.ops._fp8_scaling import init_state as fp8_init_state
from lowbit.ops._hadamard import hadamard_matrix, hadamard_transform
from lowbit.ops._hadamard_weight import HadamardInput, rotate_weight_input
from lowbit.ops._lora_weight import (
    LoraLayoutError,
    LoraWeight,
    lora_dot_general,
    lora_init,
)
from lowbit.ops._operand import quantize_activation
from lowbit.ops._prepare_tree import (
    logical_weights,
    on_explicit_axes,
    prepare_leaves,
    prepare_weights,
    with_int8_activations,
)
from lowbit.ops._prepared import (
    PreparedPieces,
    PreparedQArray,
    gguf_twin_tiles,
    is_prepared,
    prepare_transposed,
    prepare_weight,
)
from lowbit.ops._qat_weight import (
    QatWeight,
    qat_conv_general_dilated,
    qat_dot_general,
    qat_ragged_dot_general,
    qat_weight,
)
from lowbit.ops._ragged_dot import (
    ragged_dot,
    ragged_dot_general,
    ragged_dot_general_path,
    ragged_dot_general_reference,
)

__all__ = [
    "KERNEL_PATHS",
    "Fp8LayoutError",
    "Fp8Scaling",
    "Fp8State",
    "Fp8Weight",
    "HadamardInput",
    "LoraLayoutError",
    "LoraWeight",
    "MIN_WEIGHT_ELEMENTS",
    "PATHS",
    "DotPlan",
    "PreparedPieces",
    "PreparedQArray",
    "QatWeight",
    "conv_general_dilated",
    "conv_general_dilated_path",
    "conv_general_dilated_reference",
    "dot_general",
    "dot_general_path",
    "plan_dot_general",
    "dot_general_reference",
    "fp8_dot_general",
    "gguf_twin_tiles",
    "hadamard_matrix",
    "hadamard_transform",
    "is_prepared",
    "linear_contraction_axis",
    "logical_weights",
    "lora_dot_general",
    "lora_init",
    "prepare_leaves",
    "prepare_transposed",
    "prepare_weight",
    "prepare_weights",
    "qat_conv_general_dilated",
    "qat_dot_general",
    "qat_ragged_dot_general",
    "qat_weight",
    "quantize_activation",
    "ragged_dot",
    "rotate_weight_input",
    "ragged_dot_general",
    "ragged_dot_general_path",
    "ragged_dot_general_reference",
    "with_int8_activations",
    "fp8_init_state",
    "on_explicit_axes",
]
