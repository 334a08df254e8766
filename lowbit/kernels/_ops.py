"""Kernel entry points on plain arrays: validation, the FFI call, the pure-JAX fallback."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.kernels import _native, _reference
from lowbit.kernels._kinds import KERNEL_KINDS, KIND_IDS
from lowbit.kernels._layout import HEADER_BYTES, PreparedWeight, prepared_to_logical
from lowbit.kernels._platform import by_platform

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_float(name: str, dtype) -> jnp.dtype:
    d = jnp.dtype(dtype)
    if d not in _FLOATS:
        raise TypeError(f"{name} dtype {d.name} is not supported; expected float32 or bfloat16")
    return d


def _check_x(x: jax.Array, w: PreparedWeight, name: str = "x") -> None:
    if x.ndim < 1 or x.shape[-1] != w.k:
        raise ValueError(f"{name} has shape {x.shape}; expected [..., {w.k}] (K of the weight)")


def _check_bias(bias: jax.Array | None, n: int) -> jax.Array:
    if bias is None:
        # lax.broadcast binds one op; jnp.zeros would trace a jitted function per call, which
        # showed in the engine's trace time (one call per quantized matmul).
        return jax.lax.broadcast(np.float32(0), (n,))
    bias = jnp.asarray(bias)
    if bias.shape != (n,):
        raise ValueError(f"bias has shape {bias.shape}; expected ({n},)")
    return bias.astype(jnp.float32)


def _float_rows(
    x: jax.Array, w: PreparedWeight, bias: jax.Array | None, out_dtype
) -> tuple[jax.Array, tuple[int, ...], jnp.dtype, jax.Array]:
    """The checked inputs of a float-activation linear kernel.

    Returns:
      (x as rows [M, K], x's leading shape, the output dtype (`out_dtype`, default x's), the
      bias float32 [N] (zeros when None)).
    """
    x = jnp.asarray(x)
    _check_x(x, w)
    check_float("x", x.dtype)
    out = check_float("out_dtype", out_dtype or x.dtype)
    return x.reshape(-1, w.k), x.shape[:-1], out, _check_bias(bias, w.n)


def native_or_reference(native: Callable[[], Any], reference: Callable[[], Any]) -> Any:
    """`native()` (an FFI call into the CPU kernels) where the program is lowered for CPU,
    `reference()` (pure JAX) on every other platform.

    Chosen per lowering platform, not by the host's default backend: a program traced on a CPU
    host and lowered for CUDA or TPU carries no CPU FFI call, and one exported for several
    platforms carries it on its CPU branch only. Without the compiled module every platform
    takes the reference.
    """
    if _native.module() is None:
        return reference()
    if not getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
        return by_platform((), {"cpu": native}, reference)

    def typed_native():
        # Inside a shard_map that checks varying manual axes, an FFI call's outputs vary over
        # none, while the pure-JAX branch's vary like its inputs; the call's outputs take the
        # reference's axes, so both branches are typed alike.
        want = jax.tree.map(_varying_axes, jax.eval_shape(reference))
        return jax.tree.map(_vary, native(), want)

    return by_platform((), {"cpu": typed_native}, reference)


def _varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes an abstract value varies over (JAX 0.9: ``vma``; later:
    ``manual_axis_type.varying``)."""
    axes = getattr(aval, "vma", None)
    if axes is None:
        axes = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(axes or ())


def _vary(x: jax.Array, axes: frozenset) -> jax.Array:
    """`x` typed as varying over `axes` too."""
    missing = tuple(sorted(axes - _varying_axes(jax.typeof(x))))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _row_kernel(
    target: str,
    rows: int,
    n: int,
    dtype: Any,
    reference: Callable[[], jax.Array],
    /,
    *operands: Any,
    **attributes: int,
) -> jax.Array:
    """A ``[rows, n]`` `dtype` product: the CPU kernel `target` on `operands` (its integer
    `attributes` passed as int64) where the program is lowered for CPU (see `native_or_reference`),
    `reference()` elsewhere and for zero rows (no kernel call for an empty batch)."""

    def native():
        call = jax.ffi.ffi_call(
            target, jax.ShapeDtypeStruct((rows, n), dtype), vmap_method="sequential"
        )
        return call(*operands, **{name: np.int64(v) for name, v in attributes.items()})

    return reference() if rows == 0 else native_or_reference(native, reference)


