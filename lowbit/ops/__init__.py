"""Quantized primitives: the math run when a `lax` primitive meets a `QArray` or `QatWeight`."""

from lowbit.ops._dot_general import PATHS, dot_general, dot_general_path, dot_general_reference
from lowbit.ops._operand import quantize_activation

__all__ = [
    "PATHS",
    "dot_general",
    "dot_general_path",
    "dot_general_reference",
    "quantize_activation",
]
