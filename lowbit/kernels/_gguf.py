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

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K weights can also be held as tiles
(`gguf_tile`): the blocks of 8 rows interleaved, `cpu/gguf_tiles.h`, so that one register
multiplies 8 rows with one activation word. The tile kernels run the int8-activation product;
the other paths read a tiled weight's rows back a group of 8 at a time. `gguf_untile` gives
the block rows back byte for byte.

On a lowering platform other than CPU (or without the compiled module) the pure-JAX reference
runs: the blocks decoded by their `lowbit.gguf` block type, then a float product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.gguf import block_type
from lowbit.kernels._kinds import GGUF_TYPE_IDS
from lowbit.kernels._ops import check_float, native_or_reference


def _row_bytes(ggml_type: str, k: int) -> int:
    t = block_type(ggml_type)
    if k % t.block_size:
        raise ValueError(f"K = {k} is not a whole number of {ggml_type} blocks ({t.block_size})")
    return k // t.block_size * t.type_size


def _check_rows(rows: jax.Array, ggml_type: str, k: int, tiled: bool = False) -> int:
    """N of block rows (or of tiles, `tiled`) checked against the type and K."""
    if ggml_type not in GGUF_TYPE_IDS:
        raise ValueError(
            f"GGUF type {ggml_type!r} has no kernel; accepted: {', '.join(GGUF_TYPE_IDS)}"
        )
    if tiled:
        want = k // block_type(ggml_type).block_size * TILE_BYTES.get(ggml_type, 0)
        n = int(rows.shape[0]) * TILE_ROWS if rows.ndim == 2 else 0
        if not gguf_tileable(ggml_type, k, n) or rows.dtype != jnp.uint8 or rows.shape[1] != want:
            raise ValueError(
                f"tiled {ggml_type} weight must be uint8 [N / 8, {want}] for K = {k} (types "
                f"{', '.join(TILE_BYTES)}, K whole blocks), got {rows.dtype} {tuple(rows.shape)}"
            )
        return n
    want = _row_bytes(ggml_type, k)
    if rows.ndim != 2 or rows.dtype != jnp.uint8 or rows.shape[1] != want:
        raise ValueError(
            f"{ggml_type} weight rows must be uint8 [N, {want}] for K = {k}, got "
            f"{rows.dtype} {tuple(rows.shape)}"
        )
    return int(rows.shape[0])


# Bytes of one tile (8 rows of one block) of the types with a tiled layout.
TILE_BYTES = {
    **{"Q4_0": 144, "Q4_1": 160, "Q5_0": 176, "Q5_1": 192, "Q8_0": 272},
    **{"Q2_K": 672, "Q3_K": 912, "Q4_K": 1184, "Q5_K": 1440, "Q6_K": 1680},
}
TILE_ROWS = 8
# The types whose tiles are exactly their 8 rows' bytes, reordered: laid out over the rows.
TILES_OVER_ROWS = frozenset(
    name for name, size in TILE_BYTES.items() if size == TILE_ROWS * block_type(name).type_size
)


def gguf_tileable(ggml_type: str, k: int, n: int) -> bool:
    """Whether a ``[N, K]`` weight of `ggml_type` has a tiled layout (`gguf_tile`)."""
    if ggml_type not in TILE_BYTES:
        return False
    return k % block_type(ggml_type).block_size == 0 and n % TILE_ROWS == 0 and n > 0


def is_tiled(data: jax.Array, n: int) -> bool:
    """Whether GGUF weight bytes `data` of N = `n` outputs are tiles (``[N / 8, ...]``) rather
    than block rows (``[N, ...]``)."""
    return int(data.shape[0]) != n