def weight_only_linear(
    x: jax.Array,
    w: PreparedWeight,
    bias: jax.Array | None = None,
    *,
    out_dtype=None,
    int8_activations: bool = False,
) -> jax.Array:
    """x: [..., K] float32|bfloat16, w: prepared int8/int4/uint4/nf4/fp4/fp8 [K, N] -> [..., N].

    The weight is dequantized in registers inside the kernel. bias: [N] (optional);
    out_dtype: float32 | bfloat16, default x.dtype.

    int8_activations: for int4 / uint4 / int8 weights whose storage group is a multiple of 4,
    and a CPU path that has it (`int8_activations_supported(kind)`: AVX2 or AVX-512, int8
    weights not on AVX-512 without VNNI), the kernel quantizes the activations to int8 with
    one scale per row and weight group (absmax / 127, round half to even: llama.cpp's Q8
    blocks) and takes integer dots with the codes. Measured on 2 AVX-512 VNNI cores, int4 g32
    against the float path: 1.5-1.9x faster on one row, 2-2.5x on 8 to 512. Elsewhere the
    float path runs, as it always does without the flag.
    """
    if w.kind not in KIND_IDS:
        raise ValueError(f"w.kind={w.kind!r} is not a weight-only kind; expected {tuple(KIND_IDS)}")
    x2, lead, out, b = _float_rows(x, w, bias, out_dtype)
    m = x2.shape[0]

    def reference():
        logical = prepared_to_logical(w)
        return _reference.weight_only_linear(
            x2,
            w.kind,
            logical["codes"],
            logical["scale"],
            logical["zero_point"],
            w.group_size,
            b,
            out,
        )

    y = _row_kernel(
        "lowbit_wo_linear",
        m,
        w.n,
        out,
        reference,
        x2,
        w.data,
        b,
        jnp.asarray(_reference.LUTS.get(w.kind, _reference.NF4_LEVELS)),
        kind=KIND_IDS[w.kind],
        k=w.k,
        n=w.n,
        gs=w.storage_group,
        act_q8=int(bool(int8_activations)),
    )
    return y.reshape(*lead, w.n)


def dequantize_weight(w: PreparedWeight) -> jax.Array:
    """The float32 weight ``[K, N]`` of a weight-only layout, ``(q - zp) * scale`` exactly.

    For a float GEMM outside the kernels: at prefill sizes (hundreds of rows) XLA's GEMM on
    the dequantized weight beats the kernels' own float tiles, and the float weight is a
    temporary of that one call.
    """
    if w.kind not in KIND_IDS:
        raise ValueError(f"w.kind={w.kind!r} is not a weight-only kind; expected {tuple(KIND_IDS)}")

    def reference():
        logical = prepared_to_logical(w)
        return _reference.dequantize(
            w.kind, logical["codes"], logical["scale"], logical["zero_point"], w.group_size
        )

    def native():
        panels = w.data.shape[0]
        group_bytes = HEADER_BYTES + w.storage_group // 2 * KERNEL_KINDS[w.kind].pair_bytes
        groups = w.data.shape[1] // group_bytes
        call = jax.ffi.ffi_call(
            "lowbit_wo_dequantize",
            jax.ShapeDtypeStruct((groups * w.storage_group, 16 * panels), jnp.float32),
            vmap_method="sequential",
        )
        full = call(
            w.data,
            jnp.asarray(_reference.LUTS.get(w.kind, _reference.NF4_LEVELS)),
            kind=np.int64(KIND_IDS[w.kind]),
            n=np.int64(w.n),
            gs=np.int64(w.storage_group),
        )
        return full[: w.k, : w.n]

    return native_or_reference(native, reference)


def _check_kind(w: PreparedWeight, kind: str) -> None:
    if w.kind != kind:
        raise ValueError(f"w.kind={w.kind!r}; expected a weight prepared with kind={kind!r}")


