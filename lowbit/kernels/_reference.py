"""Pure-JAX references for the CPU kernels, on *logical* weights.

These define the semantics the compiled kernels are tested against, and are the fallback
when the kernels are unavailable. Logical weight arrays (see `lowbit.kernels` for details):

- codes: `[K, N]` (contraction axis first). int8 codes as `int8`; 4-bit codes as `uint8`
  values 0..15 (int4: two's-complement nibble patterns; uint4: unsigned; nf4: index into
  `NF4_LEVELS`; fp4: FP4 E2M1 bit patterns, decoded by `FP4_LEVELS`, the element format of
  MXFP4 / NVFP4); fp8 as `float8_e4m3fn`.
- scale: `[G, N]` float32, G = ceil(K / group_size), or `[1, N]` per channel.
- zero_point (uint4 only): `[G, N]` float32 in code units, w = (q - zp) * scale.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import get_format
from lowbit.kernels._kinds import KERNEL_KINDS, WEIGHT_ONLY_KINDS

# The 16 NormalFloat-4 levels: the format registry's table (the kernels' codebook is the same).
NF4_LEVELS = np.asarray(get_format("nf4").values, dtype=np.float32)
# The 16 FP4 E2M1 values by bit pattern (sign bit 3), through the bit layout the format
# registry names (`ml_dtypes.float4_e2m1fn`): NumPy, so importing lowbit compiles nothing.
FP4_LEVELS = (
    np.arange(16, dtype=np.uint8).view(get_format("fp4_e2m1").reference_dtype).astype(np.float32)
)
# Codebooks by the name kinds give in their `lut` field.
CODEBOOKS = {"nf4": NF4_LEVELS, "fp4": FP4_LEVELS}
# The codebook the kernels' table-lookup path reads for each kind (others ignore it).
LUTS = {k.name: CODEBOOKS[k.lut] for k in KERNEL_KINDS.values() if k.lut is not None}


def _expand_groups(a: jax.Array, k: int, group_size: int | None) -> jax.Array:
    """[G, N] per-group values -> [K, N]; group g covers rows g*group_size .. +group_size-1."""
    if a.shape[0] == 1 or group_size is None:
        return jnp.broadcast_to(a[:1], (k, a.shape[1]))
    return jnp.repeat(a, group_size, axis=0)[:k]


@functools.partial(jax.jit, static_argnames=("kind", "group_size"))
def dequantize(
    kind: str,
    codes: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None = None,
    group_size: int | None = None,
) -> jax.Array:
    """Logical weight -> float32 `[K, N]`.

    codes: [K, N]; scale: [G, N] float32 (G = 1 per channel, else ceil(K / group_size));
    zero_point: [G, N] float32 (uint4 only).
    """
    k = codes.shape[0]
    if kind == "int8":
        q = codes.astype(jnp.float32)
    elif kind == "int4":
        c = codes.astype(jnp.int32)
        q = jnp.where(c >= 8, c - 16, c).astype(jnp.float32)
    elif kind == "uint4":
        q = codes.astype(jnp.float32) - _expand_groups(
            zero_point.astype(jnp.float32), k, group_size
        )
    elif kind in LUTS:
        q = jnp.asarray(LUTS[kind])[codes.astype(jnp.int32)]
    elif kind == "fp8":
        q = codes.astype(jnp.float32)
    else:
        raise ValueError(
            f"kind={kind!r} is not a weight-only kind; expected one of {WEIGHT_ONLY_KINDS}"
        )
    return q * _expand_groups(scale.astype(jnp.float32), k, group_size)


def _finish(y: jax.Array, bias: jax.Array | None, out_dtype) -> jax.Array:
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("kind", "group_size", "out_dtype"))
def weight_only_linear(
    x: jax.Array,
    kind: str,
    codes: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None = None,
    group_size: int | None = None,
    bias: jax.Array | None = None,
    out_dtype=None,
) -> jax.Array:
    """x: [M, K] float32|bfloat16 -> [M, N] `out_dtype` (default x.dtype): x @ W + bias."""
    w = dequantize(kind, codes, scale, zero_point, group_size)
    y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return _finish(y, bias, out_dtype or x.dtype)


@jax.jit
def quantize_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic symmetric int8 per row.

    x: [M, K] float32|bfloat16 -> (xq [M, K] int8 in [-127, 127], scale [M] float32), with
    scale = absmax / 127 (1 for all-zero rows) and round-half-to-even.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1) if x.shape[-1] else jnp.zeros(x.shape[:-1])
    scale = jnp.where(amax > 0, amax / jnp.float32(127.0), jnp.float32(1.0))
    q = jnp.clip(xf / scale[:, None], -127.0, 127.0)
    return jnp.round(q).astype(jnp.int8), scale


@jax.jit
def w8a8_matmul_int32(xq: jax.Array, codes: jax.Array) -> jax.Array:
    """xq: [M, K] int8, codes: [K, N] int8 -> [M, N] int32 (exact integer product)."""
    return jax.lax.dot(xq, codes, preferred_element_type=jnp.int32)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def w8a8_linear_quantized(
    xq: jax.Array,
    x_scale: jax.Array,
    codes: jax.Array,
    w_scale: jax.Array,
    bias: jax.Array | None = None,
    out_dtype=jnp.float32,
) -> jax.Array:
    """xq: [M, K] int8, x_scale: [M], codes: [K, N] int8, w_scale: [1, N] or [N] -> [M, N].

    y = float(acc) * x_scale[m] * w_scale[n] + bias[n], each step rounded in float32.
    """
    acc = w8a8_matmul_int32(xq, codes).astype(jnp.float32)
    y = acc * x_scale.astype(jnp.float32)[:, None] * w_scale.reshape(1, -1).astype(jnp.float32)
    return _finish(y, bias, out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def w8a8_linear(
    x: jax.Array,
    codes: jax.Array,
    w_scale: jax.Array,
    bias: jax.Array | None = None,
    out_dtype=None,
) -> jax.Array:
    """x: [M, K] float32|bfloat16 -> [M, N]: per-token int8 activations times int8 weights."""
    xq, xs = quantize_per_token(x)
    return w8a8_linear_quantized(xq, xs, codes, w_scale, bias, out_dtype or x.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype"))
def w4a8_linear(
    x: jax.Array,
    codes: jax.Array,
    scale: jax.Array,
    group_size: int | None = None,
    bias: jax.Array | None = None,
    out_dtype=None,
) -> jax.Array:
    """x: [M, K] float -> [M, N]: per-token int8 activations times int4 weights.

    codes: [K, N] uint8 int4 two's-complement nibbles; scale: [G, N] float32 (G = 1 per
    channel). y = x_scale * sum_g scale[g] * (exact int32 dot of group g) + bias, the groups
    summed in order.
    """
    k, n = codes.shape
    xq, xs = quantize_per_token(x)
    q = ((codes.astype(jnp.int32) & 15) ^ 8) - 8
    gs = k if group_size is None else group_size
    groups = -(-k // gs)
    pad = groups * gs - k
    xg = jnp.pad(xq.astype(jnp.int32), ((0, 0), (0, pad))).reshape(-1, groups, gs)
    qg = jnp.pad(q, ((0, pad), (0, 0))).reshape(groups, gs, n)
    dots = jnp.einsum("mgk,gkn->gmn", xg, qg, preferred_element_type=jnp.int32)
    s = jnp.broadcast_to(scale.astype(jnp.float32), (groups, n))
    acc = jnp.zeros((x.shape[0], n), jnp.float32)
    for g in range(groups):  # in order, as the kernel accumulates
        acc = acc + dots[g].astype(jnp.float32) * s[g]
    y = acc * xs[:, None]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


@functools.partial(jax.jit, static_argnames=("softcap",))
def decode_attention(
    q: jax.Array,
    keys: jax.Array | None,
    values: jax.Array,
    start: jax.Array,
    slot: jax.Array,
    scores: jax.Array | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Softmax attention of one query position per row over cache slots ``start[b] .. slot``.

    q: [B, H, G, D] float32 (G queries per KV head, already scaled); keys, values:
    [B, H, L, D] float32; start: [B] int32; slot: [] int32 -> [B, H, G, D] float32 (zeros
    for a row with no slot to attend to). With `scores` [B, H, G, L] given, keys are unused.
    `softcap` c: scores become ``c * tanh(s / c)`` before the softmax.
    """
    if scores is None:
        scores = jnp.einsum("bhgd,bhld->bhgl", q, keys, precision=jax.lax.Precision.HIGHEST)
    t = jnp.arange(values.shape[2], dtype=jnp.int32)
    valid = (t[None, :] >= start[:, None]) & (t[None, :] <= slot)  # [B, L]
    valid = valid[:, None, None, :]
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(valid, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(valid, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhgl,bhld->bhgd", p, values, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)


@functools.partial(jax.jit, static_argnames=("d",))
def dequantize_cache(codes: jax.Array, scales: jax.Array, d: int) -> jax.Array:
    """[B, H, L, D] float32 from cache codes and [B, H, L, S] scales (see `decode_attention`
    in `lowbit.kernels` for the int8 / int4 / fp8 layouts)."""
    if codes.dtype == jnp.uint8:  # int4: low nibbles are channels 0 .. D/2 - 1
        signed = codes.astype(jnp.int8)
        lo = jnp.left_shift(signed, 4) >> 4
        x = jnp.concatenate([lo, signed >> 4], axis=-1).astype(jnp.float32) + 0.5
    else:
        x = codes.astype(jnp.float32)
    groups = scales.shape[-1]
    x = x.reshape(*x.shape[:-1], groups, d // groups) * scales.astype(jnp.float32)[..., None]
    return x.reshape(*x.shape[:-2], d)


@jax.jit
def int8_qk_scores(q: jax.Array, codes: jax.Array, scales: jax.Array) -> jax.Array:
    """[B, H, G, L] scores of queries q [B, H, G, D] against int8 keys codes [B, H, L, D] with
    [B, H, L, S] scales: each query quantized per channel group to int8 (scale max(absmax /
    127, 1e-30), round half to even), exact int32 dots per group, then both scales."""
    b, h, g, d = q.shape
    groups = scales.shape[-1]
    qg = q.reshape(b, h, g, groups, d // groups)
    q_scale = jnp.maximum(jnp.max(jnp.abs(qg), axis=-1) / 127.0, 1e-30)  # [B, H, G, S]
    q_codes = jnp.round(qg / q_scale[..., None]).astype(jnp.int8)
    k_codes = codes.reshape(*codes.shape[:3], groups, d // groups)
    dots = jnp.einsum("bhgsd,bhlsd->bhgls", q_codes, k_codes, preferred_element_type=jnp.int32)
    weighted = (
        dots.astype(jnp.float32) * q_scale[:, :, :, None] * scales.astype(jnp.float32)[:, :, None]
    )
    return jnp.sum(weighted, axis=-1)


# Levels of `row_sum` narrower than this are left to XLA to fuse into one loop.
_FUSED_WIDTH = 32


def row_sum(x: jax.Array, square: bool = False) -> jax.Array:
    """``x [..., D]`` -> ``[..., 1]``: the sum over the last axis (of the squares, with
    `square`) in a fixed pairwise order, the kernel's.

    The row is padded with zeros to a power of two and halved by elementwise adds (the first
    half plus the second), so each row rounds the same way at any leading shape. XLA may
    neither reorder nor FMA-contract adds of materialized values: the squares, and `x` itself,
    are materialized first (an optimization barrier).
    """
    if square:
        x = x * x
    (x,) = jax.lax.optimization_barrier((x,))
    d = x.shape[-1]
    width = 1 << max(d - 1, 0).bit_length()
    if width != d:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - d)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
        if half >= _FUSED_WIDTH:
            # Each wide level its own loop, which bounds the code XLA generates for a sum:
            # fused, every output of the last level would expand the whole tree.
            (x,) = jax.lax.optimization_barrier((x,))
    return x
