"""`dot_general` on QArrays: weight-only, dynamic and static activation quantization.

Both operands are written as `(values - zero_point) * scale` (`_operand`). When each scale is
constant along the contraction, or varies along one contracting axis in groups, the product is

    out = sum_G  s_l * s_r * ( sum_k v_l v_r  -  z_r sum_k v_l  -  z_l sum_k v_r  +  n z_l z_r )

with `k` running over one group of `n` contracted elements and `G` over groups: one `lax`
dot of the stored values (int8 x int8 -> int32, fp8 x fp8 -> f32, or float x codes -> f32), a
few small correction terms, and the scales applied to the output (the epilogue). Grouped
scales split the contracting axis into `[G, n]` and make `G` a batch axis of the core dot.
Other layouts use `dot_general_reference` (dequantize, then `lax.dot_general`), reported by
`dot_general_path` as ``"reference"`` so callers can count fallbacks.

Plain linear layers with a layout the compiled kernels read go to `lowbit.kernels` where the
program is lowered for CPU (`_cpu_kernels`; paths ``"cpu_kernel_<kind>"``), with the pure-JAX
weight-only product as their gradient. The same traced program lowers, per platform
(`_platform.by_platform`), weight-only int4 / uint4 / nf4 / int8 linear layers to the Pallas
kernel on CUDA (`lowbit.kernels.pallas`) and everything else to the pure-JAX paths.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Imported with lowbit, not on first use inside a trace: Pallas's TPU module registers a
# trace-context setting when first imported, and a trace context that grows between two
# calls of a jitted function makes JAX trace and compile it again (a QLoRA training step
# compiled twice, about 70 s more and a second executable resident). About 0.25 s of import.
from lowbit.kernels import pallas
from lowbit.ops import _dims, _dot_path
from lowbit.ops._cpu_kernels import (
    FLOAT_ACTIVATIONS,
    KERNEL_PATHS,
    KernelRoute,
    builds_layout_per_call,
    contract_axis,
    kernel_linear,
    kernel_route,
    split_over_devices,
)
from lowbit.ops._dot_path import Plan, active_side, check_operand
from lowbit.ops._dot_path import plan as choose_plan
from lowbit.ops._input_scale import apply_input_scale, strip_input_scale
from lowbit.ops._operand import (
    Operand,
    core_dtypes,
    from_float,
    from_qarray,
    product_dtype,
    quantize_activation,
    reference_product,
)
from lowbit.ops._platform import by_platform
from lowbit.ops._prepared import PreparedQArray
from lowbit.qarray import QArray


def _quantize_activation_side(lhs, rhs, dimension_numbers):
    """(lhs, rhs) with the float operand facing a weight with an `activation` config quantized
    (per token, or with the static `activation_bounds`); others as they are."""
    (lc, rc), _ = dimension_numbers
    side, weight = active_side(lhs, rhs)
    if side == "lhs":
        lhs = quantize_activation(lhs, lc, weight.activation, weight.activation_bounds)
    elif side == "rhs":
        rhs = quantize_activation(rhs, rc, weight.activation, weight.activation_bounds)
    return lhs, rhs


def _to_operands(lhs, rhs, dimension_numbers):
    lhs, rhs = _quantize_activation_side(lhs, rhs, dimension_numbers)
    as_operand = lambda x: from_qarray(x) if isinstance(x, QArray) else from_float(x)
    return as_operand(lhs), as_operand(rhs)


def _group_sums(op: Operand, contracting, groups: dict[int, int]) -> jax.Array:
    """Sum of `op.values` over the contraction within each group, per-block shaped."""
    dtype = jnp.int32 if op.kind == "int" else jnp.float32
    values = op.values.astype(dtype)
    others = tuple(a for a in contracting if a not in groups)
    sums = jnp.sum(values, axis=others, keepdims=True) if others else values
    if not groups:
        return sums
    sums = _dims.split_axes(sums, groups)
    inner = tuple(a + 1 + sum(1 for g in groups if g < a) for a in groups)
    return jnp.sum(sums, axis=inner)


def _align_batch_shardings(lvalues, rvalues, dimension_numbers):
    """(lvalues, rvalues) with equal shardings on paired batch axes, on meshes with explicit axes.

    Groups become batch axes of the core product. A weight split over devices along its
    contraction has its groups sharded, while the activation's are not; `dot_general` requires
    batch axes sharded alike, so the side that is not split there is resharded to match (a
    local slice of a replicated operand, no communication).
    """
    _, (lb, rb) = dimension_numbers
    lsharding, rsharding = (getattr(jax.typeof(v), "sharding", None) for v in (lvalues, rvalues))
    lspec, rspec = (getattr(s, "spec", None) for s in (lsharding, rsharding))
    if lspec is None or rspec is None or not (any(lspec) or any(rspec)):
        return lvalues, rvalues
    lspec = list(lspec) + [None] * (lvalues.ndim - len(lspec))
    rspec = list(rspec) + [None] * (rvalues.ndim - len(rspec))
    lnew, rnew = list(lspec), list(rspec)
    for la, ra in zip(lb, rb, strict=True):
        if lspec[la] == rspec[ra]:
            continue
        if lspec[la] is None:
            lnew[la] = rspec[ra]
        else:
            rnew[ra] = lspec[la]
    # The mesh of the split side: a replicated operand may carry an empty one.
    mesh = rsharding.mesh if any(rspec) else lsharding.mesh
    if lnew != lspec:
        lvalues = jax.sharding.reshard(lvalues, NamedSharding(mesh, P(*lnew)))
    if rnew != rspec:
        rvalues = jax.sharding.reshard(rvalues, NamedSharding(mesh, P(*rnew)))
    return lvalues, rvalues


# XLA's CUDA int8 GEMM (the Triton emitter of JAX 0.11) returns wrong sums for short
# contractions: on an H200, int8 x int8 -> int32 products contracting 2 elements were wrong in
# every case tried and 16 in some (with the quantization fused into the product), none from 32
# up (one-off sweep, 2026-11-27). Grouped products contract one group, so groups of 16 and less
# meet it. A CUDA lowering multiplies these in float32 instead: exact, since every partial
# sum is an integer below K * 128 * 128 < 2**24.
CUDA_INT8_MIN_CONTRACTION = 32


def integer_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, out_sharding=None):
    """The exact int32 `lax.dot_general` of int8 operands on every platform (see
    `CUDA_INT8_MIN_CONTRACTION`)."""
    (lc, _), _ = dimension_numbers

    def exact(lhs, rhs):
        return lax.dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=jnp.int32, out_sharding=out_sharding
        )

    if math.prod(lhs.shape[a] for a in lc) >= CUDA_INT8_MIN_CONTRACTION:
        return exact(lhs, rhs)

    def in_float(lhs, rhs):
        f32 = lambda x: x.astype(jnp.float32)
        out = lax.dot_general(
            f32(lhs),
            f32(rhs),
            dimension_numbers,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
            out_sharding=out_sharding,
        )
        return out.astype(jnp.int32)

    return by_platform((lhs, rhs), {"cuda": in_float}, exact)


def _fast(
    lhs_op: Operand,
    rhs_op: Operand,
    dimension_numbers,
    plan: Plan,
    precision,
    out_dtype,
    out_sharding,
) -> jax.Array:
    (lc, rc), (lb, rb) = dimension_numbers
    pair_groups = dict(plan.groups)
    lgroups = {lc[p]: g for p, g in plan.groups}
    rgroups = {rc[p]: g for p, g in plan.groups}
    lvalues, rvalues = lhs_op.values, rhs_op.values
    ldtype, rdtype, acc_dtype = core_dtypes(lhs_op.kind, rhs_op.kind)
    if ldtype is not None:
        lvalues, rvalues = lvalues.astype(ldtype), rvalues.astype(rdtype)
    core_dims = dimension_numbers
    if pair_groups:
        lvalues = _dims.split_axes(lvalues, lgroups)
        rvalues = _dims.split_axes(rvalues, rgroups)
        core_dims = _dims.grouped_dimension_numbers(dimension_numbers, pair_groups)
        lvalues, rvalues = _align_batch_shardings(lvalues, rvalues, core_dims)
    out_sharding = None if pair_groups else out_sharding
    if acc_dtype == jnp.int32:
        acc = integer_dot(lvalues, rvalues, core_dims, out_sharding)
    else:
        acc = lax.dot_general(
            lvalues,
            rvalues,
            core_dims,
            precision=precision,
            preferred_element_type=acc_dtype,
            out_sharding=out_sharding,
        )
    acc = acc.astype(jnp.float32)

    lfree = len(_dims.free_axes(len(lhs_op.shape), lc, lb))
    rfree = len(_dims.free_axes(len(rhs_op.shape), rc, rb))
    # Per operand: its per-block arrays (scale, zero point, sums) -> the (grouped) output layout.
    sides = ((lhs_op, lc, lb, lgroups, rfree, True), (rhs_op, rc, rb, rgroups, lfree, False))
    to_l, to_r = (
        functools.partial(
            _dims.side_to_output,
            shape=op.shape,
            contracting=contracting,
            batch=batch,
            groups=groups,
            other_free=other_free,
            is_lhs=is_lhs,
        )
        for op, contracting, batch, groups, other_free, is_lhs in sides
    )
    lzero, rzero = lhs_op.zero_point, rhs_op.zero_point
    if rzero is not None:
        lsum = _group_sums(lhs_op, lc, lgroups).astype(jnp.float32)
        acc = acc - to_r(rzero) * to_l(lsum)
    if lzero is not None:
        rsum = _group_sums(rhs_op, rc, rgroups).astype(jnp.float32)
        acc = acc - to_l(lzero) * to_r(rsum)
    if lzero is not None and rzero is not None:
        n = _dims.contracted_size(lhs_op.shape, lc) // math.prod(pair_groups.values())
        acc = acc + float(n) * to_l(lzero) * to_r(rzero)
    if lhs_op.scale is not None:
        acc = acc * to_l(lhs_op.scale)
    if rhs_op.scale is not None:
        acc = acc * to_r(rhs_op.scale)
    if pair_groups:
        acc = jnp.sum(acc, axis=tuple(range(len(pair_groups))))
    return acc.astype(out_dtype)


def _dequantized(lhs, rhs, dimension_numbers):
    lhs, rhs = _quantize_activation_side(lhs, rhs, dimension_numbers)
    deq = lambda x, like: x.dequantize(like.dtype) if isinstance(x, QArray) else x
    return deq(lhs, lhs), deq(rhs, rhs)


def dot_general_reference(
    lhs: jax.Array | QArray, rhs: jax.Array | QArray, dimension_numbers: Any, **options: Any
) -> jax.Array:
    """Dequantize-then-dot: the semantics `dot_general` implements, computed the slow way.

    A float operand facing a QArray with an `activation` config is quantized exactly as
    `dot_general` does (per token, or with the static `activation_bounds`) and dequantized.

    Args:
      lhs, rhs, dimension_numbers: as `dot_general`.
      **options: `precision`, `preferred_element_type`, `out_sharding`, as `dot_general`.
    Returns:
      As `dot_general`.
    """
    dimension_numbers = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
    check_operand(lhs, "lhs")
    check_operand(rhs, "rhs")
    lhs_f, rhs_f = _dequantized(lhs, rhs, dimension_numbers)
    # The requested output dtype is not the accumulation dtype (`reference_product` widens it).
    out_dtype = product_dtype(lhs, rhs, options.pop("preferred_element_type", None))
    return reference_product(
        lax.dot_general, lhs_f, rhs_f, dimension_numbers, out_dtype=out_dtype, **options
    )


def _forward(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding):
    plan = choose_plan(lhs, rhs, dimension_numbers)
    if plan.path == "reference" or (plan.groups and out_sharding is not None):
        return dot_general_reference(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )
    lhs_op, rhs_op = _to_operands(lhs, rhs, dimension_numbers)
    out_dtype = product_dtype(lhs, rhs, preferred_element_type)
    return _fast(lhs_op, rhs_op, dimension_numbers, plan, precision, out_dtype, out_sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _ste_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding):
    return _forward(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding)


def _ste_fwd(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding):
    out = _forward(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding)
    return out, (lhs, rhs)


def _ste_bwd(dimension_numbers, precision, preferred_element_type, out_sharding, residuals, g):
    # Straight-through: the rounding of the on-the-fly quantized operand is treated as the
    # identity, so its gradient is that of the weight-only product (which keeps the weight in
    # its stored form instead of dequantizing it).
    lhs, rhs = residuals
    if isinstance(rhs, QArray):
        weight = dataclasses.replace(rhs, activation=None, activation_bounds=None)
        fn = lambda x: _forward(x, weight, dimension_numbers, precision, None, None)
        (dx,) = jax.vjp(fn, lhs)[1](g.astype(lhs.dtype))
        return dx, None
    weight = dataclasses.replace(lhs, activation=None, activation_bounds=None)
    fn = lambda x: _forward(weight, x, dimension_numbers, precision, None, None)
    (dx,) = jax.vjp(fn, rhs)[1](g.astype(rhs.dtype))
    return None, dx


_ste_dot.defvjp(_ste_fwd, _ste_bwd)


# The kernels are FFI calls without derivative rules: the gradient is the STE one above.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _kernel_dot(lhs, rhs, route: KernelRoute, dimension_numbers, precision, out_dtype):
    return kernel_linear(lhs, rhs, route, out_dtype)


def _kernel_fwd(lhs, rhs, route, dimension_numbers, precision, out_dtype):
    return kernel_linear(lhs, rhs, route, out_dtype), (lhs, rhs)


def _logical_ste_bwd(dimension_numbers, precision, residuals, g):
    """The straight-through gradient of a kernel call: that of the weight-only product with the
    weight in its logical form (a prepared layout is for the forward kernel only)."""
    lhs, rhs = residuals
    if isinstance(rhs, PreparedQArray):
        rhs = rhs.logical()
    return _ste_bwd(dimension_numbers, precision, None, None, (lhs, rhs), g)


def _kernel_bwd(route, dimension_numbers, precision, out_dtype, residuals, g):
    return _logical_ste_bwd(dimension_numbers, precision, residuals, g)


def _prepared_route(lhs, rhs, dimension_numbers, out_sharding) -> tuple[Any, Any, Any]:
    """(lhs, rhs, route): a `PreparedQArray` operand keeps its layout when the call is the
    linear layer it was prepared for; anywhere else it becomes its logical QArray."""
    route = None
    if isinstance(rhs, PreparedQArray) and not isinstance(lhs, QArray | PreparedQArray):
        dims = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
        floats = hasattr(lhs, "dtype") and np.dtype(lhs.dtype) in FLOAT_ACTIVATIONS
        if out_sharding is None and floats and contract_axis(lhs, rhs, dims) == rhs.axis:
            route = rhs.route
    if route is None:
        lhs, rhs = (x.logical() if isinstance(x, PreparedQArray) else x for x in (lhs, rhs))
    return lhs, rhs, route


def _call_route(lhs, rhs, dimension_numbers, out_sharding) -> tuple[Any, Any, Any, Any, bool]:
    """(lhs, rhs, dims, route, kept_layout), as `dot_general` will see the call: the operands
    without input scales (which change no path), a `PreparedQArray` used elsewhere than its
    linear layer made logical; `route`, the kernel route or None; `kept_layout`, whether
    `route` is a prepared weight's own layout (then `dims` is None)."""
    lhs, rhs = strip_input_scale(lhs), strip_input_scale(rhs)
    lhs, rhs, route = _prepared_route(lhs, rhs, dimension_numbers, out_sharding)
    if route is not None:
        return lhs, rhs, None, route, True
    dims = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
    return lhs, rhs, dims, kernel_route(lhs, rhs, dims, out_sharding=out_sharding), False


