"""The weight-only matmul's GEMV body on CUDA: a Triton kernel with no 16-element tiles.

`x [M, K] @ q [K, N]` for up to 16 rows. The dot body of `lowbit.kernels.pallas` pads M to
Triton's 16-row dot tile and needs K steps of 16 elements or more inside a scale group; here
each program multiplies its decoded `[block_k, block_n]` weight tile by each activation row
on the vector units and keeps one float32 accumulator of the tile's shape a row, summed over
K once at the end. M is padded to a power of two only, and a K step can be one row (group
sizes of 8, K = 24). Measured on an H200 it is slower than the dot body wherever both run
(each code costs a scale multiply and an FMA here, which the dot leaves to the tensor
cores), so `weight_only_matmul` runs it by default only where the dot body cannot tile.

The grid is (N blocks, K splits). A program streams `K / split_k` rows of its `block_n`
columns, `block_k` rows a step (within one scale group), so consecutive steps read
consecutive rows of codes: with nibbles packed along N a step reads `block_k` runs of
`block_n / 2` bytes. The weights are read as stored, exactly as the dot body reads them
(`_pallas_codes`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lowbit.kernels._pallas_codes import Layout, decode_codes


def _kernel(x_ref, c_ref, s_ref, *refs, layout: Layout, rows: int, bk: int, split: int):
    """One `[rows, block_n]` output tile over one K split.

    Refs: x [rows, K/S]; codes [K/S, bn] (int8), [K/S, bn/2] (packed along N) or
    [K/(2S), bn] (packed along K); scale and zero point [G/S, bn] or [1, bn]; out [rows, bn].
    Nibbles packed along N multiply into accumulators for the even and odd columns (scales
    read at stride 2), interleaved once at the end; packed along K, the low and high nibbles
    meet the even and odd activation columns.
    """
    z_ref = refs[0] if layout.zero else None
    o_ref = refs[-1]
    bn = o_ref.shape[1]
    steps = layout.k // split // bk
    grouped = layout.groups > 1
    halves = layout.packed == "n"
    width = bn // 2 if halves else bn
    tile_rows = bk // 2 if layout.packed == "k" else bk

    def scaled(codes, row, half):
        """codes [tile_rows, width] (int32) -> values times scales, float32."""
        cols = slice(None) if half is None else pl.ds(half, width, stride=2)
        values = decode_codes(codes, layout.kind)
        if z_ref is not None:
            values = values - z_ref[pl.ds(row, 1), cols].astype(jnp.float32)
        return values * s_ref[pl.ds(row, 1), cols].astype(jnp.float32)

    def column(m, start, stride=1):
        """Activations of row m, `tile_rows` of them from K index `start`, as [tile_rows, 1]."""
        x = x_ref[pl.ds(m, 1), pl.ds(start, tile_rows, stride=stride)]
        return x.astype(jnp.float32).T

    def step(t, accs):
        row = (t * bk) // layout.group if grouped else 0
        if layout.packed == "k":
            # Byte j holds rows 2j (low nibble) and 2j + 1 (high nibble).
            packed = c_ref[pl.ds(t * tile_rows, tile_rows), :].astype(jnp.int32)
            low, high = scaled(packed & 15, row, None), scaled(packed >> 4, row, None)
            return tuple(
                acc + low * column(m, t * bk, 2) + high * column(m, t * bk + 1, 2)
                for m, acc in enumerate(accs)
            )
        codes = c_ref[pl.ds(t * bk, bk), :].astype(jnp.int32)
        if not halves:
            w = scaled(codes, row, None)
            return tuple(acc + w * column(m, t * bk) for m, acc in enumerate(accs))
        even, odd = scaled(codes & 15, row, 0), scaled(codes >> 4, row, 1)
        out = []
        for m in range(rows):
            x = column(m, t * bk)
            out += [accs[2 * m] + even * x, accs[2 * m + 1] + odd * x]
        return tuple(out)

    zeros = jnp.zeros((tile_rows, width), jnp.float32)
    n_accs = rows * (2 if halves else 1)
    accs = jax.lax.fori_loop(0, steps, step, (zeros,) * n_accs)
    for m in range(rows):
        if halves:
            even = jnp.sum(accs[2 * m], axis=0, keepdims=True)
            odd = jnp.sum(accs[2 * m + 1], axis=0, keepdims=True)
            out = jnp.stack([even, odd], axis=-1).reshape(1, bn)
        else:
            out = jnp.sum(accs[m], axis=0, keepdims=True)
        o_ref[pl.ds(m, 1), :] = out.astype(o_ref.dtype)


def forward(
    x: jax.Array,
    operands: list[jax.Array],
    layout: Layout,
    *,
    block_n: int,
    block_k: int,
    split_k: int,
    out_dtype: Any,
    compiler_params: Any,
    interpret: bool,
) -> jax.Array:
    """x [M, K] (M a power of two) times the weight `operands` (codes, scale[, zero point])
    of `layout` -> [M, N] `out_dtype`; partial sums of a K split added in float32 after."""
    rows = x.shape[0]
    k_split = layout.k // split_k
    code_block = {
        None: (k_split, block_n),
        "n": (k_split, block_n // 2),
        "k": (k_split // 2, block_n),
    }[layout.packed]
    scale_rows = layout.groups // split_k if layout.groups > 1 else 1
    scale_index = (lambda j, s: (s, j)) if layout.groups > 1 else (lambda j, s: (0, j))
    in_specs = [
        pl.BlockSpec((rows, k_split), lambda j, s: (0, s)),
        pl.BlockSpec(code_block, lambda j, s: (s, j)),
        pl.BlockSpec((scale_rows, block_n), scale_index),
    ]
    if layout.zero:
        in_specs.append(pl.BlockSpec((scale_rows, block_n), scale_index))
    n_blocks = layout.n // block_n
    # Split partial sums sit side by side along N: [M, S * N], block (0, s * N/bn + j).
    out_spec = pl.BlockSpec((rows, block_n), lambda j, s: (0, s * n_blocks + j))
    kernel = functools.partial(_kernel, layout=layout, rows=rows, bk=block_k, split=split_k)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(
            (rows, split_k * layout.n), jnp.float32 if split_k > 1 else out_dtype
        ),
        grid=(n_blocks, split_k),
        in_specs=in_specs,
        out_specs=out_spec,
        interpret=interpret,
        compiler_params=compiler_params,
        name=f"lowbit_{layout.kind}_gemv",
    )(x, *operands)
    if split_k > 1:
        y = y.reshape(rows, split_k, layout.n).sum(axis=1)
    return y.astype(out_dtype)
