"""Dense bit packing of sub-byte codes into uint8 storage.

Codes of `bits` bits are laid out little-endian as one bit stream along an axis: code `i` of a
group occupies stream bits `[i * bits, (i + 1) * bits)`, and byte `j` holds stream bits
`[8 j, 8 j + 8)`. A group is the smallest run of codes that fills whole bytes:

  bits:            1  2  3  4  5  6  7  8
  codes per group: 8  4  8  2  8  4  8  1
  bytes per group: 1  1  3  1  5  3  7  1

so 3-bit codes take 3 bytes per 8 values (3.0 bits/value) and nothing is wasted but the padding of
the last group (zero bits).

Both directions are one broadcast shift-mask-sum over a static [codes per group, bytes per group]
table of shifts: the masked pieces land on disjoint bits, so their sum is their bitwise OR. That
traces to a handful of ops (cheap to compile, fused by XLA) and is jit-able.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


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


@functools.cache
def _shift_table(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (left, right) shifts [codes per group, bytes per group] placing code i's bits in
    byte j: stream offset i*bits relative to 8j, clamped where the piece misses the byte (the
    clamped shifts then push every bit out of the mask, giving 0)."""
    per_group, bytes_per_group = group_shape(bits)
    offset = np.arange(per_group)[:, None] * bits - 8 * np.arange(bytes_per_group)[None, :]
    left = np.clip(offset, 0, 8).astype(np.uint32)
    right = np.clip(-offset, 0, 8).astype(np.uint32)
    return left, right


def pack(codes: jax.Array, bits: int, axis: int = -1) -> jax.Array:
    """Packs `bits`-bit codes along `axis`.

    Args:
      codes: [..., n, ...] unsigned integer codes in [0, 2**bits) (higher bits are dropped).
      bits: code width, 1..8.
      axis: the axis to pack along.
    Returns:
      [..., packed_length(n, bits), ...] uint8.
    """
    per_group, _ = group_shape(bits)
    codes = jnp.moveaxis(jnp.asarray(codes), axis, -1).astype(jnp.uint32) & (2**bits - 1)
    n = codes.shape[-1]
    pad = -n % per_group
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    groups = codes.reshape(*codes.shape[:-1], -1, per_group, 1)
    left, right = _shift_table(bits)
    pieces = ((groups << left) >> right) & 0xFF  # [..., groups, per_group, bytes_per_group]
    packed = jnp.sum(pieces, axis=-2, dtype=jnp.uint32).reshape(*codes.shape[:-1], -1)
    return jnp.moveaxis(packed.astype(jnp.uint8), -1, axis)


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
    _, bytes_per_group = group_shape(bits)
    packed = jnp.moveaxis(jnp.asarray(packed), axis, -1)
    if packed.shape[-1] != packed_length(n, bits):
        raise ValueError(
            f"packed axis has {packed.shape[-1]} bytes, expected {packed_length(n, bits)} "
            f"for {n} codes of {bits} bits"
        )
    groups = packed.astype(jnp.uint32).reshape(*packed.shape[:-1], -1, 1, bytes_per_group)
    left, right = _shift_table(bits)
    # Byte j holds code i's bits shifted by `left - right`; undo it and keep `bits` bits.
    clip = np.uint32(bits)
    pieces = ((groups << np.minimum(right, clip)) >> np.minimum(left, 8)) & (2**bits - 1)
    codes = jnp.sum(pieces, axis=-1, dtype=jnp.uint32).reshape(*packed.shape[:-1], -1)
    return jnp.moveaxis(codes[..., :n].astype(jnp.uint8), -1, axis)
