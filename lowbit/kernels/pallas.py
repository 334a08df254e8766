"""Accelerator (GPU, TPU) matmuls on quantized weights: Pallas kernels and the XLA paths.

Three products of activations `x [M, K]` (bfloat16 or float32) and a 2-D `QArray` weight
`q [K, N]` contracted over its axis 0 (a Flax ``[in, out]`` kernel):

- `weight_only_matmul`: int4 (symmetric), uint4 (zero point), nf4 and int8 weights, one Pallas
  kernel. It reads the QArray's codes exactly as stored (two 4-bit codes a byte, packed along
  K or N as `packed_axis` says, low nibble first) and its scales and zero points, and
  decodes each `[block_k, block_n]` tile in registers: no float copy of the weight is
  written to memory and nothing is repacked outside the kernel. Tiles of up to 64 rows
  (decode) multiply the decoded codes and apply zero points and scales to the dot's result;
  larger ones dequantize the weight tile first. Products accumulate in float32. On CUDA it
  lowers through Triton; `interpret=True` runs the same kernel body anywhere (the tests use
  it on CPU). `platform="tpu"` takes the Mosaic body of `_pallas_tpu` instead: the same
  reading of the codes (`_pallas_codes`), tiles shaped for TPU vector registers, K steps on
  the grid. On CUDA that Triton kernel is one of three bodies (`Blocks.body`): from
  `XLA_MIN_ROWS` rows (prefill) the weight is dequantized in x's dtype and XLA's GEMM runs
  it, and shapes the dot's 16-element tiles cannot cover take the GEMV body
  (`_pallas_gemv`).
- `int8_matmul` (w8a8): dynamic per-token int8 activations times int8 per-channel weights.
- `fp8_matmul`: per-token float8_e4m3fn activations times float8_e4m3fn per-channel weights.

The two activation-quantized products are plain XLA on purpose: XLA lowers a
`lax.dot_general` of int8 operands with int32 accumulation (or of float8 operands with
float32 accumulation) to its integer / fp8 tensor-core GEMMs on GPU (cuBLASLt or its own
Triton GEMMs), so a hand-written kernel would re-implement a library call. Scales are
applied to the int32 / float32 result. Those GEMMs read the weight K-major, `[N, K]`
(PyTorch's `Linear` layout; `contract_axis=1`): given `[K, N]` (Flax's), XLA takes a slower
GEMM. On an H200 at 8192 x 8192: int8 at M = 4096 0.82 ms against 0.42 ms, fp8 at M = 16
0.47 ms against 0.024 ms (BENCHMARKS.md, "GPU"). The engine's CUDA lowering of a `[K, N]`
weight multiplies a K-major copy instead (`lowbit.ops._accelerated.CUDA_K_MAJOR_MIN_ROWS`).

`supports(q, m)` says which of these a weight takes ("pallas", "xla") or None, so a caller
falls back to `q.dequantize()` and a float matmul and can count the fallbacks; `matmul`
dispatches on it.

Block sizes: Triton wants power-of-two tiles of at least 16 along each dot axis, so `block_k`
and `block_n` must divide K and N (and, with grouped scales, `block_k` must divide the group
so each K step reads one scale row). M is padded to `block_m` internally, so any M works.
Small M (decode) splits K across programs (`split_k`) so that enough programs stream the
weight to fill the GPU; the float32 partial sums are added afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

from lowbit.formats import get_format
from lowbit.kernels import _pallas_gemv, _pallas_tpu
from lowbit.kernels._pallas_codes import PALLAS_FORMATS
from lowbit.kernels._pallas_codes import Layout as _Layout
from lowbit.kernels._pallas_codes import decode_codes as _decode_codes
from lowbit.kernels._pallas_codes import layout_of as _layout
from lowbit.kernels._pallas_codes import weight_operands as _weight_operands
from lowbit.kernels._xla_products import (
    FP8_FORMAT,
    flatten_rows,
    fp8_matmul,
    int8_matmul,
    quantize_rows,
)
from lowbit.qarray import QArray

__all__ = [
    "FP8_FORMAT",
    "Blocks",
    "blocks_for",
    "fp8_matmul",
    "int8_matmul",
    "matmul",
    "quantize_rows",
    "supports",
    "weight_only_matmul",
]

_MIN_BLOCK = 16  # Triton's smallest dot tile along each axis
_MAX_BLOCK_M = 128
# Decode (small M) splits K until the grid has about this many programs: two per SM of an
# H100 or H200 (132 SMs), enough to keep the memory busy while each program streams its slice.
_TARGET_PROGRAMS = 256
_SMALL_M = 64  # at or below this, the product is weight-bandwidth bound: split K
# The GEMV body (`_pallas_gemv`) runs by default only shapes the dot body cannot tile (K or
# a group under 16): on an H200 at 8192 x 8192, int4 g128, M = 1, the best of its tiles took
# 0.042 ms against the dot body's 0.033 ms (two runs, 2026-12-04; BENCHMARKS.md, "GPU"):
# each code then costs a scale multiply and an FMA on the vector units, which the dot body
# leaves to the tensor cores.
GEMV_MAX_ROWS = 16
# From this many rows on, XLA's own product of the dequantized weight (a transient copy in
# the activations' dtype, then its tensor-core GEMM) beats the dot body: int4 g128 at
# M = 4096, 8192 x 8192: 0.88 against 1.65 ms (bf16 weights: 0.79); at M = 256 the two
# tie (0.142 against 0.138 ms).
XLA_MIN_ROWS = 1024
_GEMV_MAX_BLOCK_M = 16
# Accumulator elements a GEMV program holds (rows x block_k x block_n): 128 float32
# registers a thread at 4 warps.
_GEMV_ACC_ELEMENTS = 16384


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes of `weight_only_matmul`: output tiles `[m, n]`, K steps of `k`, and K split
    over `split_k` programs whose float32 partial sums are added at the end; `num_warps` and
    `num_stages` are Triton's (0: its defaults, 4 warps and 3 pipeline stages). `body`: "dot"
    (the Triton dot kernel), "gemv" (`_pallas_gemv`: vector units, rows rounded up to a power
    of two, not to 16) or "xla" (no kernel: the weight dequantized in the activations' dtype,
    then XLA's dot)."""

    m: int
    n: int
    k: int
    split_k: int = 1
    num_warps: int = 0
    num_stages: int = 0
    body: str = "dot"

    @property
    def gemv(self) -> bool:
        return self.body == "gemv"

    def __str__(self) -> str:
        if self.body == "xla":
            return "xla (dequantize, then XLA's dot)"
        extra = f" w{self.num_warps}" if self.num_warps else ""
        extra += f" s{self.num_stages}" if self.num_stages else ""
        body = "gemv " if self.gemv else ""
        return f"{body}{self.m}x{self.n}x{self.k} split {self.split_k}{extra}"