_kernel_dot.defvjp(_kernel_fwd, _kernel_bwd)
# Under jit, one trace per (shapes, route): a model's many same-shaped layers reuse it, which
# halved the engine's trace time of a 32-layer MLP against tracing the kernel call each time.
_kernel_dot_jit = jax.jit(_kernel_dot, static_argnums=(2, 3, 4, 5))

# jax.custom_vjp computes its debug info from `inspect.signature(fun)` on every call; stored
# once, the engine's trace of a model with many quantized matmuls gets measurably shorter.
for _fn in (_ste_dot.fun, _kernel_dot.fun):
    _fn.__signature__ = inspect.signature(_fn)
del _fn

PATHS = (*_dot_path.PATHS, *KERNEL_PATHS)
"""Every name `dot_general_path` returns."""


def dot_general_path(
    lhs: Any, rhs: Any, dimension_numbers: Any, *, out_sharding: Any = None
) -> str:
    """Which implementation `dot_general` uses for these operands (one of `PATHS`).

    Depends only on static information (shapes, dtypes, formats, scale layouts, whether the
    CPU kernels are available), so the engine can call it at trace time to count fallbacks
    (``"reference"``) and report paths such as ``"cpu_kernel_int4"``.

    Args:
      lhs, rhs, dimension_numbers: as `dot_general`.
      out_sharding: as `dot_general` (a requested sharding keeps the pure-JAX paths).
    Returns:
      The path name.
    """
    lhs, rhs, dims, route, _ = _call_route(lhs, rhs, dimension_numbers, out_sharding)
    if route is not None:
        return route.path
    return _dot_path.dot_general_path(lhs, rhs, dims)


