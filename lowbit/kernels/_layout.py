"""Prepared (packed) weight layouts read by the CPU kernels, and their inverse.

All layouts split the N output columns into P = ceil(N / 16) panels of 16 columns (N padded
with zero columns) so that one 512-bit vector (or two 256-bit ones) holds one row of a panel,
and each panel is one contiguous byte stream in the order the inner loop reads it.

Weight-only kinds (`data`: uint8 `[P, G * group_bytes]`): each panel is G groups of

    [16 x f32 scale][16 x f32 zero point][gs/2 pair rows of PB bytes]

- gs is the storage group size: the user's group size, or for per-channel weights a chunk
  (`storage_group`: an even divisor of K in [64, 256] if any, else min(256, K rounded up to
  even)) whose header repeats the channel scale. K is padded
  with zero codes to Kp = G * gs (the kernels zero-pad activations to match).
- 4-bit kinds (PB = 16): byte j of pair row t holds column j, low nibble k = 2t, high
  nibble k = 2t + 1. int4 codes are stored offset-binary (code ^ 8) with zero point 8, so
  signed and asymmetric 4-bit share one unpack; nf4 stores indices and fp4 E2M1 bit
  patterns (both decoded by a 16-entry table), zero point 0.
- 8-bit kinds (PB = 32): 16 bytes for k = 2t (one per column) then 16 for k = 2t + 1;
  int8 as two's complement, fp8 as raw e4m3fn bits. Zero point 0. (The kernels decode fp8
  by moving bits into a float16, so the e4m3fn NaN codes read as +-480 instead of NaN;
  quantizers never produce them.)

w4a8 (`data`: uint8 `[P, G * (128 + 8 gs)]`): per group a header of 16 f32 scales and 16
int32 column sums of the group's int4 codes, then gs/8 rows of 64 bytes; byte 4 j + i of row
t holds column j, low nibble k = 8 t + i, high nibble k = 8 t + 4 + i (offset-binary, code ^ 8),
so one row unpacks into two k-quads of the w8a8 layout below. Per channel, gs is a chunk as for
weight-only kinds (a multiple of 8).

w8a8 (`data`: int8 `[P, KQ * 64]`, KQ = ceil(K / 4)): panel p is `[KQ][16][4]`, the four
k-consecutive codes of a column adjacent, as a u8 x s8 dot-product instruction reads them.
`colsum` (int32 `[16 P]`) holds sum_k w[k, n]: the kernels feed activations as q + 128
(unsigned) and subtract 128 * colsum. `scale` is the per-channel float32 `[N]`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from lowbit.kernels._kinds import KERNEL_KINDS, KINDS
from lowbit.kernels._kinds import KIND_IDS as KIND_IDS  # older import path

PANEL = 16
HEADER_BYTES = 128
PER_CHANNEL_CHUNK = 256
# Group sizes must be multiples of this (default 2): w4a8 unpacks rows of 8 k at a time.
_GROUP_MULTIPLE = {"w4a8": 8}
# Largest K for which u8 x s8 int32 accumulation cannot overflow (255 * 128 * K < 2**31).
W8A8_MAX_K = 65536


@dataclasses.dataclass(frozen=True)
class PreparedWeight:
    """A weight packed for the CPU kernels (a pytree: arrays are leaves, the rest static).

    kind: one of "int8", "int4", "uint4", "nf4", "fp4", "fp8", "w8a8", "w4a8".
    k, n: logical weight shape [K, N]. group_size: logical group size along K, None for
    per-channel. storage_group: group size of the packed stream (see module docstring).
    data: packed codes (uint8 [P, bytes] weight-only, int8 [P, KQ * 64] w8a8).
    scale: float32 [N] (w8a8 only). colsum: int32 [16 P] (w8a8 only).
    """

    kind: str
    k: int
    n: int
    group_size: int | None
    storage_group: int
    data: jax.Array
    scale: jax.Array | None = None
    colsum: jax.Array | None = None


jax.tree_util.register_dataclass(
    PreparedWeight,
    data_fields=["data", "scale", "colsum"],
    meta_fields=["kind", "k", "n", "group_size", "storage_group"],
)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def pair_bytes(kind: str) -> int:
    """Bytes per pair row of a weight-only panel (16: 4-bit codes, 32: 8-bit codes)."""
    return KERNEL_KINDS[kind].pair_bytes


def storage_group(kind: str, k: int, group_size: int | None) -> int:
    """Group size of the packed stream (even; a per-channel weight is cut into chunks).

    Per channel, the chunk is the largest even divisor of K in [64, 256] when there is one, so
    K needs no zero padding (K = 576 would otherwise be padded to 768, a third more work);
    else min(256, K rounded up to even).
    """
    if group_size is not None:
        return group_size
    step = _GROUP_MULTIPLE.get(kind, 2)
    for chunk in range(PER_CHANNEL_CHUNK, 63, -step):
        if k % chunk == 0:
            return chunk
    return min(PER_CHANNEL_CHUNK, _round_up(max(k, 1), step))


def _check_2d(name: str, a, shape: tuple[int, int] | None = None) -> None:
    if getattr(a, "ndim", None) != 2:
        raise ValueError(f"{name} must be a 2-D array, got shape {getattr(a, 'shape', None)}")
    if shape is not None and tuple(a.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(a.shape)}; expected {shape}")


def _check_group_size(kind: str, k: int, group_size: int | None) -> None:
    if group_size is None:
        return
    if kind == "w8a8":
        raise ValueError(f"group_size={group_size} given for kind={kind!r}; it is per-channel only")
    step = _GROUP_MULTIPLE.get(kind, 2)
    if not isinstance(group_size, int | np.integer) or group_size < step or group_size % step:
        raise ValueError(
            f"group_size={group_size!r} for kind={kind!r} must be a positive multiple of {step}"
            " (or None)"
        )


def pack(
    kind: str,
    codes: jax.Array,
    scale: ArrayLike,
    zero_point: ArrayLike | None = None,
    group_size: int | None = None,
) -> PreparedWeight:
    """Packs a logical weight for the kernels.

    kind: "int8" | "int4" | "uint4" | "nf4" | "fp4" | "fp8" (weight-only), "w8a8" or "w4a8".
    codes: [K, N] (int8 for int8/w8a8; uint8 0..15 for 4-bit kinds, w4a8 as int4 two's-
      complement nibbles; float8_e4m3fn for fp8).
    scale: [G, N] float32 with G = ceil(K / group_size), or [1, N] per channel.
    zero_point: [G, N] float32 in code units, uint4 only (w = (q - zp) * scale).
    group_size: along K (even; a multiple of 8 for w4a8), None for per-channel; 4-bit kinds.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not supported; expected one of {KINDS}")
    _check_2d("codes", codes)
    k, n = (int(d) for d in codes.shape)
    want = KERNEL_KINDS[kind].code_dtype
    if jnp.dtype(codes.dtype) != jnp.dtype(want):
        raise TypeError(
            f"codes for kind={kind!r} must be {jnp.dtype(want).name}, got {codes.dtype}"
        )
    _check_group_size(kind, k, group_size)
    groups = 1 if group_size is None else -(-k // group_size)
    scale = jnp.asarray(scale)
    if kind == "w8a8" and scale.ndim == 1:
        scale = scale.reshape(1, -1)
    _check_2d("scale", scale, (groups, n))
    if KERNEL_KINDS[kind].zero_point == "per_group":
        if zero_point is None:
            raise ValueError(f"zero_point is required for kind={kind!r}")
        _check_2d("zero_point", jnp.asarray(zero_point), (groups, n))
    elif zero_point is not None:
        raise ValueError(f"zero_point is only accepted for kind='uint4', not {kind!r}")
    if kind == "w8a8":
        return _prepare_w8a8(codes, scale.astype(jnp.float32))
    group_size = None if group_size is None else int(group_size)
    if kind == "w4a8":
        return _prepare_w4a8(codes, scale.astype(jnp.float32), group_size)
    return _prepare_weight_only(kind, codes, scale.astype(jnp.float32), zero_point, group_size)


@jax.jit
def _prepare_w8a8(codes: jax.Array, scale: jax.Array) -> PreparedWeight:
    k, n = codes.shape
    kq, p = -(-k // 4), -(-n // PANEL)
    padded = jnp.pad(codes, ((0, 4 * kq - k), (0, PANEL * p - n)))
    data = padded.reshape(kq, 4, p, PANEL).transpose(2, 0, 3, 1).reshape(p, kq * 64)
    colsum = jnp.sum(padded.astype(jnp.int32), axis=0)
    return PreparedWeight("w8a8", k, n, None, 4, data, scale.reshape(n), colsum)


@functools.partial(jax.jit, static_argnames=("group_size",))
def _prepare_w4a8(codes: jax.Array, scale: jax.Array, group_size: int | None) -> PreparedWeight:
    k, n = codes.shape
    gs = storage_group("w4a8", k, group_size)
    groups = -(-k // gs)
    kp, p = groups * gs, -(-n // PANEL)
    u = jnp.pad((codes & 15) ^ 8, ((0, kp - k), (0, p * PANEL - n)), constant_values=8)
    # k = g * gs + 8 t + 4 h + i; byte (t, column j, i) = u[h = 0] | u[h = 1] << 4.
    u6 = u.reshape(groups, gs // 8, 2, 4, p, PANEL)
    body = u6[:, :, 0] | (u6[:, :, 1] << 4)  # [G, gs/8, 4, P, 16]
    body = body.transpose(3, 0, 1, 4, 2).reshape(p, groups, gs * 8)
    signed = u.astype(jnp.int32) - 8
    colsum = signed.reshape(groups, gs, p * PANEL).sum(axis=1)  # [G, 16 P]
    s = scale if group_size is not None else jnp.broadcast_to(scale[:1], (groups, n))
    s = jnp.pad(s, ((0, 0), (0, p * PANEL - n)))

    def header(a: jax.Array) -> jax.Array:
        a = a.reshape(groups, p, PANEL).transpose(1, 0, 2)
        return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(p, groups, 4 * PANEL)

    data = jnp.concatenate([header(s), header(colsum), body], axis=-1).reshape(p, -1)
    return PreparedWeight("w4a8", k, n, group_size, gs, data)


def _w4a8_to_logical(w: PreparedWeight) -> dict[str, jax.Array | None]:
    gs, p = w.storage_group, w.data.shape[0]
    groups = w.data.shape[1] // (HEADER_BYTES + gs * 8)
    blocks = w.data.reshape(p, groups, -1)
    raw = blocks[:, :, : 4 * PANEL].reshape(p, groups, PANEL, 4)
    scale = jax.lax.bitcast_convert_type(raw, jnp.float32).transpose(1, 0, 2)
    scale = scale.reshape(groups, p * PANEL)[:, : w.n]
    body = blocks[:, :, HEADER_BYTES:].reshape(p, groups, gs // 8, PANEL, 4)
    body = body.transpose(1, 2, 4, 0, 3)  # [G, gs/8, 4, P, 16]
    u = jnp.stack([body & 15, body >> 4], axis=2)  # [G, gs/8, 2, 4, P, 16]
    codes = (u.reshape(groups * gs, p * PANEL) ^ 8)[: w.k, : w.n]
    return {
        "codes": codes,
        "scale": scale if w.group_size is not None else scale[:1],
        "zero_point": None,
    }


@functools.partial(jax.jit, static_argnames=("kind", "group_size"))
def _prepare_weight_only(
    kind: str,
    codes: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    group_size: int | None,
) -> PreparedWeight:
    k, n = codes.shape
    gs = storage_group(kind, k, group_size)
    groups = -(-k // gs)
    kp, p = groups * gs, -(-n // PANEL)
    np_ = p * PANEL

    info = KERNEL_KINDS[kind]
    if info.pair_bytes == 32:  # 8-bit codes, stored as their bytes
        c = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    elif info.zero_point == "fixed8":  # two's-complement nibbles -> offset binary
        c = (codes & 15) ^ 8
    else:
        c = codes & 15
    c = jnp.pad(c, ((0, kp - k), (0, np_ - n)))

    def per_group(a: jax.Array) -> jax.Array:
        a = a.astype(jnp.float32)
        if group_size is None:
            a = jnp.broadcast_to(a[:1], (groups, n))
        return jnp.pad(a, ((0, 0), (0, np_ - n)))

    s = per_group(scale)
    zero_point_kind = KERNEL_KINDS[kind].zero_point
    if zero_point_kind == "fixed8":
        zp = jnp.full_like(s, 8.0)
    elif zero_point_kind == "per_group":
        zp = per_group(jnp.asarray(zero_point))
    else:
        zp = jnp.zeros_like(s)

    if pair_bytes(kind) == 32:
        body = c.reshape(groups, gs // 2, 2, p, PANEL).transpose(3, 0, 1, 2, 4)
    else:
        nib = c[0::2] | (c[1::2] << 4)
        body = nib.reshape(groups, gs // 2, p, PANEL).transpose(2, 0, 1, 3)
    body = body.reshape(p, groups, -1)

    def header(a: jax.Array) -> jax.Array:
        a = a.reshape(groups, p, PANEL).transpose(1, 0, 2)
        return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(p, groups, 4 * PANEL)

    data = jnp.concatenate([header(s), header(zp), body], axis=-1).reshape(p, -1)
    return PreparedWeight(kind, k, n, group_size, gs, data)


@jax.jit
def prepared_to_logical(w: PreparedWeight) -> dict[str, jax.Array | None]:
    """Inverse of `pack`: {"codes": [K, N], "scale": [G, N], "zero_point": [G, N] | None}."""
    k, n = w.k, w.n
    if w.kind == "w4a8":
        return _w4a8_to_logical(w)
    if w.kind == "w8a8":
        p = w.data.shape[0]
        kq = w.data.shape[1] // 64
        codes = w.data.reshape(p, kq, PANEL, 4).transpose(1, 3, 0, 2).reshape(4 * kq, p * PANEL)
        return {"codes": codes[:k, :n], "scale": w.scale.reshape(1, n), "zero_point": None}

    gs = w.storage_group
    p = w.data.shape[0]
    groups = w.data.shape[1] // (HEADER_BYTES + gs // 2 * pair_bytes(w.kind))
    blocks = w.data.reshape(p, groups, -1)

    def header(offset: int) -> jax.Array:
        raw = blocks[:, :, offset : offset + 4 * PANEL].reshape(p, groups, PANEL, 4)
        vals = jax.lax.bitcast_convert_type(raw, jnp.float32)  # [P, G, 16]
        vals = vals.transpose(1, 0, 2).reshape(groups, p * PANEL)[:, :n]
        return vals if w.group_size is not None else vals[:1]

    body = blocks[:, :, HEADER_BYTES:]
    if pair_bytes(w.kind) == 32:
        c = body.reshape(p, groups, gs // 2, 2, PANEL).transpose(1, 2, 3, 0, 4)
        c = c.reshape(groups * gs, p * PANEL)[:k, :n]
        codes = jax.lax.bitcast_convert_type(c, KERNEL_KINDS[w.kind].code_dtype)
    else:
        nib = body.reshape(p, groups, gs // 2, PANEL).transpose(1, 2, 0, 3)
        nib = nib.reshape(groups * gs // 2, p * PANEL)
        c = jnp.stack([nib & 15, nib >> 4], axis=1).reshape(groups * gs, p * PANEL)[:k, :n]
        codes = c ^ 8 if KERNEL_KINDS[w.kind].zero_point == "fixed8" else c
    zp = header(4 * PANEL) if KERNEL_KINDS[w.kind].zero_point == "per_group" else None
    return {"codes": codes, "scale": header(0), "zero_point": zp}


@jax.jit
def prepared_columns(w: PreparedWeight, cols: jax.Array) -> dict[str, jax.Array | None]:
    """Columns `cols` of a prepared weight in logical form, reading only their panels.

    cols: [M] int in [0, N). Returns {"codes": [K, M], "scale": [G, M], "zero_point": [G, M] |
    None}, as `prepared_to_logical(w)` restricted to those columns (G = 1 per channel).
    """
    cols = jnp.asarray(cols, jnp.int32)
    panels, lane = cols // PANEL, cols % PANEL

    def one(data, lane, scale):
        panel = dataclasses.replace(w, n=PANEL, data=data[None], scale=scale, colsum=None)
        part = prepared_to_logical(panel)
        pick = lambda a: None if a is None else a[:, lane]
        return {k: pick(v) for k, v in part.items()}

    scale = None
    if w.kind == "w8a8":
        padded = jnp.pad(w.scale, (0, w.data.shape[0] * PANEL - w.n))
        scale = jax.vmap(lambda p: jax.lax.dynamic_slice(padded, (p * PANEL,), (PANEL,)))(panels)
    out = jax.vmap(one, in_axes=(0, 0, None if scale is None else 0), out_axes=1)(
        w.data[panels], lane, scale
    )
    return {k: None if v is None else v.reshape(v.shape[0], -1) for k, v in out.items()}
