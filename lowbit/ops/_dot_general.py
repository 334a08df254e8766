"""`dot_general` on QArrays: weight-only, dynamic and static activation quantization.

Both operands are written as `(values - zero_point) * scale` (`_operand`). When each scale is
constant along the contraction, or varies along one contracting axis in groups, the product is

    out = sum_G  s_l * s_r * ( sum_k v_l v_r  -  z_r sum_k v_l  -  z_l sum_k v_r  +  n z_l z_r )

with `k` running over one group of `n` contracted elements and `G` over groups: one `lax`
dot of the stored values (int8 x int8 -> int32, fp8 x fp8 -> f32, or float x codes -> f32), a
few small correction terms, and the scales applied to the output (the epilogue). Grouped
scales split the contracting axis into `[G, n]` and make `G` a batch axis of the core dot.
Other layouts use `dot_general_reference` (dequantize, then `lax.dot_general`), reported by
`plan_dot_general` as ``"reference"`` so callers can count fallbacks.

Plain linear layers with a layout the compiled kernels read go to `lowbit.kernels` where the
program is lowered for CPU (`_cpu_kernels`; paths ``"cpu_kernel_<kind>"``), with the pure-JAX
weight-only product as their gradient. The same traced program lowers, per platform
(`lowbit.kernels.by_platform`), weight-only int4 / uint4 / nf4 / int8 linear layers to the Pallas
kernel on CUDA (`lowbit.kernels.pallas`) and everything else to the pure-JAX paths.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lowbit.kernels import by_platform

# `_accelerated` registers the Pallas and K-major kernels (`_cpu_kernels` the CPU ones).
from lowbit.ops import _accelerated, _dims, _dot_path, _registry  # noqa: F401
from lowbit.ops._cpu_kernels import CPU_KERNEL, FLOAT_ACTIVATIONS, KERNEL_PATHS, contract_axis
from lowbit.ops._dot_path import Plan
from lowbit.ops._dot_path import plan as choose_plan
from lowbit.ops._input_scale import apply_input_scale, strip_input_scale
from lowbit.ops._operand import (
    Operand,
    active_side,
    as_operand,
    check_operand,
    core_dtypes,
    dequantized,
    product_dtype,
    quantize_activation,
    quantized,
    reference_product,
)
from lowbit.ops._prepared import is_prepared
from lowbit.ops._registry import Call, Chosen
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
    return dequantized(lhs), dequantized(rhs)


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
    check_operand(lhs, "dot_general", "lhs")
    check_operand(rhs, "dot_general", "rhs")
    lhs_f, rhs_f = _dequantized(lhs, rhs, dimension_numbers)
    # The requested output dtype is not the accumulation dtype (`reference_product` widens it).
    out_dtype = product_dtype(lhs, rhs, options.pop("preferred_element_type", None))
    return reference_product(
        lax.dot_general, lhs_f, rhs_f, dimension_numbers, out_dtype=out_dtype, **options
    )


def _forward(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding, core):
    """The pure-JAX product; `core`, its `_dot_path.Plan` (None: planned here)."""
    core = core or choose_plan(lhs, rhs, dimension_numbers)
    if core.path == "reference" or (core.groups and out_sharding is not None):
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
    return _fast(lhs_op, rhs_op, dimension_numbers, core, precision, out_dtype, out_sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _ste_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding, core):
    return _forward(
        lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding, core
    )


def _ste_fwd(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding, core):
    out = _forward(
        lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding, core
    )
    return out, (lhs, rhs)


def _ste_bwd(dimension_numbers, precision, preferred_element_type, out_sharding, core, res, g):
    # Straight-through: the rounding of the on-the-fly quantized operand is treated as the
    # identity, so its gradient is that of the weight-only product (which keeps the weight in
    # its stored form instead of dequantizing it). That is another product: planned here.
    lhs, rhs = res
    if quantized(rhs):
        weight = dataclasses.replace(rhs, activation=None, activation_bounds=None)
        fn = lambda x: _forward(x, weight, dimension_numbers, precision, None, None, None)
        (dx,) = jax.vjp(fn, lhs)[1](g.astype(lhs.dtype))
        return dx, None
    weight = dataclasses.replace(lhs, activation=None, activation_bounds=None)
    fn = lambda x: _forward(weight, x, dimension_numbers, precision, None, None, None)
    (dx,) = jax.vjp(fn, rhs)[1](g.astype(rhs.dtype))
    return None, dx


_ste_dot.defvjp(_ste_fwd, _ste_bwd)


def _logical_ste_bwd(dimension_numbers, precision, residuals, g):
    """The straight-through gradient of a kernel's product: that of the weight-only product
    with the weight in its logical form (a prepared layout is for the forward kernel only)."""
    lhs, rhs = _logical(*residuals)
    return _ste_bwd(dimension_numbers, precision, None, None, None, (lhs, rhs), g)


# jax.custom_vjp computes its debug info from `inspect.signature(fun)` on every call; stored
# once, the engine's trace of a model with many quantized matmuls gets measurably shorter.
_ste_dot.fun.__signature__ = inspect.signature(_ste_dot.fun)

PATHS = (*_dot_path.PATHS, *KERNEL_PATHS)
"""Every name `dot_general_path` returns."""


@dataclasses.dataclass(frozen=True)
class DotPlan:
    """How `dot_general` computes one product (static, hashable).

    Decided once per product, at trace time, from shapes, dtypes, formats, scale layouts and
    the kernels registered for the weight's format (`plan_dot_general`); the engine reports
    `path` and counts `relaid`, and hands the plan to `dot_general`, which runs it.

    Attributes:
      path: the implementation's name, one of `PATHS` (``"reference"`` dequantizes).
      kernels: the registered kernels chosen for this product, one per platform
        (`_registry.choose`); every other platform runs the portable product.
      kept_layout: the CPU kernel runs a `PreparedQArray`'s own layout, as prepared.
      core: the pure-JAX product's plan (every platform without a kernel), or None for a
        kept layout (whose logical weight is planned where it is recovered).
      relaid: the operand (0: lhs, 1: rhs) laid out again, or recovered from a layout made
        for another use, on every call; a fallback the engine counts. None when neither is.
      declined: (platform, "kernel: reason") where a platform's kernel for the weight's
        format leaves this product to the portable one (`_registry.declined`); the engine
        report counts them.
    """

    path: str
    kernels: tuple[Chosen, ...] = ()
    kept_layout: bool = False
    core: Plan | None = None
    relaid: int | None = None
    declined: tuple[tuple[str, str], ...] = ()


def _kept_route(lhs, rhs, dimension_numbers, out_sharding) -> Any:
    """A `PreparedQArray`'s own route when this call is the linear layer it was laid out for."""
    if not is_prepared(rhs) or quantized(lhs) or is_prepared(lhs):
        return None
    dims = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
    floats = hasattr(lhs, "dtype") and np.dtype(lhs.dtype) in FLOAT_ACTIVATIONS
    if out_sharding is None and floats and contract_axis(lhs, rhs, dims) == rhs.axis:
        return rhs.route
    return None