# --- which path ---------------------------------------------------------------------------------
def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_divisors(n: int, lo: int, hi: int) -> list[int]:
    """Powers of two p with lo <= p <= hi dividing n, ascending."""
    out, p = [], lo
    while p <= hi:
        if n % p == 0:
            out.append(p)
        p *= 2
    return out


def _activation_format(q: QArray) -> str | None:
    """The activation format of a weight with a (symmetric) activation config, else None."""
    config = q.activation
    if config is None:
        return None
    if not getattr(config, "symmetric", False):
        return "asymmetric"
    return get_format(config.format).name


def supports(q: Any, m: int, x_dtype: Any = jnp.bfloat16, platform: str = "cuda") -> str | None:
    """Which accelerator path multiplies `x [m, K]` by the weight `q [K, N]` on `platform`
    ("cuda" or "tpu").

    Returns:
      "pallas" (`weight_only_matmul`: int4 / uint4 / nf4 / int8 weights, no activation
      quantization), "xla" (`int8_matmul` for int8 per-channel weights with int8 activations,
      `fp8_matmul` for fp8 e4m3 per-channel weights with fp8 activations), or None: the caller
      falls back to `q.dequantize()` and a float matmul (and counts it).
    """
    if not isinstance(q, QArray) or q.ndim != 2 or m < 1:
        return None
    if jnp.dtype(x_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return None
    if q.activation is not None:
        return "xla" if _xla_kind(q) is not None else None
    layout = _layout(q)
    if layout is None:
        return None
    try:
        _blocks(m, layout, x_dtype, platform, None)
    except ValueError:
        return None
    return "pallas"


def _blocks(
    m: int,
    layout: _Layout,
    x_dtype: Any,
    platform: str,
    requested: Blocks | None,
    body: str | None = None,
):
    """The tiles of `platform`'s body: `Blocks` (CUDA) or `TpuBlocks` (TPU)."""
    if platform == "cuda":
        return _choose_blocks(m, layout, requested, body)
    if platform != "tpu":
        raise ValueError(f"weight_only_matmul: platform={platform!r}; expected 'cuda' or 'tpu'")
    if body not in (None, "dot"):
        raise ValueError(f"weight_only_matmul: body={body!r} is CUDA's; the TPU has its own")
    if requested is not None and (
        requested.split_k > 1 or requested.num_warps or requested.num_stages
    ):
        raise ValueError(
            "weight_only_matmul: split_k, num_warps and num_stages are Triton's (CUDA); the TPU "
            "body takes block_m, block_n and block_k only"
        )
    want = (
        None if requested is None else _pallas_tpu.TpuBlocks(requested.m, requested.n, requested.k)
    )
    return _pallas_tpu.choose_blocks(m, layout, x_dtype, want)


def _xla_kind(q: QArray) -> str | None:
    """The XLA product (`int8_matmul`: "int8", `fp8_matmul`: "fp8") for `q`, else None."""
    per_channel = q.scale.shape[0] == 1 and q.zero_point is None and q.input_scale is None
    if q.ndim != 2 or not per_channel or q.scale_encoding != "float":
        return None
    activation = _activation_format(q)
    if q.format == "int8" and activation == "int8":
        return "int8"
    if q.format == FP8_FORMAT and activation == FP8_FORMAT:
        return "fp8"
    return None


# --- blocks -------------------------------------------------------------------------------------
def _min_block(layout: _Layout, axis: str) -> int:
    # Nibbles packed along an axis are unpacked into two half tiles that each enter a dot,
    # so that axis's tile needs twice Triton's minimum.
    return 2 * _MIN_BLOCK if layout.packed == axis else _MIN_BLOCK


def _shape_error(layout: _Layout, axis: str, size: int, floor: int, extra: str = "") -> ValueError:
    return ValueError(
        f"weight_only_matmul: weight shape (K, N) = ({layout.k}, {layout.n}) has {axis}={size}, "
        f"which no power-of-two block >= {floor} divides{extra}. Pad {axis} to a multiple of "
        f"{floor} (zero weights), or multiply `q.dequantize()` with a float matmul instead"
    )


def _choose_blocks(
    m: int, layout: _Layout, requested: Blocks | None = None, body: str | None = None
) -> Blocks:
    """Tile sizes for `x [m, K]` times a weight of `layout`, honouring `requested` fields > 0,
    and the body (`Blocks.body`): `body`, or by default "xla" from `XLA_MIN_ROWS` rows,
    else "dot", else (a shape the dot body cannot tile, at most `GEMV_MAX_ROWS` rows) "gemv".

    Raises:
      ValueError: naming the shape and the fix, when K, N or the group has no valid block, or a
        requested block is not a power of two >= 16 dividing its axis.
    """
    if body not in (None, "dot", "gemv", "xla"):
        raise ValueError(f"weight_only_matmul: body={body!r}; expected 'dot', 'gemv' or 'xla'")
    tiled = requested is not None and requested != Blocks(0, 0, 0, 0)
    if body == "xla" or (body is None and m >= XLA_MIN_ROWS and not tiled):
        return Blocks(m, 0, 0, 1, body="xla")
    if body == "gemv":
        return _choose_gemv_blocks(m, layout, requested or Blocks(0, 0, 0, 0))
    try:
        return _choose_dot_blocks(m, layout, requested)
    except ValueError:
        if body is not None or tiled or m > GEMV_MAX_ROWS:
            raise
        return _choose_gemv_blocks(m, layout, Blocks(0, 0, 0, 0))


def _choose_dot_blocks(m: int, layout: _Layout, requested: Blocks | None) -> Blocks:
    want = requested or Blocks(0, 0, 0, 0)
    k_floor, n_floor = _min_block(layout, "k"), _min_block(layout, "n")
    k_limit, n_options, k_options = _tile_options(layout, k_floor, n_floor, 256)
    bm = want.m or min(_MAX_BLOCK_M, max(_MIN_BLOCK, 1 << (max(m, 1) - 1).bit_length()))
    small = m <= _SMALL_M
    # From a tile sweep on an H200 (K = N = 4096, 8192): 128-wide tiles beat 64-wide ones at
    # every M; decode wants long K steps (more bytes in flight), large M the usual 64.
    bn = want.n or max(b for b in n_options if b <= 128)
    bk = want.k or max(b for b in k_options if b <= (128 if small else 64))
    _check_block("block_m", bm, None, _MIN_BLOCK)
    _check_block("block_n", bn, layout.n, n_floor, layout)
    _check_block("block_k", bk, math.gcd(layout.k, k_limit), k_floor, layout)
    # Decode wants ~2 programs an SM streaming the weight; larger M only a full first wave.
    target = _TARGET_PROGRAMS if small else _TARGET_PROGRAMS // 2
    split = want.split_k or _split_k(m, bm, bn, bk, layout, target)
    _check_split(split, bk, layout)
    return Blocks(bm, bn, bk, split, want.num_warps, want.num_stages)


def _tile_options(
    layout: _Layout, k_floor: int, n_floor: int, n_max: int
) -> tuple[int, list[int], list[int]]:
    """(K step limit, block_n options, block_k options): powers of two from the floors that
    divide N, and K within one scale group (a K step reads one scale row).

    Raises:
      ValueError: naming the shape and the fix, when N or K has none.
    """
    k_limit = layout.group if layout.groups > 1 else layout.k
    n_options = _pow2_divisors(layout.n, n_floor, n_max)
    k_options = _pow2_divisors(math.gcd(layout.k, k_limit), k_floor, 256)
    if not n_options:
        raise _shape_error(layout, "N", layout.n, n_floor)
    if not k_options:
        extra = f" together with the group size {layout.group}" if layout.groups > 1 else ""
        raise _shape_error(layout, "K", layout.k, k_floor, extra)
    return k_limit, n_options, k_options


def _check_split(split: int, bk: int, layout: _Layout) -> None:
    bad_groups = layout.groups > 1 and layout.groups % split
    if not _is_pow2(split) or layout.k % (split * bk) or bad_groups:
        raise ValueError(
            f"weight_only_matmul: split_k={split} must be a power of two with split_k * block_k "
            f"dividing K={layout.k} (and the {layout.groups} scale groups); pick a smaller one"
        )


def _choose_gemv_blocks(m: int, layout: _Layout, want: Blocks) -> Blocks:
    """Tiles of the GEMV body: `m` rows rounded up to a power of two, no dot minimum.

    Each row keeps a float32 accumulator of the `[block_k, block_n]` tile (two half tiles
    with nibbles packed along N), so the default `block_k` shrinks as rows grow to hold
    about `_GEMV_ACC_ELEMENTS` accumulator elements a program.
    """
    rows = 1 << (max(m, 1) - 1).bit_length()
    if want.m and want.m != rows:
        raise ValueError(
            f"weight_only_matmul: the GEMV body takes block_m = the rows rounded up to a power "
            f"of two ({rows} for M={m}); got block_m={want.m}. Pass block_m=None"
        )
    if rows > _GEMV_MAX_BLOCK_M:
        raise ValueError(
            f"weight_only_matmul: the GEMV body takes at most {_GEMV_MAX_BLOCK_M} rows; got "
            f"M={m}. Pass body=None or 'dot'"
        )
    # Nibbles packed along an axis split it in two halves of at least one element; along N,
    # 16-byte code rows at least (a full sector a row is the default).
    k_floor = 2 if layout.packed == "k" else 1
    n_floor = 32 if layout.packed == "n" else 16
    k_limit, n_options, k_options = _tile_options(layout, k_floor, n_floor, 512)
    bn = want.n or max(b for b in n_options if b <= 256)
    fitting = [b for b in k_options if rows * b * bn <= _GEMV_ACC_ELEMENTS]
    bk = want.k or max(fitting or k_options[:1])
    _check_block("block_n", bn, layout.n, n_floor, layout)
    _check_block("block_k", bk, math.gcd(layout.k, k_limit), k_floor, layout)
    split = want.split_k or _split_k(rows, rows, bn, bk, layout, _TARGET_PROGRAMS)
    _check_split(split, bk, layout)
    return Blocks(rows, bn, bk, split, want.num_warps, want.num_stages, body="gemv")


def _check_block(
    name: str, value: int, divides: int | None, floor: int, layout: _Layout | None = None
) -> None:
    if not _is_pow2(value) or value < floor or (divides is not None and divides % value):
        where = "" if divides is None else f" dividing {divides}"
        shape = "" if layout is None else f" for weight shape (K, N) = ({layout.k}, {layout.n})"
        raise ValueError(
            f"weight_only_matmul: {name}={value}{shape} must be a power of two >= {floor}"
            f"{where} (grouped scales: block_k must divide the group size); pass another "
            f"{name} or None to choose one"
        )


def _split_k(m: int, bm: int, bn: int, bk: int, layout: _Layout, target: int) -> int:
    """Smallest power-of-two split of K that gives at least `target` programs (if K allows)."""
    programs = -(-m // bm) * (layout.n // bn)
    split = 1
    while programs * split < target:
        nxt = split * 2
        if layout.k % (nxt * bk) or (layout.groups > 1 and layout.groups % nxt):
            break
        split = nxt
    return split


# --- the kernel ---------------------------------------------------------------------------------
def blocks_for(
    q: QArray,
    m: int,
    requested: Blocks | None = None,
    platform: str = "cuda",
    x_dtype: Any = jnp.bfloat16,
    body: str | None = None,
) -> Blocks | _pallas_tpu.TpuBlocks:
    """The tiles `weight_only_matmul` runs `x [m, K] @ q` with on `platform` (`requested`
    fields > 0 kept).

    Raises:
      ValueError: for a weight the kernel cannot read, or a shape or block no tile fits.
    """
    layout = _layout(q) if isinstance(q, QArray) else None
    if layout is None:
        raise ValueError(f"weight_only_matmul cannot read {q!r} (see `supports`)")
    return _blocks(m, layout, x_dtype, platform, requested, body)


# At or below this many rows a tile scales its [bm, bn] dot result per K step instead of its
# [bk, bn] weight tile: fewer multiplies, and the dot then reads exact integer codes.
_SCALE_AFTER_DOT_M = 64


def _partial_product(x, codes, scale, zero, kind: str, dtype, after_dot: bool, grouped: bool):
    """x [bm, r] `dtype` times the weight tile of codes [r, c] (int32) -> [bm, c] float32.

    scale, zero: [1, c] (zero may be None). With `after_dot`, the dot multiplies the decoded
    codes and the zero point and scale apply to its result,
    (x @ v - rowsum(x) z) s, the scale only if `grouped` (else once at the end); otherwise
    the tile is dequantized first, x @ ((v - z) s).
    """
    if not after_dot:
        values = _decode_codes(codes, kind)
        if zero is not None:
            values = values - zero.astype(jnp.float32)
        w = (values * scale.astype(jnp.float32)).astype(dtype)
        return jax.lax.dot(x, w, preferred_element_type=jnp.float32)
    part = jax.lax.dot(x, _decode_codes(codes, kind, dtype), preferred_element_type=jnp.float32)
    if zero is not None:
        row_sums = jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)
        part = part - row_sums * zero.astype(jnp.float32)
    return part * scale.astype(jnp.float32) if grouped else part


def _interleave_columns(even: jax.Array, odd: jax.Array) -> jax.Array:
    """[r, c] and [r, c] -> [r, 2c] with `even` in the even columns (Triton's join + reshape)."""
    rows, cols = even.shape
    return jnp.stack([even, odd], axis=-1).reshape(rows, 2 * cols)


def _kernel(x_ref, c_ref, s_ref, *refs, layout: _Layout, blocks: Blocks, dtype):
    """One `[block_m, block_n]` output tile over one K split.

    Refs: x [bm, K/S]; codes [K/S, bn] (int8), [K/S, bn/2] (packed along N) or [K/(2S), bn]
    (packed along K); scale and zero point [G/S, bn] (grouped) or [1, bn]; out [bm, bn].

    Nibbles packed along N are never interleaved into a [bk, bn] tile (a shuffle through
    shared memory every K step): low and high nibbles multiply into two accumulators for the
    even and odd columns, with the scales read at stride 2, and the two are interleaved once
    at the end. Nibbles packed along K multiply the even and odd activation columns instead.
    """
    z_ref = refs[0] if layout.zero else None
    o_ref = refs[-1]
    bk, bn = blocks.k, blocks.n
    steps = layout.k // blocks.split_k // bk
    grouped = layout.groups > 1
    after_dot = blocks.m <= _SCALE_AFTER_DOT_M
    halves = layout.packed == "n"
    width = bn // 2 if halves else bn
    product = functools.partial(
        _partial_product, kind=layout.kind, dtype=dtype, after_dot=after_dot, grouped=grouped
    )

    def scales(row, half: int | None):
        """scale and zero point [1, width] of scale row `row` (one column parity if half)."""
        cols = slice(None) if half is None else pl.ds(half, width, stride=2)
        scale = s_ref[pl.ds(row, 1), cols]
        return scale, None if z_ref is None else z_ref[pl.ds(row, 1), cols]

    def step(t, accs):
        row = (t * bk) // layout.group if grouped else 0
        if layout.packed == "k":
            # Byte j holds rows 2j (low nibble) and 2j+1 (high nibble).
            packed = c_ref[pl.ds(t * (bk // 2), bk // 2), :].astype(jnp.int32)
            x_even = x_ref[:, pl.ds(t * bk, bk // 2, stride=2)].astype(dtype)
            x_odd = x_ref[:, pl.ds(t * bk + 1, bk // 2, stride=2)].astype(dtype)
            scale, zero = scales(row, None)
            low = product(x_even, packed & 15, scale, zero)
            return (accs[0] + low + product(x_odd, packed >> 4, scale, zero),)
        codes = c_ref[pl.ds(t * bk, bk), :].astype(jnp.int32)
        x = x_ref[:, pl.ds(t * bk, bk)].astype(dtype)
        if not halves:
            return (accs[0] + product(x, codes, *scales(row, None)),)
        return (
            accs[0] + product(x, codes & 15, *scales(row, 0)),
            accs[1] + product(x, codes >> 4, *scales(row, 1)),
        )

    zeros = jnp.zeros((blocks.m, width), jnp.float32)
    accs = jax.lax.fori_loop(0, steps, step, (zeros, zeros) if halves else (zeros,))
    if after_dot and not grouped:
        parities = (0, 1) if halves else (None,)
        accs = tuple(
            acc * scales(0, h)[0].astype(jnp.float32) for acc, h in zip(accs, parities, strict=True)
        )
    out = _interleave_columns(*accs) if halves else accs[0]
    o_ref[...] = out.astype(o_ref.dtype)


def _specs(layout: _Layout, blocks: Blocks) -> tuple[list, pl.BlockSpec]:
    """BlockSpecs over the grid (M blocks, N blocks, K splits)."""
    k_split = layout.k // blocks.split_k
    code_block = {
        None: (k_split, blocks.n),
        "n": (k_split, blocks.n // 2),
        "k": (k_split // 2, blocks.n),
    }[layout.packed]
    scale_rows = layout.groups // blocks.split_k if layout.groups > 1 else 1
    scale_index = (lambda i, j, s: (s, j)) if layout.groups > 1 else (lambda i, j, s: (0, j))
    specs = [
        pl.BlockSpec((blocks.m, k_split), lambda i, j, s: (i, s)),
        pl.BlockSpec(code_block, lambda i, j, s: (s, j)),
        pl.BlockSpec((scale_rows, blocks.n), scale_index),
    ]
    if layout.zero:
        specs.append(pl.BlockSpec((scale_rows, blocks.n), scale_index))
    n_blocks = layout.n // blocks.n
    # Split partial sums sit side by side along N: [M, S * N], block (i, s * N/bn + j).
    out = pl.BlockSpec((blocks.m, blocks.n), lambda i, j, s: (i, s * n_blocks + j))
    return specs, out


def _pallas_forward(x: jax.Array, q: QArray, layout: _Layout, blocks, out_dtype, interpret):
    """x [M, K] -> [M, N] `out_dtype` through the kernel of `blocks`' platform."""
    if isinstance(blocks, _pallas_tpu.TpuBlocks):
        return _pallas_tpu.forward(x, q, layout, blocks, out_dtype, interpret)
    if blocks.body == "xla":  # no kernel, no tiles: nothing to pad
        w = q.dequantize(x.dtype)
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
    m = x.shape[0]
    m_pad = -(-m // blocks.m) * blocks.m
    if m_pad != m:
        x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    params = None
    if (blocks.num_warps or blocks.num_stages) and not interpret:
        params = pl_triton.CompilerParams(
            num_warps=blocks.num_warps or None, num_stages=blocks.num_stages or None
        )
    if blocks.gemv:
        y = _pallas_gemv.forward(
            x,
            _weight_operands(q, layout),
            layout,
            block_n=blocks.n,
            block_k=blocks.k,
            split_k=blocks.split_k,
            out_dtype=out_dtype,
            compiler_params=params,
            interpret=interpret,
        )
        return y[:m]
    dtype = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    split = blocks.split_k
    in_specs, out_spec = _specs(layout, blocks)
    partial_dtype = jnp.float32 if split > 1 else out_dtype
    kernel = functools.partial(_kernel, layout=layout, blocks=blocks, dtype=dtype)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, split * layout.n), partial_dtype),
        grid=(m_pad // blocks.m, layout.n // blocks.n, split),
        in_specs=in_specs,
        out_specs=out_spec,
        interpret=interpret,
        compiler_params=params,
        name=f"lowbit_{layout.kind}_matmul",
    )(x, *_weight_operands(q, layout))
    if split > 1:
        y = y.reshape(m_pad, split, layout.n).sum(axis=1)
    return y[:m].astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _weight_only(x, q, layout, blocks, out_dtype, interpret):
    return _pallas_forward(x, q, layout, blocks, out_dtype, interpret)


def _weight_only_fwd(x, q, layout, blocks, out_dtype, interpret):
    # x itself is not needed, only its dtype: keep an empty array of it.
    return _pallas_forward(x, q, layout, blocks, out_dtype, interpret), (q, x[:0, :0])


def _weight_only_bwd(layout, blocks, out_dtype, interpret, residuals, g):
    # dx = g @ W^T with W dequantized in float: the backward pass is rare (fine-tuning
    # adapters through a frozen quantized base), so a float copy of W is acceptable here.
    q, x_like = residuals
    w = q.dequantize(jnp.float32)
    dx = jax.lax.dot(g.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
    zeros = jax.tree_util.tree_map(_zero_cotangent, q)
    return dx.astype(x_like.dtype), zeros


def _zero_cotangent(leaf: jax.Array) -> jax.Array:
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jnp.zeros_like(leaf)
    return np.zeros(leaf.shape, jax.dtypes.float0)


_weight_only.defvjp(_weight_only_fwd, _weight_only_bwd)


def _input_scaled(x: jax.Array, q: QArray) -> jax.Array:
    """x times the weight's per-input-channel SmoothQuant factor, if any ([K, 1])."""
    if q.input_scale is None:
        return x
    return (x.astype(jnp.float32) * q.input_scale[:, 0].astype(jnp.float32)).astype(x.dtype)


def weight_only_matmul(
    x: jax.Array,
    q: QArray,
    *,
    out_dtype: Any = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    differentiable: bool = True,
    platform: str = "cuda",
    body: str | None = None,
) -> jax.Array:
    """`x @ q.dequantize()` with the weight dequantized tile by tile inside a Pallas kernel.

    Args:
      x: [..., K] bfloat16 or float32 (bfloat16 products in bfloat16, float32 ones at the
        dot's default precision, TF32 on recent NVIDIA GPUs; float32 accumulation either way).
      q: [K, N] int4 / uint4 / nf4 / int8 QArray, weight-only, scales per group along K or per
        channel, zero points allowed.
      out_dtype: result dtype (default: x's).
      block_m, block_n, block_k, split_k: tile sizes, None to choose. CUDA: powers of two
        >= 16, block_n and block_k dividing N and K, block_k dividing the scale group. TPU
        (no split_k): block_m a multiple of 8 (16 for bfloat16 x), block_n N or a multiple
        of 128 (256 with nibbles packed along N), block_k K or a multiple of 128 (256 packed
        along K) holding whole groups or lying in one.
      num_warps, num_stages: Triton launch parameters (CUDA), None for the defaults.
      interpret: run the kernel body in the Pallas interpreter (any backend, e.g. CPU tests);
        for the TPU body, `pltpu.InterpretParams(...)` sets the TPU interpreter's checks
        (race detection, uninitialized memory as NaN).
      differentiable: False leaves out the derivative rule, for a caller that puts one around
        a choice of kernels by platform (`lowbit.kernels.by_platform`: a rule inside one
        platform's branch would be lowered out of line, for every platform of a
        multi-platform export, where the Pallas call cannot lower).
      platform: "cuda" (the Triton body) or "tpu" (the Mosaic body, `_pallas_tpu`).
      body: on CUDA, "dot" (the Triton dot kernel), "gemv" (`_pallas_gemv`: no dot, the rows
        rounded up to a power of two, at most 16) or "xla" (the weight dequantized in x's
        dtype, a transient copy, then XLA's dot); None: "xla" from `XLA_MIN_ROWS` rows
        unless tiles are requested, else "dot", else "gemv" for shapes only it can tile.
    Returns:
      [..., N] in `out_dtype`. Differentiable in x (the gradient uses the dequantized weight).
    Raises:
      ValueError: for a weight this kernel cannot read (see `supports`), or a shape or block
        size no tile fits, naming the shape and the fix.
    """
    layout = _layout(q) if isinstance(q, QArray) else None
    if layout is None:
        raise ValueError(
            f"weight_only_matmul reads 2-D weight-only {'/'.join(PALLAS_FORMATS)} QArrays with "
            f"scales per K group or per column; got {q!r}. Use `matmul` (which falls back) or "
            "`q.dequantize()` with a float matmul"
        )
    x2, lead = flatten_rows(jnp.asarray(x), layout.k, "weight_only_matmul")
    if x2.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"weight_only_matmul: x dtype {x2.dtype}; accepted: bfloat16, float32")
    requested = Blocks(
        block_m or 0, block_n or 0, block_k or 0, split_k or 0, num_warps or 0, num_stages or 0
    )
    blocks = _blocks(x2.shape[0], layout, x2.dtype, platform, requested, body)
    out_dtype = jnp.dtype(x2.dtype if out_dtype is None else out_dtype)
    product = _weight_only if differentiable else _pallas_forward
    if not isinstance(interpret, pltpu.InterpretParams):
        interpret = bool(interpret)
    y = product(_input_scaled(x2, q), q, layout, blocks, out_dtype, interpret)
    return y.reshape(*lead, layout.n)


def matmul(x: jax.Array, q: QArray, *, out_dtype: Any = None, interpret: bool = False) -> jax.Array:
    """`x [..., K] @ q [K, N]` by the path `supports` names; the dequantized float product
    where it names none.
    """
    x = jnp.asarray(x)
    m = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    path = supports(q, m, x.dtype)
    if path == "pallas":
        return weight_only_matmul(x, q, out_dtype=out_dtype, interpret=interpret)
    if path == "xla":
        fn = int8_matmul if _xla_kind(q) == "int8" else fp8_matmul
        return fn(x, q, out_dtype=out_dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    w = q.dequantize(jnp.float32)
    return jnp.matmul(x.astype(jnp.float32), w).astype(out_dtype)
