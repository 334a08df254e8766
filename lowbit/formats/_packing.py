"""Dense bit packing of sub-byte codes into uint8 storage.

Codes of `bits` bits are laid out little-endian as one bit stream along an axis: code `i` of a
group occupies stream bits `[i * bits, (i + 1) * bits)`, and byte `j` holds stream bits
`[8 j, 8 j + 8)`. A group is the smallest run of codes that fills whole bytes:

  bits:            1  2  3  4  5  6  7  8
  codes per group: 8  4  8  2  8  4  8  1
  bytes per group: 1  1  3  1  5  3  7  1

so 3-bit codes take 3 bytes per 8 values (3.0 bits/value) and nothing is wasted but the padding of
the last group. All shifts are static, so `pack` and `unpack` trace to a handful of elementwise
ops and are jit-able.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def group_shape(bits: int) -> tuple[int, int]:
    """(codes per group, bytes per group) for `bits`-bit codes."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    lcm = math.lcm(bits, 8)
    return lcm // bits, lcm // 8


def packed_length(n: int, bits: int) -> int:
    """Bytes needed to store `n` codes of `bits` bits (the last group zero-padded)."""
    per_group, bytes_per_group = group_shape(bits)
    return -(-n // per_group) * bytes_per_group


def pack(codes: jax.Array, bits: int, axis: int = -1) -> jax.Array:
    """Packs `bits`-bit codes along `axis`.

    Args:
      codes: [..., n, ...] unsigned integer codes in [0, 2**bits) (higher bits are dropped).
      bits: code width, 1..8.
      axis: the axis to pack along.
    Returns:
      [..., packed_length(n, bits), ...] uint8.
    """
    per_group, bytes_per_group = group_shape(bits)
    codes = jnp.moveaxis(jnp.asarray(codes), axis, -1).astype(jnp.uint32) & (2**bits - 1)
    n = codes.shape[-1]
    pad = -n % per_group
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    codes = codes.reshape(*codes.shape[:-1], -1, per_group)
    out = []
    for j in range(bytes_per_group):
        byte = jnp.zeros(codes.shape[:-1], jnp.uint32)
        for i in range(per_group):
            shift = i * bits - 8 * j
            if shift >= 8 or shift + bits <= 0:
                continue
            code = codes[..., i]
            byte = byte | (code << shift if shift >= 0 else code >> -shift)
        out.append(byte & 0xFF)
    packed = jnp.stack(out, axis=-1).reshape(*codes.shape[:-2], -1).astype(jnp.uint8)
    return jnp.moveaxis(packed, -1, axis)


def unpack(packed: jax.Array, bits: int, n: int, axis: int = -1) -> jax.Array:
    """Inverse of `pack`.

    Args:
      packed: [..., packed_length(n, bits), ...] uint8.
      bits: code width, 1..8.
      n: number of codes to recover along `axis`.
      axis: the packed axis.
    Returns:
      [..., n, ...] uint8 codes.
    Raises:
      ValueError: if `packed` has the wrong length along `axis` for `n` codes.
    """
    per_group, bytes_per_group = group_shape(bits)
    packed = jnp.moveaxis(jnp.asarray(packed), axis, -1)
    if packed.shape[-1] != packed_length(n, bits):
        raise ValueError(
            f"packed axis has {packed.shape[-1]} bytes, expected {packed_length(n, bits)} "
            f"for {n} codes of {bits} bits"
        )
    groups = packed.astype(jnp.uint32).reshape(*packed.shape[:-1], -1, bytes_per_group)
    out = []
    for i in range(per_group):
        code = jnp.zeros(groups.shape[:-1], jnp.uint32)
        for j in range(bytes_per_group):
            shift = 8 * j - i * bits
            if shift >= bits or shift + 8 <= 0:
                continue
            byte = groups[..., j]
            code = code | (byte << shift if shift >= 0 else byte >> -shift)
        out.append(code & (2**bits - 1))
    codes = jnp.stack(out, axis=-1).reshape(*groups.shape[:-2], -1)[..., :n].astype(jnp.uint8)
    return jnp.moveaxis(codes, -1, axis)