def _int8_activation_linear(
    kind: str, x: jax.Array, w: PreparedWeight, bias: jax.Array | None, out_dtype
) -> jax.Array:
    """x: [..., K] float -> [..., N] through the kernel `lowbit_<kind>_linear` of a weight
    prepared with `kind` ("w8a8" or "w4a8"), which quantizes each row of x to int8 itself.

    The two kinds share the checks, the float rows and the call; they differ in what the
    kernel reads beside the activations and bias, and in their pure-JAX reference.
    """
    _check_kind(w, kind)
    x2, lead, out, b = _float_rows(x, w, bias, out_dtype)
    if kind == "w8a8":
        # Per-channel scales, and the codes' column sums that undo the kernel's unsigned shift.
        weight, attributes = (w.data, w.colsum, w.scale), {}
    else:
        # Scales and column sums are in the layout's group headers; `gs` is its storage group.
        weight, attributes = (w.data,), {"gs": w.storage_group}

    def reference():
        logical = prepared_to_logical(w)
        if kind == "w8a8":
            return _reference.w8a8_linear(x2, logical["codes"], w.scale, b, out)
        return _reference.w4a8_linear(x2, logical["codes"], logical["scale"], w.group_size, b, out)

    name = f"lowbit_{kind}_linear"
    y = _row_kernel(
        name, x2.shape[0], w.n, out, reference, x2, *weight, b, k=w.k, n=w.n, **attributes
    )
    return y.reshape(*lead, w.n)


def w8a8_linear(
    x: jax.Array, w: PreparedWeight, bias: jax.Array | None = None, *, out_dtype=None
) -> jax.Array:
    """x: [..., K] float32|bfloat16 -> [..., N] with dynamic per-token int8 activations.

    Each row of x is quantized symmetrically (scale = absmax / 127, round half to even,
    all-zero rows get scale 1), multiplied with the int8 weight in int32, then scaled by the
    row and channel scales; bias: [N] optional; out_dtype float32 | bfloat16 (default x.dtype).
    """
    return _int8_activation_linear("w8a8", x, w, bias, out_dtype)


def _check_xq(xq: jax.Array, w: PreparedWeight) -> jax.Array:
    xq = jnp.asarray(xq)
    if xq.dtype != jnp.int8:
        raise TypeError(f"xq dtype {xq.dtype} is not supported; expected int8")
    if xq.ndim != 2 or xq.shape[1] != w.k:
        raise ValueError(f"xq has shape {xq.shape}; expected [M, {w.k}]")
    return xq


def w8a8_linear_quantized(
    xq: jax.Array,
    x_scale: jax.Array,
    w: PreparedWeight,
    bias: jax.Array | None = None,
    *,
    out_dtype=jnp.float32,
) -> jax.Array:
    """xq: [M, K] int8, x_scale: [M] float32 -> [M, N] = (xq @ W) * x_scale * w.scale + bias."""
    _check_kind(w, "w8a8")
    xq = _check_xq(xq, w)
    out = check_float("out_dtype", out_dtype)
    m = xq.shape[0]
    x_scale = jnp.asarray(x_scale)
    if x_scale.shape != (m,):
        raise ValueError(f"x_scale has shape {x_scale.shape}; expected ({m},)")
    b = _check_bias(bias, w.n)

    def reference():
        codes = prepared_to_logical(w)["codes"]
        return _reference.w8a8_linear_quantized(xq, x_scale, codes, w.scale, b, out)

    return _row_kernel(
        "lowbit_w8a8_linear_q",
        m,
        w.n,
        out,
        reference,
        xq,
        x_scale.astype(jnp.float32),
        w.data,
        w.colsum,
        w.scale,
        b,
        k=w.k,
        n=w.n,
    )


def w8a8_matmul_int32(xq: jax.Array, w: PreparedWeight) -> jax.Array:
    """xq: [M, K] int8 -> [M, N] int32, the exact integer product with the w8a8 weight codes."""
    _check_kind(w, "w8a8")
    xq = _check_xq(xq, w)
    m = xq.shape[0]

    def reference():
        return _reference.w8a8_matmul_int32(xq, prepared_to_logical(w)["codes"])

    return _row_kernel(
        "lowbit_w8a8_int32", m, w.n, jnp.int32, reference, xq, w.data, w.colsum, k=w.k, n=w.n
    )


