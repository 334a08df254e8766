"""The kernel kinds: one table every other kind list in lowbit derives from.

The compiled module carries the same facts for its weight-only kinds (`kinds()` of
`lowbit.kernels._cpu_kernels`, from `kKindTable` in cpu/common.h); a test checks the two agree.
"""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np

# How a kind's codes are offset before the scale: none (w = q * s), a fixed 8 (offset-binary
# int4 in the packed stream), or a float zero point per group stored with the scales.
ZERO_POINTS = ("none", "fixed8", "per_group")


@dataclasses.dataclass(frozen=True)
class KernelKind:
    """One kernel kind.

    name: the kind's name in `pack` / `PreparedWeight.kind`.
    kernel_id: the compiled weight-only kernel it runs on, None for w8a8 / w4a8 (int8
      activations, their own targets).
    code_dtype: dtype of the logical codes `pack` takes.
    pair_bytes: packed bytes holding 2 k-rows of a 16-column panel (16 for 4-bit codes,
      32 for 8-bit codes).
    lut: name of the 16-entry codebook the codes index (`_reference.CODEBOOKS`), else None.
    zero_point: one of `ZERO_POINTS`.
    formats: element-format names (`lowbit.formats`) of weight-only QArrays that run here.
    """

    name: str
    kernel_id: int | None
    code_dtype: np.dtype
    pair_bytes: int
    lut: str | None
    zero_point: str
    formats: tuple[str, ...] = ()


_TABLE = (
    KernelKind("int8", 0, np.dtype(jnp.int8), 32, None, "none", ("int8",)),
    KernelKind("int4", 1, np.dtype(jnp.uint8), 16, None, "fixed8", ("int4",)),
    KernelKind("uint4", 2, np.dtype(jnp.uint8), 16, None, "per_group", ("uint4",)),
    KernelKind("nf4", 3, np.dtype(jnp.uint8), 16, "nf4", "none", ("nf4",)),
    KernelKind("fp8", 4, np.dtype(jnp.float8_e4m3fn), 32, None, "none", ("fp8_e4m3fn",)),
    # E2M1 elements; block scales (E8M0, or e4m3 times a tensor scale) decode to float32 group
    # scales when the layout is built. Same kernel as nf4, another codebook.
    KernelKind("fp4", 3, np.dtype(jnp.uint8), 16, "fp4", "none", ("fp4_e2m1", "mxfp4", "nvfp4")),
    # Dynamic per-token int8 activations (no kernel id: their own FFI targets).
    KernelKind("w8a8", None, np.dtype(jnp.int8), 32, None, "none"),
    KernelKind("w4a8", None, np.dtype(jnp.uint8), 16, None, "none"),
)

KERNEL_KINDS: types.MappingProxyType[str, KernelKind] = types.MappingProxyType(
    {k.name: k for k in _TABLE}
)
"""Kind name -> `KernelKind`, in table order."""

KINDS = tuple(KERNEL_KINDS)
"""Every kind `pack` accepts."""

WEIGHT_ONLY_KINDS = tuple(k.name for k in _TABLE if k.kernel_id is not None)
"""Kinds run by the weight-only kernel (float activations)."""

KIND_IDS = types.MappingProxyType({k: KERNEL_KINDS[k].kernel_id for k in WEIGHT_ONLY_KINDS})
"""Weight-only kind -> compiled kernel id."""

FORMAT_KINDS = types.MappingProxyType({f: k.name for k in _TABLE for f in k.formats})
"""Element-format name of a weight-only QArray -> the kind that runs it."""

GGUF_TYPE_IDS = types.MappingProxyType(
    {
        "Q4_0": 0,
        "Q4_1": 1,
        "Q5_0": 2,
        "Q5_1": 3,
        "Q8_0": 4,
        "IQ4_NL": 5,
        "Q2_K": 6,
        "Q3_K": 7,
        "Q4_K": 8,
        "Q5_K": 9,
        "Q6_K": 10,
        "IQ4_XS": 11,
    }
)
"""GGML type -> the compiled kernels' type id (`cpu/gguf_blocks.h`): every type in
llama.cpp's K-quant and legacy mixes."""

GGUF_KINDS = tuple(t.lower() for t in GGUF_TYPE_IDS)
"""Kernel kind names of the GGUF block types (``"q4_k"``, ...), as the engine report shows
them (``"cpu_kernel_q4_k"``)."""
