"""The weight-only matmul's TPU body: a Pallas kernel that lowers to Mosaic.

`x [M, K] @ q [K, N]` for int4 / uint4 / nf4 / int8 weight-only QArrays, the codes read as
stored (two nibbles a byte). The grid is (M blocks, N blocks, K steps) with the K steps
innermost and sequential: each step decodes its `[block_k, block_n]` codes in VMEM, applies
zero points and scales (one scale row per group; a step holds one or several groups), and
adds the tile's product to a float32 accumulator in VMEM, written out after the last step.
The Mosaic pipeline fetches the next step's blocks while this one computes.

What differs from the Triton body (`lowbit.kernels.pallas`), for Mosaic's sake:
- Mosaic tiles the last two dimensions of a block by (sublanes, 128 lanes), so no lane-strided
  loads: nibbles packed along N multiply into two accumulators, one per column parity, with
  the scales split by parity outside the kernel (G x N floats, small next to the codes); the
  two outputs are interleaved by XLA. Nibbles packed along K take the activations' even and
  odd columns, also split outside (activations only).
- Blocks are either whole axes or multiples of the (sublane, lane) tiles: 128 lanes of
  activations and output columns a parity, 32 rows of 8-bit codes.
- A step holding several scale groups scales its tile as `[groups, group, block_n]`, so a
  group must be a multiple of 8 rows (a sublane tile).

Not yet run on a TPU: tested in the Pallas TPU interpreter (`pltpu.InterpretParams`, with race
detection) and lowered for TPU from a CPU host.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lowbit.kernels._pallas_codes import Layout, decode_codes, weight_operands
from lowbit.qarray import QArray

_LANES = 128
_CODE_ROWS = 32  # sublane tile of 8-bit values
_SCALE_ROWS = 8  # sublane tile of 32-bit values: a reshaped group's rows
_MAX_BLOCK_M = 256
_BLOCK_N = (512, 256, 128)  # output columns of one parity, largest first
_BLOCK_K = (512, 256, 128)


@dataclasses.dataclass(frozen=True)
class TpuBlocks:
    """Tiles of the TPU body: output `[m, n]` (n counts both column parities), K steps of `k`."""

    m: int
    n: int
    k: int

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


def _parities(layout: Layout) -> int:
    return 2 if layout.packed == "n" else 1


def _step_ok(layout: Layout, bk: int) -> bool:
    """Whether K steps of `bk` rows respect the tiling and the scale groups."""
    if layout.k % bk:
        return False
    rows = bk // 2 if layout.packed == "k" else bk  # code rows (and activation columns) a step
    whole = bk == layout.k
    if not whole and (rows % _CODE_ROWS or rows % _LANES):
        return False
    if layout.groups == 1 or layout.group % bk == 0:
        return True  # one scale row a step
    if bk % layout.group:
        return False
    group_rows = layout.group // 2 if layout.packed == "k" else layout.group
    return group_rows % _SCALE_ROWS == 0


def choose_blocks(m: int, layout: Layout, dtype: Any, requested: TpuBlocks | None = None):
    """Tiles for `x [m, K]` (`dtype`) times a weight of `layout`; `requested` fields > 0 kept.

    Raises:
      ValueError: naming the shape and the fix, when no block fits K, N or the groups, or a
        requested block does not.
    """
    want = requested or TpuBlocks(0, 0, 0)
    parities = _parities(layout)
    width = layout.n // parities
    sublanes = 16 if jnp.dtype(dtype) == jnp.bfloat16 else 8
    bm = want.m or min(_MAX_BLOCK_M, -(-max(m, 1) // sublanes) * sublanes)
    if bm % sublanes:
        raise ValueError(
            f"weight_only_matmul (TPU): block_m={bm} must be a multiple of {sublanes} for "
            f"{jnp.dtype(dtype).name} activations; pass another block_m or None"
        )
    if want.n:
        bn = want.n
        ok = layout.n % bn == 0 and (bn == layout.n or (bn // parities) % _LANES == 0)
    else:
        bn = next((b * parities for b in _BLOCK_N if width % b == 0), layout.n)
        ok = True
    if not ok:
        raise ValueError(
            f"weight_only_matmul (TPU): block_n={bn} for weight shape (K, N) = ({layout.k}, "
            f"{layout.n}) must divide N and be N or {parities * _LANES} times an integer; pass "
            "another block_n or None"
        )
    if want.k:
        bk = want.k
        ok = _step_ok(layout, bk)
    else:
        bk = next((b for b in _BLOCK_K if _step_ok(layout, b)), layout.k)
        ok = _step_ok(layout, bk)
    if not ok:
        multiple = 2 * _LANES if layout.packed == "k" else _LANES
        raise ValueError(
            f"weight_only_matmul (TPU): no K step fits weight shape (K, N) = ({layout.k}, "
            f"{layout.n}) with {layout.groups} scale groups of {layout.group} (block_k="
            f"{bk}): a step must be K or a multiple of {multiple}"
            f" dividing K, and hold whole groups of a multiple of {_SCALE_ROWS} rows or lie in "
            "one group. Use a group of 128 or more, or multiply `q.dequantize()` with a float "
            "matmul"
        )
    return TpuBlocks(bm, bn, bk)


def _scale_view(values: jax.Array, layout: Layout, blocks: TpuBlocks) -> jax.Array:
    """scale or zero point [G, N] -> [P, G / r, r, N / P]: P column parities, r rows a step."""
    parities = _parities(layout)
    rows = max(1, blocks.k // layout.group)
    if parities == 2:
        values = values.reshape(layout.groups, layout.n // 2, 2).transpose(2, 0, 1)
    else:
        values = values[None]
    return values.reshape(parities, layout.groups // rows, rows, layout.n // parities)


def _kernel(x_ref, c_ref, s_ref, *refs, layout: Layout, rows: int, dtype):
    """One `[block_m, block_n]` output tile, one K step.

    Refs: x [bm, bk] (or [2, bm, bk/2]: even and odd columns, packed along K); codes
    [bk, bn/2] (packed along N), [bk/2, bn] (along K) or [bk, bn] (int8); scale and zero
    point [P, r, bn/P]; out [P, bm, bn/P] (packed along N) or [bm, bn]; accumulator
    [P, bm, bn/P] float32.
    """
    z_ref = refs[0] if layout.zero else None
    o_ref, acc_ref = refs[-2], refs[-1]

    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def weights(codes, parity: int):
        """Codes [t, c] -> dequantized [t, c] in `dtype`, with this parity's scales."""
        values = decode_codes(codes, layout.kind, exponent_trick=False)
        scale = s_ref[parity].astype(jnp.float32)  # [r, c]
        zero = None if z_ref is None else z_ref[parity].astype(jnp.float32)
        if rows > 1:  # several groups in this step: [r, group rows, c]
            t, c = values.shape
            values = values.reshape(rows, t // rows, c)
            scale, zero = scale[:, None, :], None if zero is None else zero[:, None, :]
        if zero is not None:
            values = values - zero
        return (values * scale).reshape(codes.shape).astype(dtype)

    def dot(x, w):
        return jax.lax.dot(x.astype(dtype), w, preferred_element_type=jnp.float32)

    codes = c_ref[...].astype(jnp.int32)
    if layout.packed == "n":
        x = x_ref[...]
        acc_ref[0] += dot(x, weights(codes & 15, 0))
        acc_ref[1] += dot(x, weights(codes >> 4, 1))
    elif layout.packed == "k":  # byte j holds rows 2j (low nibble) and 2j+1 (high nibble)
        low, high = weights(codes & 15, 0), weights(codes >> 4, 0)
        acc_ref[0] += dot(x_ref[0], low) + dot(x_ref[1], high)
    else:
        acc_ref[0] += dot(x_ref[...], weights(codes, 0))

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        if layout.packed == "n":
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)
        else:
            o_ref[...] = acc_ref[0].astype(o_ref.dtype)


