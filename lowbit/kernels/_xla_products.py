"""Activation-quantized products on accelerators, in plain XLA: int8 x int8 (w8a8) and
float8_e4m3fn x float8_e4m3fn, per-token activation scales (`lowbit.kernels.pallas` module
docstring says why no Pallas kernel is written for them)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lowbit.qarray import QArray, broadcast_blocks

FP8_FORMAT = "fp8_e4m3fn"
_INT8_MAX = 127.0
_E4M3_MAX = 448.0


def flatten_rows(x: jax.Array, k: int, fn: str) -> tuple[jax.Array, tuple[int, ...]]:
    """x [..., K] -> ([M, K], leading shape)."""
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(
            f"{fn}: x has shape {tuple(x.shape)}; expected [..., {k}] (K = q.shape[0])"
        )
    return x.reshape(-1, k), tuple(x.shape[:-1])


def _static_bound(q: QArray) -> jax.Array | None:
    """The calibrated activation bound max(|lo|, |hi|), or None for dynamic scales."""
    if q.activation_bounds is None:
        return None
    bounds = jnp.abs(q.activation_bounds.astype(jnp.float32))
    return jnp.max(bounds)


def quantize_rows(x: jax.Array, fmt: str, bound: jax.Array | None = None):
    """Per-token symmetric quantization of activations.

    Args:
      x: [M, K] float.
      fmt: "int8" or "fp8_e4m3fn".
      bound: a static absolute bound (one scale for all rows), or None: each row's max |x|.
    Returns:
      (codes [M, K] int8 or float8_e4m3fn, scale [M, 1] float32) with x ~ codes * scale.
    """
    x = x.astype(jnp.float32)
    top = _INT8_MAX if fmt == "int8" else _E4M3_MAX
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True) if bound is None else bound
    scale = jnp.broadcast_to(amax / top, (x.shape[0], 1))
    # An all-zero row has no range: scale 1 quantizes it to exact zeros instead of NaN.
    scale = jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 1.0)
    y = jnp.clip(x / scale, -top, top)
    if fmt == "int8":
        return jnp.round(y).astype(jnp.int8), scale
    return y.astype(jnp.float8_e4m3fn), scale


def _activation_product(
    x: jax.Array, q: QArray, fmt: str, acc_dtype, out_dtype, fn: str, contract_axis: int
):
    n = q.shape[1 - contract_axis]
    x2, lead = flatten_rows(jnp.asarray(x), q.shape[contract_axis], fn)
    out_dtype = jnp.dtype(x2.dtype if out_dtype is None else out_dtype)
    codes, x_scale = quantize_rows(x2, fmt, _static_bound(q))
    acc = jax.lax.dot_general(
        codes, q.codes, (((1,), (contract_axis,)), ((), ())), preferred_element_type=acc_dtype
    )
    per_channel = (1, n) if contract_axis == 0 else (n, 1)
    w_scale = broadcast_blocks(q.scale_values(), per_channel).reshape(1, n)
    y = acc.astype(jnp.float32) * x_scale * w_scale
    return y.astype(out_dtype).reshape(*lead, n)


def _check_activation_weight(q: QArray, fmt: str, contract_axis: int, fn: str) -> None:
    if contract_axis not in (0, 1):
        raise ValueError(f"{fn}: contract_axis={contract_axis}; expected 0 ([K, N]) or 1 ([N, K])")
    shape = "[K, N]" if contract_axis == 0 else "[N, K]"
    scale = "[1, N]" if contract_axis == 0 else "[N, 1]"
    ok = q.ndim == 2 and q.format == fmt and q.scale.shape[contract_axis] == 1
    if not ok or (fmt == "int8" and q.zero_point is not None):
        raise ValueError(
            f"{fn} needs a {shape} {fmt} QArray with per-channel scales ({scale}) and no zero "
            f"point (contract_axis={contract_axis}); got {q!r}"
        )


def int8_matmul(
    x: jax.Array, q: QArray, *, out_dtype: Any = None, contract_axis: int = 0
) -> jax.Array:
    """w8a8: per-token int8 activations times an int8 per-channel weight, int32 accumulation.

    Plain XLA: the int8 x int8 -> int32 `dot_general` is what XLA lowers to cuBLASLt's int8
    tensor-core GEMM on GPU. Activation scales are per token (max |x| / 127), or one static
    scale when the weight carries calibrated `activation_bounds`.

    Args:
      x: [..., K] float.
      q: int8 QArray, [K, N] with scale [1, N] (or [1, 1]), or [N, K] with scale [N, 1] when
        `contract_axis` is 1; no zero point.
      out_dtype: result dtype (default: x's).
      contract_axis: q's axis of K.
    Returns:
      [..., N]. (`[N, K]` weights are the fast layout on GPU: see the module docstring.)
    """
    _check_activation_weight(q, "int8", contract_axis, "int8_matmul")
    return _activation_product(x, q, "int8", jnp.int32, out_dtype, "int8_matmul", contract_axis)


def fp8_matmul(
    x: jax.Array, q: QArray, *, out_dtype: Any = None, contract_axis: int = 0
) -> jax.Array:
    """Per-token float8_e4m3fn activations times an e4m3 per-channel weight, float32
    accumulation: an fp8 `dot_general`, which XLA runs on cuBLASLt's fp8 GEMM on Hopper.

    Args:
      x: [..., K] float.
      q: fp8_e4m3fn QArray, [K, N] with scale [1, N] (or [1, 1]), or [N, K] with scale
        [N, 1] when `contract_axis` is 1.
      out_dtype: result dtype (default: x's).
      contract_axis: q's axis of K.
    Returns:
      [..., N]. (`[N, K]` weights are the fast layout on GPU: see the module docstring.)
    """
    _check_activation_weight(q, FP8_FORMAT, contract_axis, "fp8_matmul")
    return _activation_product(
        x, q, FP8_FORMAT, jnp.float32, out_dtype, "fp8_matmul", contract_axis
    )
