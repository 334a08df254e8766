"""Products that accelerators compute their own way, registered in `_registry` by (weight
format, platform): the Pallas weight-only kernel on CUDA (and TPU when asked for), and CUDA's
activation-quantized GEMMs through a K-major copy of the weight's codes. Each is decided per
product from static facts; `_dot_general` binds it as its platform's implementation.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np
from jax import lax

# Imported with lowbit, not on first use inside a trace: Pallas's TPU module registers a
# trace-context setting when first imported, and a trace context that grows between two
# calls of a jitted function makes JAX trace and compile it again (a QLoRA training step
# compiled twice, about 70 s more and a second executable resident). About 0.25 s of import.
from lowbit.kernels import pallas
from lowbit.ops._cpu_kernels import FLOAT_ACTIVATIONS, contract_axis, split_over_devices
from lowbit.ops._operand import quantized
from lowbit.ops._registry import Call, Kernel, register

# Below this many weight elements a CUDA lowering keeps XLA's fused dequantize-and-dot: on an
# H200, SmolLM2's layers (at most 576 x 1536) decoded at 214 tok/s through the Pallas kernel
# against 326 through XLA (launch and split-K overhead on small products); at 4096 x 4096
# the kernel and bf16 tie at M = 1 and the kernel wins above. TPU lowerings use the same
# bound (not measured there).
GPU_MIN_WEIGHT_ELEMENTS = 1 << 22
# The TPU body has not run on a TPU yet (interpreter and lowering only), so TPU lowerings keep
# XLA's product unless this is set to 1.
TPU_KERNELS_ENV = "LOWBIT_TPU_KERNELS"


# CUDA's int8 and fp8 GEMMs are fast with the weight K-major ([N, K]); given a Flax [K, N]
# weight XLA takes slower ones, and folds a plain transpose back into the dot. A transposed
# copy of the codes behind an optimization barrier (K x N bytes, for this call only) measured
# faster on an H200 at 8192 x 8192 (one-off probe, 2026-11-27): fp8 0.47 -> 0.074 ms at M = 16
# and 0.84 -> 0.43 ms at M = 4096; int8 0.12 -> 0.079 ms at M = 256 and 0.81 -> 0.45 ms at
# M = 4096, but 0.030 -> 0.072 ms at M = 16. So: fp8 at every M, int8 from 256 rows.
CUDA_K_MAJOR_MIN_ROWS = {"fp8_e4m3fn": 1, "int8": 256}


def _k_major(lhs: Any, rhs: Any, dimension_numbers: Any) -> bool | None:
    """True when a CUDA lowering multiplies this int8 / fp8 activation-quantized `[K, N]`
    weight through a transposed copy of its codes (see `CUDA_K_MAJOR_MIN_ROWS`), else None."""
    if quantized(lhs) or rhs.activation is None:
        return None
    min_rows = CUDA_K_MAJOR_MIN_ROWS.get(rhs.fmt.name)
    if min_rows is None or rhs.packed_axis is not None or not hasattr(lhs, "shape"):
        return None
    if contract_axis(lhs, rhs, dimension_numbers) != 0:
        return None
    if split_over_devices(lhs) or split_over_devices(rhs.codes):
        return None  # XLA partitions the dot of sharded operands; a copy would gather
    return True if math.prod(lhs.shape[:-1]) >= min_rows else None


def _run_k_major(lhs: Any, rhs: Any, config: bool, call: Call) -> Any:
    # [K, N] -> [N, K]: the barrier keeps XLA from folding the copy back into the dot.
    weight = rhs.transpose((1, 0))
    weight = dataclasses.replace(weight, codes=lax.optimization_barrier(weight.codes))
    (lc, _), batch = call.dimension_numbers
    return call.portable(lhs, weight, ((lc, (1,)), batch))


def _pallas_decision(platform: str, lhs: Any, rhs: Any, dimension_numbers: Any):
    """(`platform`, None) when its lowering runs this product in the Pallas weight-only kernel
    (`lowbit.kernels.pallas`: int4 / uint4 / nf4 / int8 codes dequantized on chip, read as
    stored), else (None, why not, or None when another product is meant to run it). Only
    plain linear layers `x [..., K] @ q [K, N]`; activation-quantized weights (w8a8, fp8)
    take the portable path, whose int8 / fp8 `dot_general` XLA already gives to the integer
    and fp8 GEMMs. TPU only with ``LOWBIT_TPU_KERNELS=1`` (see `TPU_KERNELS_ENV`)."""
    if platform == "tpu" and os.environ.get(TPU_KERNELS_ENV, "") in ("", "0"):
        return None, None
    if quantized(lhs) or rhs.activation is not None:
        return None, None
    if not hasattr(lhs, "dtype") or np.dtype(lhs.dtype) not in FLOAT_ACTIVATIONS:
        return None, f"activations of dtype {getattr(lhs, 'dtype', type(lhs).__name__)}"
    if contract_axis(lhs, rhs, dimension_numbers) != 0:
        return None, "the product contracts the weight's axis 1 (the kernel reads [K, N])"
    if split_over_devices(lhs) or split_over_devices(rhs.codes):
        # The kernel sees one device's whole operand (`split_over_devices`).
        return None, "a sharded operand (XLA partitions the product)"
    if math.prod(rhs.shape) < GPU_MIN_WEIGHT_ELEMENTS:  # XLA's own fusion is faster there
        return None, f"a weight under GPU_MIN_WEIGHT_ELEMENTS ({GPU_MIN_WEIGHT_ELEMENTS})"
    m = math.prod(lhs.shape[:-1])
    if m < 1:
        return None, "an empty batch"
    # What `pallas.supports` checks besides the activations' dtype (above): the tiles, or the
    # kernel's own words for a shape or weight it cannot take.
    try:
        pallas.blocks_for(rhs, m, platform=platform, x_dtype=lhs.dtype)
    except ValueError as e:
        return None, str(e)
    return platform, None


def _pallas_on(platform: str):
    def applies(lhs: Any, rhs: Any, dimension_numbers: Any) -> str | None:
        return _pallas_decision(platform, lhs, rhs, dimension_numbers)[0]

    def declines(lhs: Any, rhs: Any, dimension_numbers: Any) -> str | None:
        return _pallas_decision(platform, lhs, rhs, dimension_numbers)[1]

    return applies, declines


def _run_pallas(lhs: Any, rhs: Any, platform: str, call: Call) -> Any:
    return pallas.weight_only_matmul(
        lhs, rhs, out_dtype=call.out_dtype, differentiable=False, platform=platform
    )


PALLAS_FORMATS = ("int4", "uint4", "nf4", "int8")
for _platform in ("cuda", "tpu"):
    _applies, _declines = _pallas_on(_platform)
    register(Kernel("pallas", _platform, PALLAS_FORMATS, _applies, _run_pallas, declines=_declines))
register(Kernel("k_major", "cuda", tuple(CUDA_K_MAJOR_MIN_ROWS), _k_major, _run_k_major))