def per_call_layout(lhs: Any, rhs: Any, dimension_numbers: Any, *, out_sharding: Any = None):
    """The weight operand that `dot_general` re-lays out on every call, or None.

    Two cases cost a full pass over a weight's codes per call, which a weight prepared once for
    its use does not: a logical `QArray` routed to a CPU kernel (its layout is built inside the
    call), and a `PreparedQArray` used other than as the linear layer it was prepared for (its
    logical QArray is recovered inside the call). The engine counts both as fallbacks.
    """
    prepared = next(
        (strip_input_scale(x) for x in (rhs, lhs) if isinstance(x, PreparedQArray)), None
    )
    lhs, rhs, _, route, kept_layout = _call_route(lhs, rhs, dimension_numbers, out_sharding)
    if kept_layout:
        return None
    if prepared is not None:
        return prepared
    if route is not None and builds_layout_per_call(lhs, rhs, route):
        return rhs
    return None


def dot_general(
    lhs: jax.Array | QArray,
    rhs: jax.Array | QArray,
    dimension_numbers: Any,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
    """`lax.dot_general` where either operand may be a `QArray`.

    The mode follows the QArray's static `activation` field: None computes weight-only (the
    other operand stays float; the scale is applied after the dot, per group if the scale is
    grouped along the contraction); a `QuantConfig` quantizes the float operand per token (or
    with the static `activation_bounds`) and multiplies stored codes (int8 x int8 -> int32,
    fp8 x fp8 -> f32). With two QArrays their stored codes are multiplied as they are. A
    weight's `input_scale` multiplies the float operand first (before it is quantized).

    On CPU, a plain linear layer (`x: [..., K]`, `w: QArray [K, N]`) in a layout the compiled
    kernels read runs in `lowbit.kernels` (see `dot_general_path`); ``LOWBIT_DISABLE_KERNELS=1``
    keeps the pure-JAX paths.

    Differentiable with respect to a float operand (frozen quantized weights, QLoRA): the
    gradient is `g . dequantized weight`, straight through the activation's rounding.

    Args:
      lhs, rhs: float arrays or QArrays, e.g. `x: [batch, in] float32`, `w: QArray [in, out]`.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
      precision: passed to float core dots.
      preferred_element_type: output dtype (default: the float operand's dtype, or the
        QArrays' logical dtypes promoted).
      out_sharding: passed to the core dot.
    Returns:
      [batch..., lhs_free..., rhs_free...] as `lax.dot_general`.
    Raises:
      TypeError: for an operand that is neither a float array nor a QArray.
      ValueError: for malformed dimension numbers or an unsupported activation granularity.
    """
    lhs, rhs = apply_input_scale(lhs, rhs, dimension_numbers)
    lhs, rhs, route = _prepared_route(lhs, rhs, dimension_numbers, out_sharding)
    check_operand(lhs, "lhs")
    check_operand(rhs, "rhs")
    dimension_numbers = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
    if route is not None:
        # A prepared weight: its logical QArray is recovered off CPU, by the portable product.
        return _routed(lhs, rhs, route, dimension_numbers, precision, preferred_element_type, ())
    if not isinstance(lhs, QArray) and not isinstance(rhs, QArray):
        return lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding=out_sharding,
        )
    route = kernel_route(lhs, rhs, dimension_numbers, out_sharding=out_sharding)
    accelerated = () if out_sharding is not None else accelerator_rules(lhs, rhs, dimension_numbers)
    if route is not None or accelerated:
        return _routed(
            lhs, rhs, route, dimension_numbers, precision, preferred_element_type, accelerated
        )
    return _portable(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding)


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