def _logical(lhs, rhs) -> tuple[Any, Any]:
    """The operands with a `PreparedQArray` as its logical QArray."""
    return tuple(x.logical() if is_prepared(x) else x for x in (lhs, rhs))


def plan_dot_general(
    lhs: Any, rhs: Any, dimension_numbers: Any, *, out_sharding: Any = None
) -> DotPlan:
    """The plan `dot_general` runs for these operands: where the engine decides a product.

    Args:
      lhs, rhs, dimension_numbers, out_sharding: as `dot_general` (a weight's `input_scale`
        changes no plan; a requested sharding keeps the pure-JAX paths).
    Returns:
      A `DotPlan`.
    Raises:
      TypeError: for an operand that is neither a float array nor a quantized one.
    """
    lhs, rhs = strip_input_scale(lhs), strip_input_scale(rhs)
    route = _kept_route(lhs, rhs, dimension_numbers, out_sharding)
    if route is not None:
        return DotPlan(route.path, kernels=(Chosen(CPU_KERNEL, route),), kept_layout=True)
    # A prepared weight used other than as its linear layer: its codes are recovered per call.
    relaid = next((i for i in (1, 0) if is_prepared((lhs, rhs)[i])), None)
    lhs, rhs = _logical(lhs, rhs)
    check_operand(lhs, "dot_general", "lhs")
    check_operand(rhs, "dot_general", "rhs")
    dims = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
    core = choose_plan(lhs, rhs, dims)
    if core.path == "float":
        return DotPlan("float", core=core)
    # A requested output sharding keeps every platform on the portable product.
    chosen = () if out_sharding is not None else _registry.choose(lhs, rhs, dims)
    path = core.path
    for c in chosen:
        if c.platform == "cpu" and c.kernel.path is not None:
            path = c.kernel.path(c.config)
        per_call = c.kernel.per_call_layout
        if relaid is None and per_call is not None and per_call(lhs, rhs, c.config):
            relaid = 1
    declined = () if out_sharding is not None else _registry.declined(lhs, rhs, dims, chosen)
    return DotPlan(path, kernels=chosen, core=core, relaid=relaid, declined=declined)


