"""Products on weights held as GGUF block rows, the file's own layout.

A GGUF tensor of a quantized type stores each output row `n` as consecutive blocks along K
(32 or 256 elements, their scales inside). The kernels here read those rows as they are:
the weight is ``uint8 [N, row_bytes]`` and nothing is laid out or dequantized ahead of a call.
Each 256-element unit of a row is decoded once a call into int8 codes with float scales per
16 elements (`cpu/gguf_blocks.h`), then multiplied with every activation row:

- float activations (the default): float multiply-adds, no rounding of the activations;
- int8 activations (`int8_activations=True`): each activation row quantized in blocks of 32
  (absmax / 127, round half to even: llama.cpp's Q8_0 blocks) and multiplied in integers, as
  llama.cpp multiplies these types.

On a lowering platform other than CPU (or without the compiled module) the pure-JAX reference
runs: the blocks decoded by `lowbit.formats.gguf_decode`'s decoders, then a float product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import GGUF_BLOCK_TYPES, gguf_decode_traced
from lowbit.kernels._kinds import GGUF_TYPE_IDS
from lowbit.kernels._ops import _by_platform, _check_float


def _row_bytes(ggml_type: str, k: int) -> int:
    t = GGUF_BLOCK_TYPES[ggml_type]
    if k % t.block_size:
        raise ValueError(f"K = {k} is not a whole number of {ggml_type} blocks ({t.block_size})")
    return k // t.block_size * t.type_size


def _check_rows(rows: jax.Array, ggml_type: str, k: int) -> int:
    if ggml_type not in GGUF_TYPE_IDS:
        raise ValueError(
            f"GGUF type {ggml_type!r} has no kernel; accepted: {', '.join(GGUF_TYPE_IDS)}"
        )
    want = _row_bytes(ggml_type, k)
    if rows.ndim != 2 or rows.dtype != jnp.uint8 or rows.shape[1] != want:
        raise ValueError(
            f"{ggml_type} weight rows must be uint8 [N, {want}] for K = {k}, got "
            f"{rows.dtype} {tuple(rows.shape)}"
        )
    return int(rows.shape[0])


def _q8_blocks(x: jax.Array) -> jax.Array:
    """x [M, K] float32 rounded as the kernel's int8 activations (blocks of 32), as floats."""
    m, k = x.shape
    pad = -k % 32
    blocks = jnp.pad(x, ((0, 0), (0, pad))).reshape(m, -1, 32)
    d = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / 127
    q = jnp.clip(jnp.round(blocks / jnp.where(d > 0, d, 1)), -127, 127)
    return (q * d).reshape(m, -1)[:, :k]


def gguf_dequantize(rows: jax.Array, ggml_type: str, k: int) -> jax.Array:
    """The float32 weight ``[N, K]`` of GGUF block rows, equal to llama.cpp's dequantization.

    Args:
      rows: uint8 ``[N, row_bytes]``, row n the blocks of output n.
      ggml_type: e.g. ``"Q4_K"`` (one of `GGUF_TYPE_IDS`).
      k: elements a row.
    """
    n = _check_rows(rows, ggml_type, k)

    def reference():
        return gguf_decode_traced(ggml_type, rows)

    def native():
        call = jax.ffi.ffi_call(
            "lowbit_gguf_dequantize",
            jax.ShapeDtypeStruct((n, k), jnp.float32),
            vmap_method="sequential",
        )
        return call(rows, type=np.int64(GGUF_TYPE_IDS[ggml_type]), k=np.int64(k), n=np.int64(n))

    return _by_platform(native, reference)


def gguf_linear(
    x: jax.Array,
    rows: jax.Array,
    ggml_type: str,
    *,
    out_dtype=None,
    int8_activations: bool = False,
) -> jax.Array:
    """``x @ W.T`` for W the GGUF block rows `rows` (``[N, K]`` logically).

    Args:
      x: [..., K] float32 | bfloat16.
      rows: uint8 ``[N, row_bytes]``.
      ggml_type: one of `GGUF_TYPE_IDS`.
      out_dtype: float32 | bfloat16, default x's.
      int8_activations: multiply on int8 activations in blocks of 32 (see the module
        docstring) instead of float ones.
    Returns:
      [..., N] in `out_dtype`.
    """
    x = jnp.asarray(x)
    k = int(x.shape[-1])
    n = _check_rows(rows, ggml_type, k)
    _check_float("x", x.dtype)
    out = _check_float("out_dtype", out_dtype or x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]

    def reference():
        xf = x2.astype(jnp.float32)
        if int8_activations:
            xf = _q8_blocks(xf)
        w = gguf_decode_traced(ggml_type, rows)
        y = jax.lax.dot_general(xf, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return y.astype(out)

    def native():
        call = jax.ffi.ffi_call(
            "lowbit_gguf_linear", jax.ShapeDtypeStruct((m, n), out), vmap_method="sequential"
        )
        return call(
            x2,
            rows,
            type=np.int64(GGUF_TYPE_IDS[ggml_type]),
            k=np.int64(k),
            n=np.int64(n),
            act_q8=np.int64(bool(int8_activations)),
        )

    y = reference() if m == 0 else _by_platform(native, reference)
    return y.reshape(*lead, n)