def accelerator_rules(lhs: Any, rhs: Any, dimension_numbers: Any) -> tuple[tuple[str, str], ...]:
    """(platform, how) for each accelerator whose lowering computes this product its own way:
    "pallas" (the weight-only kernel, `pallas_platforms`) or "k_major" (CUDA: an
    activation-quantized `[K, N]` weight multiplied through a K-major copy of its codes, see
    `CUDA_K_MAJOR_MIN_ROWS`)."""
    rules = tuple((p, "pallas") for p in pallas_platforms(lhs, rhs, dimension_numbers))
    if cuda_k_major(lhs, rhs, dimension_numbers):
        rules += (("cuda", "k_major"),)
    return rules


def cuda_k_major(lhs: Any, rhs: Any, dimension_numbers: Any) -> bool:
    """Whether a CUDA lowering multiplies this int8 / fp8 activation-quantized `[K, N]` weight
    through a transposed copy of its codes (see `CUDA_K_MAJOR_MIN_ROWS`)."""
    if isinstance(lhs, QArray) or not isinstance(rhs, QArray) or rhs.activation is None:
        return False
    min_rows = CUDA_K_MAJOR_MIN_ROWS.get(rhs.format)
    if min_rows is None or rhs.packed_axis is not None or not hasattr(lhs, "shape"):
        return False
    if contract_axis(lhs, rhs, dimension_numbers) != 0:
        return False
    if split_over_devices(lhs) or split_over_devices(rhs.codes):
        return False  # XLA partitions the dot of sharded operands; a copy would gather
    return math.prod(lhs.shape[:-1]) >= min_rows