def w4a8_linear(
    x: jax.Array, w: PreparedWeight, bias: jax.Array | None = None, *, out_dtype=None
) -> jax.Array:
    """x: [..., K] float32|bfloat16 -> [..., N] with dynamic per-token int8 activations.

    w: prepared with kind="w4a8" (int4 weights, per-group or per-channel scales). Each row of
    x is quantized as in `w8a8_linear`; products are exact int32 per group, then scaled by the
    group scale (groups summed in order), the row scale, plus bias [N] (optional).
    """
    return _int8_activation_linear("w4a8", x, w, bias, out_dtype)


# Cache code dtype -> the kernel's `fmt` attribute (see `decode_attention`).
_CACHE_FORMATS = {
    jnp.dtype(jnp.float32): 0,
    jnp.dtype(jnp.int8): 1,
    jnp.dtype(jnp.uint8): 2,
    jnp.dtype(jnp.float8_e4m3fn): 3,
    jnp.dtype(jnp.float16): 4,
    jnp.dtype(jnp.bfloat16): 5,
}
# Formats whose codes are the values themselves (no scales).
_FLOAT_CACHES = (0, 4, 5)


def decode_attention(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    start: jax.Array,
    slot: jax.Array,
    key_scales: jax.Array | None = None,
    value_scales: jax.Array | None = None,
    *,
    integer_qk: bool = False,
    softcap: float | None = None,
    rows: jax.Array | None = None,
) -> jax.Array:
    """Attention of one query position per row over a KV cache, in one kernel call.

    Row b attends to slots ``start[b] .. slot`` only: the cost follows the filled length, not
    the cache's size (split into chunks of 128 slots across threads, merged with the
    running-softmax rescaling). A quantized cache is dequantized a chunk at a time.

    Args:
      q: [B, H, G, D] float32: G query heads per KV head, already scaled by 1 / sqrt(D).
      keys, values: the cache, by dtype: float32, float16 or bfloat16 [R, H, L, D] (the
        16-bit ones read at half the bytes, converted a chunk at a time); int8 codes [R, H, L, D]
        (``x = code * scale``); float8_e4m3fn codes [R, H, L, D] (likewise); uint8 [R, H, L,
        D / 2] int4 (channel j in the low nibble, j + D / 2 in the high one, signed nibbles c
        with ``x = (c + 1/2) * scale``) — the layouts of `lowbit.models`' caches. ``R`` is
        ``B`` unless `rows` is given.
      start: [B] int32, each query row's first slot (left padding before it).
      slot: [] int32, the query's slot (the last one attended to).
      key_scales, value_scales: [R, H, L, S] float16, S scale groups along D (quantized
        caches only).
      integer_qk: int8 keys only: the scores are exact int32 products of the int8 keys with
        the queries quantized to int8 per scale group (``lowbit.models``' ``int8+qk`` caches),
        instead of float products with the dequantized keys.
      softcap: ``c * tanh(s / c)`` on the (scaled) scores before the softmax (Gemma 2), or
        None.
      rows: [B] int32, the cache row each query row reads (distinct or not, each in
        ``0 .. R - 1``), so that some rows of a larger cache are attended to in place, without
        copying them out; None: row b reads row b (``R == B``).
    Returns:
      [B, H, G, D] float32; zeros for a row with no slot to attend to.
    """
    b, h, g, d = q.shape
    r = b if rows is None else keys.shape[0]
    fmt = _CACHE_FORMATS.get(jnp.dtype(keys.dtype))
    if fmt is None or jnp.dtype(values.dtype) != jnp.dtype(keys.dtype):
        raise TypeError(
            f"keys dtype {jnp.dtype(keys.dtype).name} / values dtype "
            f"{jnp.dtype(values.dtype).name} are not a supported cache; expected both one of "
            f"{[t.name for t in _CACHE_FORMATS]}"
        )
    if jnp.dtype(q.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"q dtype {jnp.dtype(q.dtype).name} is not supported; expected float32")
    row = d // 2 if fmt == 2 else d
    if keys.ndim != 4 or keys.shape[:2] != (r, h) or keys.shape[3] != row:
        raise ValueError(f"keys have shape {keys.shape}; expected [{r}, {h}, L, {row}]")
    if values.shape != keys.shape:
        raise ValueError(f"values have shape {values.shape}; expected the keys' {keys.shape}")
    if fmt in _FLOAT_CACHES:
        if key_scales is not None or value_scales is not None:
            raise ValueError(f"a {jnp.dtype(keys.dtype).name} cache takes no scales")
        key_scales = value_scales = jnp.zeros((1,), jnp.float16)
    else:
        for name, s in (("key_scales", key_scales), ("value_scales", value_scales)):
            if (
                s is None
                or s.ndim != 4
                or s.shape[:3] != keys.shape[:3]
                or d % s.shape[3]
                or jnp.dtype(s.dtype) != jnp.dtype(jnp.float16)
            ):
                shape = None if s is None else s.shape
                raise ValueError(
                    f"{name} is {shape}; a quantized cache needs float16 [{r}, {h}, "
                    f"{keys.shape[2]}, S] scales with S dividing {d}"
                )
    if integer_qk and fmt != 1:
        raise ValueError(f"integer_qk needs an int8 cache; keys are {jnp.dtype(keys.dtype).name}")
    start = jnp.asarray(start, jnp.int32)
    slot = jnp.asarray(slot, jnp.int32)
    if start.shape != (b,) or slot.shape != ():
        raise ValueError(f"start must be [{b}] and slot a scalar; got {start.shape}, {slot.shape}")
    indexed = rows is not None
    rows = jnp.asarray(rows, jnp.int32) if indexed else jnp.arange(b, dtype=jnp.int32)
    if rows.shape != (b,):
        raise ValueError(f"rows must be [{b}] (one cache row per query row); got {rows.shape}")

    def reference():
        keys_, values_, ks, vs = keys, values, key_scales, value_scales
        if indexed:
            keys_, values_ = jnp.take(keys, rows, axis=0), jnp.take(values, rows, axis=0)
            if fmt not in _FLOAT_CACHES:
                ks, vs = jnp.take(ks, rows, axis=0), jnp.take(vs, rows, axis=0)
        scores = None
        if integer_qk:
            scores = _reference.int8_qk_scores(q, keys_, ks)
        if fmt in _FLOAT_CACHES:
            k, v = keys_.astype(jnp.float32), values_.astype(jnp.float32)
        else:
            k = _reference.dequantize_cache(keys_, ks, d)
            v = _reference.dequantize_cache(values_, vs, d)
        return _reference.decode_attention(q, k, v, start, slot, scores, softcap)

    def native():
        call = jax.ffi.ffi_call(
            "lowbit_decode_attention",
            jax.ShapeDtypeStruct(q.shape, jnp.float32),
            vmap_method="sequential",
        )
        return call(
            q,
            keys,
            values,
            key_scales,
            value_scales,
            start,
            slot,
            rows,
            fmt=np.int64(fmt),
            integer_qk=np.int64(integer_qk),
            softcap=np.float32(softcap or 0.0),
        )

    return native_or_reference(native, reference)