def forward(
    x: jax.Array,
    q: QArray,
    layout: Layout,
    blocks: TpuBlocks,
    out_dtype: Any,
    interpret: bool | pltpu.InterpretParams,
) -> jax.Array:
    """x [M, K] (bfloat16 or float32) -> [M, N] `out_dtype` through the TPU body.

    `interpret`: False compiles for TPU; True or `pltpu.InterpretParams(...)` runs the body in
    the Pallas TPU interpreter (any host).
    """
    m = x.shape[0]
    bm, bn, bk = blocks.m, blocks.n, blocks.k
    m_pad = -(-m // bm) * bm
    if m_pad != m:
        x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    dtype = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    parities = _parities(layout)
    width, rows = bn // parities, max(1, bk // layout.group)
    codes, scale, *zero = weight_operands(q, layout)
    scales = [_scale_view(v, layout, blocks) for v in (scale, *zero)]
    # Steps a scale row lasts (1 when a step holds whole groups); `lax.div`, not `//`, whose
    # floor rounding of signed integers Mosaic lowers only for a known TPU generation.
    steps_a_row = max(1, layout.group * rows // bk)
    step_row = lambda k: jax.lax.div(k, steps_a_row)
    scale_spec = pl.BlockSpec(
        (parities, pl.squeezed, rows, width), lambda i, j, k: (0, step_row(k), 0, j)
    )
    if layout.packed == "k":
        x = jnp.stack([x[:, 0::2], x[:, 1::2]])  # [2, M, K/2]
        x_spec = pl.BlockSpec((2, bm, bk // 2), lambda i, j, k: (0, i, k))
        code_spec = pl.BlockSpec((bk // 2, bn), lambda i, j, k: (k, j))
    else:
        x_spec = pl.BlockSpec((bm, bk), lambda i, j, k: (i, k))
        code_spec = pl.BlockSpec((bk, width), lambda i, j, k: (k, j))
    if layout.packed == "n":
        out_shape = (2, m_pad, layout.n // 2)
        out_spec = pl.BlockSpec((2, bm, width), lambda i, j, k: (0, i, j))
    else:
        out_shape = (m_pad, layout.n)
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, k: (i, j))
    params = interpret
    if interpret is True:
        params = pltpu.InterpretParams()
    y = pl.pallas_call(
        functools.partial(_kernel, layout=layout, rows=rows, dtype=dtype),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(m_pad // bm, layout.n // bn, layout.k // bk),
            in_specs=[x_spec, code_spec, *[scale_spec] * len(scales)],
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((parities, bm, width), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=params or False,
        name=f"lowbit_{layout.kind}_matmul_tpu",
    )(x, codes, *scales)
    if layout.packed == "n":  # [2, M, N/2] -> [M, N], parity 0 in the even columns
        y = y.transpose(1, 2, 0).reshape(m_pad, layout.n)
    return y[:m]