def pallas_platforms(lhs: Any, rhs: Any, dimension_numbers: Any) -> tuple[str, ...]:
    """The platforms ("cuda", "tpu") whose lowering runs this product in the Pallas
    weight-only kernel (`lowbit.kernels.pallas`: int4 / uint4 / nf4 / int8 codes dequantized
    on chip, read as stored). Only plain linear layers `x [..., K] @ q [K, N]`;
    activation-quantized weights (w8a8, fp8) take the portable path, whose int8 / fp8
    `dot_general` XLA already gives to the integer and fp8 GEMMs. TPU only with
    ``LOWBIT_TPU_KERNELS=1`` (see `TPU_KERNELS_ENV`)."""
    if isinstance(lhs, QArray) or not isinstance(rhs, QArray) or rhs.activation is not None:
        return ()
    if not hasattr(lhs, "dtype") or np.dtype(lhs.dtype) not in FLOAT_ACTIVATIONS:
        return ()
    if contract_axis(lhs, rhs, dimension_numbers) != 0:
        return ()
    if split_over_devices(lhs) or split_over_devices(rhs.codes):
        return ()  # the kernel sees one device's whole operand (see `split_over_devices`)
    if math.prod(rhs.shape) < GPU_MIN_WEIGHT_ELEMENTS:  # XLA's own fusion is faster there
        return ()
    m = math.prod(lhs.shape[:-1])
    platforms = ["cuda"]
    if os.environ.get(TPU_KERNELS_ENV, "") not in ("", "0"):
        platforms.append("tpu")
    return tuple(p for p in platforms if pallas.supports(rhs, m, lhs.dtype, p) == "pallas")