def row_sum(x: jax.Array, *, square: bool = False) -> jax.Array:
    """The sum over the last axis, ``x [..., D]`` -> ``[..., 1]`` in x's float dtype, in one
    fixed order (of the squares, with `square`): the row padded with zeros to a power of two
    and halved by elementwise adds. A row rounds the same way at any leading shape, on the
    kernel and on the pure-JAX reference alike (the same bits), where XLA's ``reduce`` picks
    its order by shape.

    float32: one kernel call where the program is lowered for CPU; elsewhere, without the
    kernels, and for other float dtypes, the reference's levels of adds. Derivatives are the
    reference's.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1:
        raise TypeError(
            f"row_sum takes a float array [..., D]; got {jnp.dtype(x.dtype).name} {x.shape}"
        )
    return _row_sum(x, square)


# Jitted so that a model's trace traces it once per shape, not at each of its (hundreds of)
# uses: its implementations are traced into each platform branch on every call otherwise,
# a quarter of a 1.5B decoder's trace.
@functools.partial(jax.jit, static_argnums=1)
def _row_sum(x: jax.Array, square: bool) -> jax.Array:
    reference = lambda: _reference.row_sum(x, square)  # noqa: E731
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.float32):
        return reference()

    def native():
        call = jax.ffi.ffi_call(
            "lowbit_row_sum",
            jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32),
            vmap_method="broadcast_all",
        )
        return call(x, square=np.int64(square))[..., None]

    return native_or_reference(native, reference)
