"""Routing plain quantized linear layers to the CPU kernels of `lowbit.kernels`.

A `dot_general` is sent to a compiled kernel when all of these hold (else the pure-JAX paths of
`_dot_general` run, unchanged):

  * the default backend is CPU and `lowbit.kernels.available()` (not disabled with
    ``LOWBIT_DISABLE_KERNELS=1``, module built);
  * it is a plain linear layer: lhs a float32 / bfloat16 array `[..., K]`, rhs a 2-D `QArray`
    `[K, N]` (the Flax `[in, out]` kernel), contracting lhs's last axis with rhs axis 0, no
    batch axes, no zero-size axis, no `out_sharding`, neither operand split over devices
    (`split_over_devices`);
  * the weight has at least `MIN_WEIGHT_ELEMENTS` elements (below that the weight is cache
    resident, XLA's fused dot is as fast, and the per-call repack below is pure overhead);
  * the weight layout is one the kernels read, weight-only (`activation is None`):

      - int8 per channel (scale `[1, N]`) or per group along K (GGUF Q8_0), symmetric;
      - int4 per channel or per group along K (scale `[K/g, N]`, g even), symmetric or with a
        zero point (asymmetric int4 runs as the kernels' uint4 with the zero point moved by 8);
      - uint4 per channel or per group, with or without a zero point;
      - nf4 per channel or per group;
      - FP4 E2M1 (`fp4_e2m1`, `mxfp4`, `nvfp4`) per channel or per group / block along K;
      - fp8_e4m3fn per channel or per group;
      - GGUF block formats (``q4_k``, ``q6_k``, ``q5_0``, ... : `lowbit.kernels.GGUF_KINDS`)
        with blocks along K, each on its own type's kernel reading the block rows as stored
        (`lowbit.kernels.gguf_linear`);

    or, with activations quantized by the kernel:

      - w8a8: an int8 per-channel weight;
      - w4a8: a symmetric int4 weight per channel or per group along K (g a multiple of 8);

    whose `activation` is exactly what the kernels do to the activations — symmetric int8,
    `PerToken`, `AbsMax(clip=1)`, round half to even, float32 scales — with dynamic bounds
    (`activation_bounds is None`). Then `scale = absmax / 127` per token and
    `round(clip(x / scale, -127, 127))` in float32 are the same operations in the same order on
    both paths, so the codes agree exactly for finite inputs and the results differ only by
    float summation order. (For non-finite activations the two differ: the quantizer leaves
    them out of the bound, the kernel does not.)

A per-tensor scale (`[1, 1]`) counts as per channel (broadcast to `[1, N]`). A weight stored
`[N, K]` (contracted over axis 1, e.g. a tied embedding used as the output projection,
``x @ E.T``) is routed as its transpose.

Kernel layout. The kernels read their own packed layout (`lowbit.kernels.pack`: column
panels with the group scales inline, nibbles paired along K). Served weights are prepared once,
by `lowbit.ops.prepare_weights`, into a `PreparedQArray` that holds that layout instead of the
codes; a routed call on one costs only the kernel. A logical QArray reaching a kernel route
(a weight nobody prepared, or one reshaped or sliced since) has its layout built inside the
traced call, on every call: correct, but a full pass over the codes each time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import kernels
from lowbit.formats import get_format
from lowbit.ops._operand import quantized
from lowbit.ops._registry import Call, Kernel, register
from lowbit.qarray import AbsMax, PerToken, QArray, QuantConfig

INT8_ACTIVATIONS_SUFFIX = "+int8_act"
KERNEL_PATHS = (
    *(f"cpu_kernel_{kind}" for kind in kernels.KINDS),
    *(f"cpu_kernel_{kind}{INT8_ACTIVATIONS_SUFFIX}" for kind in kernels.INT8_ACTIVATION_KINDS),
)
"""Path names `dot_general_path` reports for the kernel routes: one per kernel kind, and one
per kind whose product takes integer dots on int8 activations (``"cpu_kernel_int4+int8_act"``)."""

MIN_WEIGHT_ELEMENTS = 1 << 16
"""Smallest weight (K * N) routed to a kernel, e.g. 256 x 256."""

GEMM_MIN_ROWS = 256
"""Activation rows (tokens) from which a float32 weight-only product runs as XLA's GEMM on the
kernel-dequantized weight instead of inside the kernel (prefill; see `kernel_linear`)."""

GEMM_MAX_WEIGHT_BYTES = 16 << 20
"""Largest float32 copy of a weight that path makes (a temporary of one call). Measured
(2 cores, M = 512): SmolLM2's 576 x 1536, 1536 x 576 and 576 x 576 layers run 1.3-1.6x faster
this way; a 4096 x 4096 weight does not (writing its 64 MiB float copy costs more than the
GEMM gains), nor does a 49152-row output projection."""

FLOAT_ACTIVATIONS = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
_FLOATS = FLOAT_ACTIVATIONS
# Element format name -> kernel kind of a weight without activation quantization. GGUF block
# formats run on their own type's kernel, reading the file's block rows (`kernels.gguf_linear`).
_WEIGHT_KINDS = {**kernels.FORMAT_KINDS, **{kind: kind for kind in kernels.GGUF_KINDS}}
_PER_CHANNEL_ONLY = ("w8a8",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelRoute:
    """How a routed `dot_general` calls the kernels (static, hashable).

    Attributes:
      kind: kernel kind, one of `lowbit.kernels.KINDS`.
      group_size: group size along K, or None per channel.
      shift_int4: the weight is asymmetric int4, run as uint4 (codes ^ 8, zero point + 8).
      transposed: the weight is stored `[N, K]` (contracted over its axis 1).
      int8_activations: the product quantizes its activations to int8 per row and weight
        group inside the kernel (llama.cpp's Q8 blocks; kinds
        `lowbit.kernels.INT8_ACTIVATION_KINDS` on a CPU path that has them) and takes integer
        dots, at every row count: one decode row, a decode batch and a prefill (which then
        skips the float GEMM of `GEMM_MIN_ROWS`). A little accuracy for 1.5-2.5x the speed of
        the float path (`lowbit.kernels.weight_only_linear`). Off unless asked for
        (`lowbit.ops.with_int8_activations`).
    """

    kind: str
    group_size: int | None
    shift_int4: bool = False
    transposed: bool = False
    int8_activations: bool = False

    @property
    def path(self) -> str:
        """The name `dot_general_path` reports, e.g. ``"cpu_kernel_int4"``, with
        ``"+int8_act"`` where the product runs on int8 activations. A weight that asked for
        them on a CPU path without them for its kind (int8 weights without VNNI) reports the
        plain kernel, so the report shows which products kept float activations."""
        return f"cpu_kernel_{self.kind}{INT8_ACTIVATIONS_SUFFIX if self.int8_dots else ''}"

    @property
    def int8_dots(self) -> bool:
        """Whether the product takes integer dots on int8 activations: asked for, and the
        active CPU path has them for this kind."""
        return self.int8_activations and kernels.int8_activations_supported(self.kind)


def _is_kernel_activation(config: QuantConfig) -> bool:
    """Whether a weight's activation config is the w8a8 kernel's own per-token quantizer."""
    return (
        get_format(config.format).name == "int8"
        and isinstance(config.granularity, PerToken)
        and config.calibration == AbsMax(clip=1.0)
        and config.symmetric
        and config.rounding == "nearest"
        and np.dtype(config.scale_dtype) == np.dtype(jnp.float32)
    )


def _weight_kind(q: QArray) -> tuple[str, bool] | None:
    """(kernel kind, shift_int4) for the weight's format, zero point and activation, or None."""
    kind = _WEIGHT_KINDS.get(q.fmt.name)
    if kind is None:
        return None
    has_zero = q.zero_point is not None
    if q.activation is not None:
        # int8 x int8 and int4 x int8 have integer kernels; other pairs stay on the JAX paths.
        integer_kind = {"int8": "w8a8", "int4": "w4a8"}.get(kind)
        if integer_kind is None or has_zero or q.activation_bounds is not None:
            return None
        return (integer_kind, False) if _is_kernel_activation(q.activation) else None
    if kind == "int4" and has_zero:
        return "uint4", True
    if has_zero and kind != "uint4":
        return None
    return kind, False