def dot_general_path(
    lhs: Any, rhs: Any, dimension_numbers: Any, *, out_sharding: Any = None
) -> str:
    """Which implementation `dot_general` uses for these operands (one of `PATHS`): the
    `path` of `plan_dot_general`, e.g. ``"cpu_kernel_int4"``, or ``"reference"`` for a
    product that dequantizes (a fallback)."""
    return plan_dot_general(lhs, rhs, dimension_numbers, out_sharding=out_sharding).path


def dot_general(
    lhs: jax.Array | QArray,
    rhs: jax.Array | QArray,
    dimension_numbers: Any,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    plan: DotPlan | None = None,
) -> jax.Array:
    """`lax.dot_general` where either operand may be a `QArray`.

    The mode follows the QArray's static `activation` field: None computes weight-only (the
    other operand stays float; the scale is applied after the dot, per group if the scale is
    grouped along the contraction); a `QuantConfig` quantizes the float operand per token (or
    with the static `activation_bounds`) and multiplies stored codes (int8 x int8 -> int32,
    fp8 x fp8 -> f32). With two QArrays their stored codes are multiplied as they are. A
    weight's `input_scale` multiplies the float operand first (before it is quantized).

    On CPU, a plain linear layer (`x: [..., K]`, `w: QArray [K, N]`) in a layout the compiled
    kernels read runs in `lowbit.kernels` (see `plan_dot_general`); ``LOWBIT_DISABLE_KERNELS=1``
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
      plan: `plan_dot_general` of these arguments, where the caller has it (the engine);
        planned here otherwise.
    Returns:
      [batch..., lhs_free..., rhs_free...] as `lax.dot_general`.
    Raises:
      TypeError: for an operand that is neither a float array nor a QArray.
      ValueError: for malformed dimension numbers or an unsupported activation granularity.
    """
    if plan is None:
        plan = plan_dot_general(lhs, rhs, dimension_numbers, out_sharding=out_sharding)
    lhs, rhs = apply_input_scale(lhs, rhs, dimension_numbers)
    if not plan.kept_layout:
        lhs, rhs = _logical(lhs, rhs)
    dimension_numbers = _dims.normalize(dimension_numbers, lhs.shape, rhs.shape)
    if plan.path == "float":
        return lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding=out_sharding,
        )
    if plan.kernels:
        out_dtype = product_dtype(lhs, rhs, preferred_element_type)
        return _by_platform_once(
            lhs, rhs, plan, dimension_numbers, precision, preferred_element_type, out_dtype
        )
    return _portable(
        lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding, plan.core
    )


def _portable(lhs, rhs, dimension_numbers, precision, preferred, out_sharding, core=None):
    """The pure-JAX product of a float operand or QArray with a QArray (every platform)."""
    side, _ = active_side(lhs, rhs)
    run = _forward if side is None else _ste_dot
    return run(lhs, rhs, dimension_numbers, precision, preferred, out_sharding, core)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _by_platform(lhs, rhs, plan: DotPlan, dimension_numbers, precision, preferred, out_dtype):
    """A product with a kernel on some platform, chosen per lowering platform so one traced
    program exports anywhere: each of `plan.kernels` where the program is lowered for its
    platform, the portable product everywhere else (a prepared weight recovers its logical
    QArray there). One straight-through derivative rule covers every branch."""

    def portable(lhs, rhs, dims):
        return _portable(lhs, rhs, dims, precision, preferred, None).astype(out_dtype)

    call = Call(dimension_numbers, precision, preferred, out_dtype, portable)

    def elsewhere(lhs, rhs):
        lhs, rhs = _logical(lhs, rhs)
        core = None if plan.kept_layout else plan.core
        out = _portable(lhs, rhs, dimension_numbers, precision, preferred, None, core)
        return out.astype(out_dtype)

    def running(chosen: Chosen):
        return lambda lhs, rhs: chosen.kernel.run(lhs, rhs, chosen.config, call)

    rules = {c.platform: running(c) for c in plan.kernels}
    return by_platform((lhs, rhs), rules, elsewhere)


def _by_platform_fwd(lhs, rhs, plan, dimension_numbers, precision, preferred, out_dtype):
    out = _by_platform(lhs, rhs, plan, dimension_numbers, precision, preferred, out_dtype)
    return out, (lhs, rhs)


def _by_platform_bwd(plan, dimension_numbers, precision, preferred, out_dtype, res, g):
    return _logical_ste_bwd(dimension_numbers, precision, res, g)


_by_platform.defvjp(_by_platform_fwd, _by_platform_bwd)

# Jitted so that a model's trace traces each distinct product once per shape (every platform's
# branch, the portable one decoding the weight), not at each of its uses: two thirds of a
# 1.5B decoder's trace, which is most of a first start's compile.
_by_platform_once = jax.jit(_by_platform, static_argnums=(2, 3, 4, 5, 6))