def _portable(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding):
    """The pure-JAX product of a float operand or QArray with a QArray (every platform)."""
    side, _ = active_side(lhs, rhs)
    if side is None:
        return _forward(
            lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding
        )
    return _ste_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding)


def _routed(lhs, rhs, route, dimension_numbers, precision, preferred_element_type, accelerated):
    """A product with a kernel on some platform, chosen per lowering platform so one traced
    program exports anywhere: the CPU kernel (`route`) where the program is lowered for CPU,
    the accelerators' own products (`accelerated`, from `accelerator_rules`), the portable
    product everywhere else (a prepared weight recovers its logical QArray there). One
    straight-through derivative rule covers every branch."""
    out_dtype = product_dtype(lhs, rhs, preferred_element_type)
    return _by_platform(
        lhs,
        rhs,
        route,
        dimension_numbers,
        precision,
        preferred_element_type,
        out_dtype,
        accelerated,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _by_platform(lhs, rhs, route, dimension_numbers, precision, preferred, out_dtype, accelerated):
    def on_cpu(lhs, rhs):
        return _kernel_dot_jit(lhs, rhs, route, dimension_numbers, precision, out_dtype)

    def kernel_on(platform):
        def run(lhs, rhs):
            return pallas.weight_only_matmul(
                lhs, rhs, out_dtype=out_dtype, differentiable=False, platform=platform
            )

        return run

    def elsewhere(lhs, rhs):
        rhs = rhs.logical() if isinstance(rhs, PreparedQArray) else rhs
        return _portable(lhs, rhs, dimension_numbers, precision, preferred, None).astype(out_dtype)

    def k_major(lhs, rhs):
        # [K, N] -> [N, K]: the barrier keeps XLA from folding the copy back into the dot.
        weight = rhs.transpose((1, 0))
        weight = dataclasses.replace(weight, codes=lax.optimization_barrier(weight.codes))
        (lc, _), batch = dimension_numbers
        dims = ((lc, (1,)), batch)
        return _portable(lhs, weight, dims, precision, preferred, None).astype(out_dtype)

    rules = {"cpu": on_cpu} if route is not None else {}
    for platform, how in accelerated:
        rules[platform] = kernel_on(platform) if how == "pallas" else k_major
    return by_platform((lhs, rhs), rules, elsewhere)


def _by_platform_fwd(lhs, rhs, route, dimension_numbers, precision, preferred, out_dtype, accel):
    out = _by_platform(lhs, rhs, route, dimension_numbers, precision, preferred, out_dtype, accel)
    return out, (lhs, rhs)


def _by_platform_bwd(route, dimension_numbers, precision, preferred, out_dtype, accel, res, g):
    return _logical_ste_bwd(dimension_numbers, precision, res, g)


_by_platform.defvjp(_by_platform_fwd, _by_platform_bwd)