def split_over_devices(x: Any) -> bool:
    """True when `x` is split over several devices: a concrete array whose sharding is not
    replicated, or a traced one whose type carries a sharded axis (explicit mesh axes).

    A kernel call sees one device's whole operand, so sharded operands take the pure-JAX paths,
    which XLA partitions like any dot: routing them to a kernel would gather the whole weight
    (automatic axes) or fail to type-check (explicit axes).
    """
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return not x.sharding.is_fully_replicated
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec is not None and any(axis is not None for axis in spec)


def contract_axis(lhs: Any, rhs: QArray, dimension_numbers) -> int | None:
    """The rhs axis a plain linear contracts (0 for `[K, N]`, 1 for `[N, K]`), or None."""
    (lc, rc), (lb, rb) = dimension_numbers
    if rhs.ndim != 2 or lhs.ndim < 1 or lb or rb or lc != (lhs.ndim - 1,):
        return None
    if tuple(rc) not in ((0,), (1,)):
        return None
    if not (all(n > 0 for n in lhs.shape) and all(n > 0 for n in rhs.shape)):
        return None
    return rc[0]


def weight_route(w: QArray, axis: int = 0) -> KernelRoute | None:
    """The kernel route for a 2-D weight contracted over `axis`, or None.

    Static: decided from the shape, format, scale layout and activation config (see the module
    docstring for the accepted cases); the activation operand may be float32 or bfloat16.

    Args:
      w: QArray [K, N] (axis 0) or [N, K] (axis 1).
      axis: the contracted axis.
    """
    if w.ndim != 2 or not kernels.available() or split_over_devices(w.codes):
        return None
    k, n = w.shape if axis == 0 else w.shape[::-1]
    if k * n < MIN_WEIGHT_ELEMENTS:
        return None
    found = _weight_kind(w)
    if found is None:
        return None
    kind, shift_int4 = found
    if kind in kernels.GGUF_KINDS:
        # Block rows along the contracted axis: the kernel reads them as stored.
        if w.packed_axis != axis:
            return None
        return KernelRoute(kind=kind, group_size=None, transposed=axis == 1)
    groups, columns = w.scale.shape if axis == 0 else w.scale.shape[::-1]
    if columns not in (1, n):
        return None
    group_size = None if groups == 1 else k // groups
    if group_size is not None and kind in _PER_CHANNEL_ONLY:
        return None
    if not kernels.supports(kind, k, n, group_size, jnp.float32):
        return None
    return KernelRoute(
        kind=kind, group_size=group_size, shift_int4=shift_int4, transposed=axis == 1
    )


