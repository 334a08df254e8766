"""Fast CPU kernels for quantized linear layers, through XLA's FFI.

Weights are packed once with `pack` (layouts in `lowbit.kernels._layout`) and then used
by the kernels on plain arrays:

- `weight_only_linear(x, w, bias=None, *, out_dtype=None, int8_activations=False)`: x
  `[..., K]` float32|bfloat16 times an int8 / int4 / uint4 / nf4 / fp4 (E2M1) / fp8 weight
  `[K, N]` dequantized in registers (or, asked for, int8 activations per row and weight
  group in integer dots: `int8_activations_supported(kind)`).
- `w8a8_linear(x, w, bias=None, *, out_dtype=None)`: dynamic per-token int8 activations
  times an int8 weight, int32 accumulation, per-channel scale epilogue.
- `w4a8_linear(x, w, bias=None, *, out_dtype=None)`: the same dynamic int8 activations times
  int4 weights (per group or per channel), exact int32 products per group.
- `w8a8_linear_quantized(xq, x_scale, w, bias=None, *, out_dtype=float32)` and
  `w8a8_matmul_int32(xq, w)`: the same on already-quantized activations `xq [M, K] int8`.
- `dequantize_weight(w)`: the float32 `[K, N]` of a prepared weight-only layout (for a GEMM
  outside the kernels at prefill sizes).
- `gguf_linear(x, rows, ggml_type, *, out_dtype=None, int8_activations=False)` and
  `gguf_dequantize(rows, ggml_type, k)`: weights held as a GGUF file's block rows
  `uint8 [N, row_bytes]` (every type of llama.cpp's mixes, `GGUF_TYPE_IDS`), read as stored,
  or (Q4_K, Q6_K) as tiles of 8 rows: `gguf_tile` / `gguf_untile`, `tiled=True`; the
  types of `TILES_OVER_ROWS` have tiles the size of their rows, written over them by a
  program that donates them.
  `q4_0_rows` / `q4_0_fields`: signed int4 codes with float16 scales per 32 as Q4_0 rows
  and back (the same values: such a weight runs on Q4_0's tiles).
- `decode_attention(q, keys, values, start, slot)`: one query position per row attending to
  the filled slots of a float32 KV cache (the decode step of `lowbit.models`), one call per
  layer instead of a loop of small XLA ops; ``rows=`` reads some rows of a larger cache in
  place.
- `row_sum(x, square=False)`: the sum over the last axis in one fixed pairwise order, the
  same bits at any leading shape (the batch-invariant RMSNorm and softmax of `lowbit.models`).

Logical weights (inputs to `pack`, outputs of `prepared_to_logical`): codes `[K, N]`
(contraction axis first, like a Flax `Dense` kernel); scale `[G, N]` float32 with
G = ceil(K / group_size) or `[1, N]` per channel; zero_point `[G, N]` float32 (uint4 only).

Kernel kinds (name, compiled id, code dtype, packed bytes, codebook, zero point, the element
formats that run on them) are one table, `KERNEL_KINDS`; `FORMAT_KINDS` maps a weight-only
element format to its kind.

The compiled module picks the best instruction-set path at run time (AMX-INT8 tiles for w8a8,
AVX-512 VNNI, AVX-512BW, AVX2 with or without AVX-VNNI, portable); `LOWBIT_CPU_ISA` or
`set_isa` forces a lower one (a path the CPU lacks is refused with an error).
Each entry point is chosen per lowering platform (`by_platform`, lowbit's one platform switch,
which the quantized products and the models' attention use too): the FFI call where the
program is lowered for CPU, the pure-JAX reference (same result) for CUDA, TPU
or any other platform, so a program traced on a CPU host exports to accelerators. When the
module is missing or `LOWBIT_DISABLE_KERNELS=1` is set, every platform takes the reference, and
`status()` says why.
"""

from __future__ import annotations

import jax.numpy as jnp

from lowbit.kernels._gguf import (
    TILES_OVER_ROWS,
    gguf_dequantize,
    gguf_linear,
    gguf_tile,
    gguf_tileable,
    gguf_untile,
    is_tiled,
    q4_0_fields,
    q4_0_rows,
)
from lowbit.kernels._kinds import (
    FORMAT_KINDS,
    GGUF_KINDS,
    GGUF_TYPE_IDS,
    KERNEL_KINDS,
    KINDS,
    KernelKind,
)
from lowbit.kernels._layout import (
    W8A8_MAX_K,
    PreparedWeight,
    pack,
    prepared_columns,
    prepared_to_logical,
)
from lowbit.kernels._native import (
    INT8_ACTIVATION_KINDS,
    ISAS,
    available,
    ffi_targets,
    int8_activations_supported,
    set_isa,
    status,
    supported_isas,
)
from lowbit.kernels._ops import (
    decode_attention,
    dequantize_weight,
    row_sum,
    w4a8_linear,
    w8a8_linear,
    w8a8_linear_quantized,
    w8a8_matmul_int32,
    weight_only_linear,
)
from lowbit.kernels._platform import PLATFORMS, by_platform, by_platform_p
from lowbit.kernels._reference import FP4_LEVELS, NF4_LEVELS, quantize_per_token

__all__ = [
    "FORMAT_KINDS",
    "FP4_LEVELS",
    "GGUF_KINDS",
    "GGUF_TYPE_IDS",
    "KERNEL_KINDS",
    "KINDS",
    "KernelKind",
    "INT8_ACTIVATION_KINDS",
    "NF4_LEVELS",
    "PLATFORMS",
    "PreparedWeight",
    "TILES_OVER_ROWS",
    "available",
    "by_platform",
    "by_platform_p",
    "int8_activations_supported",
    "decode_attention",
    "dequantize_weight",
    "ffi_targets",
    "gguf_dequantize",
    "gguf_linear",
    "gguf_tile",
    "gguf_tileable",
    "gguf_untile",
    "q4_0_fields",
    "q4_0_rows",
    "is_tiled",
    "pack",
    "prepared_columns",
    "prepared_to_logical",
    "quantize_per_token",
    "row_sum",
    "ISAS",
    "set_isa",
    "status",
    "supported_isas",
    "supports",
    "w4a8_linear",
    "w8a8_linear",
    "w8a8_linear_quantized",
    "w8a8_matmul_int32",
    "weight_only_linear",
]


def supports(kind: str, K: int, N: int, group_size: int | None, dtype) -> bool:  # noqa: N803
    """Whether a compiled kernel runs this case (else the pure-JAX reference would).

    kind: one of `KINDS`; K, N: weight shape [K, N]; group_size: along K (even, 4-bit kinds)
    or None per channel; dtype: activation dtype (float32 or bfloat16).
    """
    if not available() or kind not in KINDS or K < 1 or N < 1:
        return False
    try:
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            return False
    except TypeError:
        return False
    if group_size is not None:
        if kind == "w8a8":
            return False
        step = 8 if kind == "w4a8" else 2
        if group_size < step or group_size % step:
            return False
    return not (kind == "w8a8" and K > W8A8_MAX_K)