def _q4k_scales(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 8 scales and 8 minimums ``[..., 8]`` of Q4_K's 12 packed bytes ``[..., 12]``."""
    lo6 = lambda v: v & 63
    scales = [lo6(s[..., j]) for j in range(4)] + [
        (s[..., j + 4] & 15) | ((s[..., j - 4] >> 6) << 4) for j in range(4, 8)
    ]
    mins = [lo6(s[..., j + 4]) for j in range(4)] + [
        (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4) for j in range(4, 8)
    ]
    return jnp.stack(scales, -1), jnp.stack(mins, -1)


def _q4k_pack(sc: jax.Array, m: jax.Array) -> jax.Array:
    """The 12 packed bytes ``[..., 12]`` of Q4_K's 8 scales and minimums (the inverse of
    `_q4k_scales`)."""
    first = [(sc[..., j] & 63) | ((sc[..., j + 4] >> 4) << 6) for j in range(4)]
    second = [(m[..., j] & 63) | ((m[..., j + 4] >> 4) << 6) for j in range(4)]
    third = [(sc[..., j + 4] & 15) | ((m[..., j + 4] & 15) << 4) for j in range(4)]
    return jnp.stack(first + second + third, -1).astype(jnp.uint8)


def _q3k_scales(s: jax.Array) -> jax.Array:
    """The 16 6-bit scales ``[..., 16]`` (stored + 32) of Q3_K's 12 packed bytes ``[..., 12]``."""
    low = [s[..., i] & 15 for i in range(8)] + [s[..., i] >> 4 for i in range(8)]
    return jnp.stack(
        [low[i] | (((s[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4) for i in range(16)], -1
    )


def _q3k_pack(sc: jax.Array) -> jax.Array:
    """The 12 packed bytes ``[..., 12]`` of Q3_K's 16 scales (the inverse of `_q3k_scales`)."""
    low = [(sc[..., i] & 15) | ((sc[..., i + 8] & 15) << 4) for i in range(8)]
    high = [
        (sc[..., j] >> 4)
        | ((sc[..., j + 4] >> 4) << 2)
        | ((sc[..., j + 8] >> 4) << 4)
        | ((sc[..., j + 12] >> 4) << 6)
        for j in range(4)
    ]
    return jnp.stack(low + high, -1).astype(jnp.uint8)


def _interleave(a: jax.Array, width: int) -> jax.Array:
    """[G, U, 8, B] -> [G, U, B * 8]: the 8 rows' `width`-byte pieces side by side, piece by
    piece (4-byte code chunks; 2-byte scale pairs)."""
    g, u, r, b = a.shape
    return a.reshape(g, u, r, b // width, width).transpose(0, 1, 3, 2, 4).reshape(g, u, -1)


def _deinterleave(a: jax.Array, width: int, b: int) -> jax.Array:
    """`_interleave`'s inverse: [G, U, b * 8] -> [G, U, 8, b]."""
    g, u = a.shape[:2]
    pieces = a.reshape(g, u, b // width, TILE_ROWS, width).transpose(0, 1, 3, 2, 4)
    return pieces.reshape(g, u, TILE_ROWS, b)


# The fields of a 32-element block in order, (first byte, width): d, then m (Q4_1, Q5_1), qh
# (Q5_0, Q5_1), and the code bytes last (16 of nibbles, Q8_0's 32; those interleaved in
# 4-byte pieces in a tile).
_FIELDS32 = {
    "Q4_0": ((0, 2), (2, 16)),
    "Q4_1": ((0, 2), (2, 2), (4, 16)),
    "Q5_0": ((0, 2), (2, 4), (6, 16)),
    "Q5_1": ((0, 2), (2, 2), (4, 4), (8, 16)),
    "Q8_0": ((0, 2), (2, 32)),
}


def q4_0_rows(codes: jax.Array, d: jax.Array) -> jax.Array:
    """Q4_0 block rows ``uint8 [N, K / 32 * 18]`` of int4 codes ``uint8 [N, K]`` (4-bit two's
    complement, lowbit's int4 storage) and float16 scales ``[N, K / 32]``: the same values
    (Q4_0's ``d (q - 8)`` with ``q = code ^ 8``)."""
    q = (codes.astype(jnp.uint8) & 15) ^ 8
    return block_type("Q4_0").join(d.astype(jnp.float32), None, q)


def q4_0_fields(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`q4_0_rows`'s inverse: int4 codes ``uint8 [N, K]`` (two's complement) and float16
    scales ``[N, K / 32]`` of Q4_0 block rows ``uint8 [N, K / 32 * 18]``."""
    d, _, q = block_type("Q4_0").split(rows)
    return q ^ 8, d.astype(jnp.float16)


# One program per shape: as eager ops, laying out a 1.5B model's tiles took seconds of dispatch.
@functools.partial(jax.jit, static_argnums=(1,), static_argnames=("over_rows",))
def gguf_tile(rows: jax.Array, ggml_type: str, *, over_rows: bool = False) -> jax.Array:
    """Block rows ``uint8 [N, row_bytes]`` of a weight of a type in `TILE_BYTES` as tiles
    ``uint8 [N / 8, blocks * TILE_BYTES[type]]`` (layout: `cpu/gguf_tiles.h`).

    One kernel call where the program is lowered for CPU (XLA's gathers of a few bytes each
    ran at 0.2-0.6 GB/s); the pure-JAX reference, the same bytes, elsewhere.

    `over_rows`: for a type whose tiles are the size of its rows (`TILES_OVER_ROWS`), the
    kernel's result is its operand's buffer: in a program that donates `rows`, the tiles are
    written over them and the weight is never held twice. Other types ignore it. Without the
    donation XLA copies the rows first, so only a caller that gives the rows up asks for it.
    """
    t = block_type(ggml_type)
    n, row_bytes = rows.shape if rows.ndim == 2 else (0, 0)
    k = row_bytes // t.type_size * t.block_size
    if not gguf_tileable(ggml_type, k, n) or rows.dtype != jnp.uint8 or row_bytes % t.type_size:
        raise ValueError(
            f"{ggml_type} {rows.dtype} {tuple(rows.shape)} has no tiled layout (uint8 block "
            f"rows [N, row_bytes] of types {', '.join(TILE_BYTES)}, N % 8)"
        )

    def native():
        tiles = (n // TILE_ROWS, k // t.block_size * TILE_BYTES[ggml_type])
        # Written over: the result takes the rows' shape, so that XLA aliases the two with no
        # copy (a reshaped operand made it copy the rows there and back).
        over = over_rows and ggml_type in TILES_OVER_ROWS
        call = jax.ffi.ffi_call(
            "lowbit_gguf_tile",
            jax.ShapeDtypeStruct(rows.shape if over else tiles, jnp.uint8),
            vmap_method="sequential",
            input_output_aliases={0: 0} if over else None,
        )
        return call(rows, type=np.int64(GGUF_TYPE_IDS[ggml_type])).reshape(tiles)

    return native_or_reference(native, lambda: tile_reference(rows, ggml_type))


def tile_reference(rows: jax.Array, ggml_type: str) -> jax.Array:
    """`gguf_tile` in pure JAX (its reference): the tiles' fields gathered from the block rows
    by reshapes, slices and transposes."""
    t = block_type(ggml_type)
    n = rows.shape[0]
    k = rows.shape[1] // t.type_size * t.block_size
    units = k // t.block_size
    b = rows.reshape(n // TILE_ROWS, TILE_ROWS, units, t.type_size).transpose(0, 2, 1, 3)
    g = b.shape[0]
    half = lambda a: a.reshape(g, units, -1)  # [G, U, 8, w] -> row r's w bytes side by side
    if t.block_size == 32:
        fields = _FIELDS32[ggml_type]
        parts = [half(b[..., i : i + w]) for i, w in fields[:-1]]
        parts.append(_interleave(b[..., fields[-1][0] :], 4))
    elif ggml_type == "Q2_K":  # the block's fields, d and dmin first
        parts = [
            half(b[..., 80:82]),
            half(b[..., 82:84]),
            _interleave(b[..., 0:16], 2),
            _interleave(b[..., 16:80], 4),
        ]
    elif ggml_type == "Q3_K":
        scale = (_q3k_scales(b[..., 96:108]) - 32).astype(jnp.uint8)  # int8 bytes
        parts = [
            half(b[..., 108:110]),
            _interleave(scale, 2),
            _interleave(b[..., 32:96], 4),
            _interleave(b[..., 0:32], 4),
        ]
    elif ggml_type in ("Q4_K", "Q5_K"):
        sc, m = _q4k_scales(b[..., 4:16])  # [G, U, 8 rows, 8 sub-blocks]
        qs = 48 if ggml_type == "Q5_K" else 16
        parts = [
            half(b[..., 0:2]),
            half(b[..., 2:4]),
            sc.transpose(0, 1, 3, 2).reshape(g, units, -1),
            _interleave(m, 2),
            _interleave(b[..., qs : qs + 128], 4),
        ]
        if ggml_type == "Q5_K":  # its qh after Q4_K's tile
            parts.append(_interleave(b[..., 16:48], 4))
    else:
        parts = [
            half(b[..., 208:210]),
            _interleave(b[..., 192:208], 2),
            _interleave(b[..., 0:128], 4),
            _interleave(b[..., 128:192], 4),
        ]
    return jnp.concatenate(parts, axis=-1).astype(jnp.uint8).reshape(g, -1)


@functools.partial(jax.jit, static_argnums=(1, 2))
def gguf_untile(tiles: jax.Array, ggml_type: str, k: int) -> jax.Array:
    """`gguf_tile`'s inverse: the block rows ``uint8 [N, row_bytes]``, byte for byte."""
    units = k // block_type(ggml_type).block_size
    g = tiles.shape[0]
    a = tiles.reshape(g, units, TILE_BYTES[ggml_type])
    two = lambda x: x.reshape(g, units, TILE_ROWS, 2)
    if ggml_type in _FIELDS32:
        # The tile holds the block's fields in their order, each 8 times as wide.
        fields, parts = _FIELDS32[ggml_type], []
        for i, w in fields[:-1]:
            field = a[..., TILE_ROWS * i : TILE_ROWS * (i + w)]
            parts.append(field.reshape(g, units, TILE_ROWS, w))
        parts.append(_deinterleave(a[..., TILE_ROWS * fields[-1][0] :], 4, fields[-1][1]))
        b = jnp.concatenate(parts, axis=-1)
    elif ggml_type == "Q2_K":
        b = jnp.concatenate(
            [
                _deinterleave(a[..., 32:160], 2, 16),
                _deinterleave(a[..., 160:], 4, 64),
                two(a[..., 0:16]),
                two(a[..., 16:32]),
            ],
            axis=-1,
        )
    elif ggml_type == "Q3_K":
        scale = (_deinterleave(a[..., 16:144], 2, 16) + 32) & 63
        b = jnp.concatenate(
            [
                _deinterleave(a[..., 656:], 4, 32),
                _deinterleave(a[..., 144:656], 4, 64),
                _q3k_pack(scale),
                two(a[..., 0:16]),
            ],
            axis=-1,
        )
    elif ggml_type in ("Q4_K", "Q5_K"):
        sc = a[..., 32:96].reshape(g, units, 8, TILE_ROWS).transpose(0, 1, 3, 2)
        m = _deinterleave(a[..., 96:160], 2, 8)
        qh = [_deinterleave(a[..., 1184:], 4, 32)] if ggml_type == "Q5_K" else []
        b = jnp.concatenate(
            [
                two(a[..., 0:16]),
                two(a[..., 16:32]),
                _q4k_pack(sc, m),
                *qh,
                _deinterleave(a[..., 160:1184], 4, 128),
            ],
            axis=-1,
        )
    else:
        b = jnp.concatenate(
            [
                _deinterleave(a[..., 144:1168], 4, 128),
                _deinterleave(a[..., 1168:], 4, 64),
                _deinterleave(a[..., 16:144], 2, 16),
                two(a[..., 0:16]),
            ],
            axis=-1,
        )
    return b.transpose(0, 2, 1, 3).reshape(g * TILE_ROWS, -1)


def _q8_blocks(x: jax.Array) -> jax.Array:
    """x [M, K] float32 rounded as the kernel's int8 activations (blocks of 32), as floats."""
    m, k = x.shape
    pad = -k % 32
    blocks = jnp.pad(x, ((0, 0), (0, pad))).reshape(m, -1, 32)
    d = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / 127
    q = jnp.clip(jnp.round(blocks / jnp.where(d > 0, d, 1)), -127, 127)
    return (q * d).reshape(m, -1)[:, :k]


def gguf_dequantize(rows: jax.Array, ggml_type: str, k: int, *, tiled: bool = False) -> jax.Array:
    """The float32 weight ``[N, K]`` of GGUF block rows, equal to llama.cpp's dequantization.

    Args:
      rows: uint8 ``[N, row_bytes]``, row n the blocks of output n (or tiles
        ``[N / 8, ...]`` from `gguf_tile` when `tiled`).
      ggml_type: e.g. ``"Q4_K"`` (one of `GGUF_TYPE_IDS`).
      k: elements a row.
    """
    n = _check_rows(rows, ggml_type, k, tiled)

    def reference():
        return block_type(ggml_type).decode(gguf_untile(rows, ggml_type, k) if tiled else rows)

    def native():
        call = jax.ffi.ffi_call(
            "lowbit_gguf_dequantize",
            jax.ShapeDtypeStruct((n, k), jnp.float32),
            vmap_method="sequential",
        )
        return call(
            rows,
            type=np.int64(GGUF_TYPE_IDS[ggml_type]),
            k=np.int64(k),
            n=np.int64(n),
            tiled=np.int64(tiled),
        )

    return native_or_reference(native, reference)


def gguf_linear(
    x: jax.Array,
    rows: jax.Array,
    ggml_type: str,
    *,
    out_dtype=None,
    int8_activations: bool = False,
    tiled: bool = False,
) -> jax.Array:
    """``x @ W.T`` for W the GGUF block rows `rows` (``[N, K]`` logically).

    Args:
      x: [..., K] float32 | bfloat16.
      rows: uint8 ``[N, row_bytes]``, or tiles ``[N / 8, ...]`` from `gguf_tile` when
        `tiled`.
      ggml_type: one of `GGUF_TYPE_IDS`.
      out_dtype: float32 | bfloat16, default x's.
      int8_activations: multiply on int8 activations in blocks of 32 (see the module
        docstring) instead of float ones.
      tiled: `rows` are tiles (`gguf_tile`).
    Returns:
      [..., N] in `out_dtype`.
    """
    x = jnp.asarray(x)
    k = int(x.shape[-1])
    n = _check_rows(rows, ggml_type, k, tiled)
    check_float("x", x.dtype)
    out = check_float("out_dtype", out_dtype or x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]

    def reference():
        xf = x2.astype(jnp.float32)
        if int8_activations:
            xf = _q8_blocks(xf)
        w = block_type(ggml_type).decode(gguf_untile(rows, ggml_type, k) if tiled else rows)
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
            tiled=np.int64(tiled),
        )

    y = reference() if m == 0 else native_or_reference(native, reference)
    return y.reshape(*lead, n)