def kernel_route(
    lhs: Any, rhs: Any, dimension_numbers: Any, *, out_sharding: Any = None
) -> KernelRoute | None:
    """The kernel route for a `dot_general`, or None when the pure-JAX paths run.

    Static: decided from shapes, dtypes, formats and scale layouts (see the module docstring
    for the accepted cases).

    Args:
      lhs, rhs: the operands (`lhs: [..., K]` float, `rhs: QArray [K, N]` or `[N, K]`).
      dimension_numbers: normalized `((lc, rc), (lb, rb))`.
      out_sharding: a requested output sharding (any value keeps the pure-JAX paths).
    Returns:
      A `KernelRoute`, or None.
    """
    if out_sharding is not None or quantized(lhs) or not quantized(rhs):
        return None
    if not hasattr(lhs, "dtype") or np.dtype(lhs.dtype) not in _FLOATS:
        return None
    if split_over_devices(lhs):
        return None
    axis = contract_axis(lhs, rhs, dimension_numbers)
    if axis is None:
        return None
    return weight_route(rhs, axis)


# Columns per step when a layout is built in slices (a multiple of the kernels' 16-column panels).
_CHUNK_COLUMNS = 1024


@functools.partial(jax.jit, static_argnums=1)
def prepare_layout(q: QArray, route: KernelRoute) -> kernels.PreparedWeight:
    """Builds the kernel layout of `q` ([K, N], or [N, K] when `route.transposed`).

    One compiled program. Panels of 16 columns are independent, so a wide weight is laid out
    `_CHUNK_COLUMNS` columns at a time (a `lax.map`): the unpacked codes and repacking
    temporaries of one slice are alive at once, not of the whole weight, which keeps the peak
    memory of preparing at load time near the size of the result.
    """
    axis = 1 if route.transposed else 0  # q's contracted axis; the other one is N
    k, n = q.shape[axis], q.shape[1 - axis]
    if route.kind in kernels.GGUF_KINDS:
        return gguf_rows(q, route)
    chunk = _CHUNK_COLUMNS
    packed_n = q.packed_axis == 1 - axis
    if n <= chunk or n % chunk or (packed_n and q.codes.shape[1 - axis] * 2 != n):
        return _prepare_dense(q.T if route.transposed else q, route)
    # Slice the stored array along N first, then orient the slice: a transposed weight (a
    # tied embedding) is never transposed whole.
    parts = jax.lax.map(
        lambda j: _prepare_dense(_oriented_slice(q, j * chunk, chunk, axis), route),
        jnp.arange(n // chunk),
    )
    join = lambda a: None if a is None else a.reshape(-1, *a.shape[2:])
    return kernels.PreparedWeight(
        route.kind,
        k,
        n,
        route.group_size,
        parts.storage_group,
        join(parts.data),
        join(parts.scale),
        join(parts.colsum),
    )


def gguf_rows(
    q: QArray, route: KernelRoute, *, tile: bool = False, over_rows: bool = False
) -> kernels.PreparedWeight:
    """A GGUF block weight as its kernel reads it: the block rows ``uint8 [N, row_bytes]``
    (the codes themselves when stored ``[N, K]``, a transposed copy of them when ``[K, N]``),
    or with `tile` (a weight laid out once) the tiles of 8 rows of a weight whose type has
    them (`kernels.gguf_tileable`; `kernels.gguf_tile`: the same bytes reordered, which its
    kernels read about twice as fast on int8 activations), written over the rows with
    `over_rows` (`kernels.gguf_tile`'s: for a program that donates `q`)."""
    axis = 1 if route.transposed else 0
    k, n = q.shape[axis], q.shape[1 - axis]
    rows = q.codes if axis == 1 else q.codes.T
    ggml_type = route.kind.upper()
    if tile and kernels.gguf_tileable(ggml_type, k, n):
        rows = kernels.gguf_tile(rows, ggml_type, over_rows=over_rows)
    return kernels.PreparedWeight(route.kind, k, n, None, q.fmt.block.block_size, rows)


def _oriented_slice(q: QArray, start: jax.Array, size: int, axis: int) -> QArray:
    """[K, size]: entries [start, start + size) of q's non-contracted axis, oriented [K, N]
    (`size` a multiple of every block; `axis` the contracted one)."""
    along = 1 - axis
    n = q.shape[along]

    def part(a: jax.Array | None) -> jax.Array | None:
        if a is None or a.shape[along] == 1:
            return a
        per = n // a.shape[along]
        return jax.lax.dynamic_slice_in_dim(a, start // per, size // per, axis=along)

    shape = list(q.shape)
    shape[along] = size
    piece = dataclasses.replace(
        q,
        codes=part(q.codes),
        scale=part(q.scale),
        zero_point=part(q.zero_point),
        shape=tuple(shape),
    )
    return piece.T if axis == 1 else piece


def _prepare_dense(q: QArray, route: KernelRoute) -> kernels.PreparedWeight:
    k, n = q.shape
    rows = 1 if route.group_size is None else k // route.group_size
    codes = q.unpacked_codes()
    scale = jnp.broadcast_to(q.scale_values(), (rows, n))
    if route.kind == "w4a8":  # int4 values as two's-complement nibbles
        return kernels.pack("w4a8", codes.astype(jnp.uint8) & 15, scale, None, route.group_size)
    zero_point = None
    if route.kind == "uint4":
        if q.zero_point is None:
            zero_point = jnp.zeros((rows, n), jnp.float32)
        else:
            zero_point = jnp.broadcast_to(q.zero_point.astype(jnp.float32), (rows, n))
    if route.shift_int4:
        # Two's-complement nibble c of value v: c ^ 8 = v + 8, so (v - z) = (c ^ 8) - (z + 8).
        codes = codes ^ jnp.uint8(8)
        zero_point = zero_point + 8.0
    return kernels.pack(route.kind, codes, scale, zero_point, route.group_size)


def _float_gemm(x: Any, q: Any, route: KernelRoute) -> bool:
    """Whether `kernel_linear` runs XLA's float GEMM on the dequantized weight (prefill)."""
    k, n = q.shape[::-1] if route.transposed else q.shape
    rows = int(np.prod(x.shape[:-1]))
    # Integer dots on int8 activations beat the float GEMM at every row count measured.
    return (
        route.kind not in ("w8a8", "w4a8")
        and not route.int8_dots
        and rows >= GEMM_MIN_ROWS
        and np.dtype(x.dtype) == np.dtype(jnp.float32)
        and k * n * 4 <= GEMM_MAX_WEIGHT_BYTES
    )


def builds_layout_per_call(x: Any, q: Any, route: KernelRoute) -> bool:
    """Whether `kernel_linear(x, q, route)` lays a logical QArray out inside the call: a full
    pass over its codes on every call, which a weight prepared once does not pay. (A GGUF
    block weight stored ``[N, K]`` is its own layout: its codes are the rows the kernel reads.)"""
    if route.kind in kernels.GGUF_KINDS and route.transposed:
        return False
    return quantized(q) and not _float_gemm(x, q, route)


def kernel_linear(x: jax.Array, q: Any, route: KernelRoute, out_dtype: Any) -> jax.Array:
    """`x @ q` through a CPU kernel (forward only; `dot_general` adds the gradient).

    Args:
      x: [..., K] float32 | bfloat16.
      q: QArray [K, N] (or [N, K] when `route.transposed`) accepted by `kernel_route`, or a
        `PreparedQArray` prepared for that contraction (its layout is used as it is).
      route: from `kernel_route(x, q, ...)`.
      out_dtype: output dtype; float32 and bfloat16 come out of the kernel directly, other
        float dtypes are cast from float32.
    Returns:
      [..., N] in `out_dtype`.
    """
    out_dtype = np.dtype(out_dtype)
    kernel_out = out_dtype if out_dtype in _FLOATS else np.dtype(jnp.float32)
    # A logical QArray (laid out in this call), or a `PreparedQArray` (its layout, `.weight`).
    logical = quantized(q)
    if route.kind in kernels.GGUF_KINDS:
        weight = gguf_rows(q, route) if logical else q.weight
        return _gguf_linear(x, q, weight, route, out_dtype, kernel_out)
    if _float_gemm(x, q, route):
        # Prefill sizes: XLA's float GEMM on the dequantized weight is faster than the
        # kernels' own float tiles; the float weight lives for this call only. A prepared
        # weight is dequantized by the kernels from its layout, a logical one directly
        # (building a layout just to read it back would be a second pass).
        if logical:
            w = q.dequantize(jnp.float32)
            w = w.T if route.transposed else w
        else:
            w = kernels.dequantize_weight(q.weight)
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
    weight = prepare_layout(q, route) if logical else q.weight
    if route.kind == "w8a8":
        y = kernels.w8a8_linear(x, weight, out_dtype=kernel_out)
    elif route.kind == "w4a8":
        y = kernels.w4a8_linear(x, weight, out_dtype=kernel_out)
    else:
        y = kernels.weight_only_linear(
            x, weight, out_dtype=kernel_out, int8_activations=route.int8_activations
        )
    return y.astype(out_dtype)


def _gguf_linear(
    x: Any, q: Any, weight: Any, route: KernelRoute, out_dtype: Any, kernel_out: Any
) -> Any:
    """`kernel_linear` for a GGUF block weight (`weight`: its block rows): read as stored, or
    at prefill sizes XLA's GEMM on the weight the kernels dequantize for that call."""
    ggml_type = route.kind.upper()
    tiled = kernels.is_tiled(weight.data, weight.n)
    if _float_gemm(x, q, route):
        w = kernels.gguf_dequantize(weight.data, ggml_type, weight.k, tiled=tiled)
        y = jax.lax.dot_general(
            x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        return y.astype(out_dtype)
    y = kernels.gguf_linear(
        x,
        weight.data,
        ggml_type,
        out_dtype=kernel_out,
        int8_activations=route.int8_dots,
        tiled=tiled,
    )
    return y.astype(out_dtype)


# Under jit, one trace per (shapes, route): a model's many same-shaped layers reuse it, which
# halved the engine's trace time of a 32-layer MLP against tracing the kernel call each time.
_kernel_linear_jit = jax.jit(kernel_linear, static_argnums=(2, 3))


def _run(x: Any, q: Any, route: KernelRoute, call: Call) -> jax.Array:
    # Forward only: `dot_general` gives every platform's implementation one straight-through
    # derivative.
    return _kernel_linear_jit(x, q, route, np.dtype(call.out_dtype))


def _route_path(route: KernelRoute) -> str:
    return route.path


CPU_KERNEL = register(
    Kernel(
        "cpu_kernel",
        "cpu",
        tuple(_WEIGHT_KINDS),
        applies=kernel_route,
        run=_run,
        path=_route_path,
        per_call_layout=builds_layout_per_call,
    )
)
"""The CPU kernels' entry: a `KernelRoute` as its configuration (`kernel_route`)."""
