"""Ternary {-1, 0, +1} (BitNet b1.58): 2-bit dense storage, or base-3 at 5 trits per byte.

Codes are trits: code = value + 1, so {-1, 0, +1} are codes {0, 1, 2}; bit pattern 3 is never
written (it would decode to 2, off the grid). With `AbsMean` calibration the scale is mean |x|
and codes = clip(round(x / scale), -1, 1) + 1, as in BitNet b1.58.

Two storages of the same codes:

  * ``ternary``: dense 2-bit packing, 4 values a byte (2.0 bits/value);
  * ``ternary_b3``: base 3, 5 trits a byte, byte = t0 + 3 t1 + 9 t2 + 27 t3 + 81 t4 <= 242,
    trit i of a group is the i-th value along the packed axis (1.6 bits/value; the bound is
    log2(3) ≈ 1.585). The last group is padded with trit 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats._integer import IntFormat

TRITS_PER_BYTE = 5
_POWERS = tuple(3**i for i in range(TRITS_PER_BYTE))
STORAGES = ("bits", "base3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TernaryFormat(IntFormat):
    """Values {-1, 0, +1}; an `IntFormat` with qmin = -1, qmax = 1 and offset-by-one codes.

    Attributes:
      storage: ``"bits"`` (dense 2-bit packing) or ``"base3"`` (5 trits a byte).
    """

    bits: int = 2
    is_signed: bool = True
    storage: str = "bits"

    def __post_init__(self):
        if self.bits != 2 or not self.is_signed:
            raise ValueError(f"ternary formats have bits=2 and is_signed=True, got {self}")
        if self.storage not in STORAGES:
            raise ValueError(f"storage={self.storage!r}; accepted: {STORAGES}")

    @property
    def qmin(self) -> int:
        return -1

    @property
    def qmax(self) -> int:
        return 1

    @property
    def bits_per_value(self) -> float:
        return 8 / TRITS_PER_BYTE if self.storage == "base3" else float(self.bits)

    def from_int(self, q: jax.Array) -> jax.Array:
        return (q + 1).astype(jnp.uint8)

    def to_int(self, codes: jax.Array) -> jax.Array:
        return jnp.asarray(codes).astype(jnp.int32) - 1

    def codes(self) -> np.ndarray:
        return np.arange(3, dtype=np.uint8)

    def packed_length(self, n: int) -> int:
        if self.storage == "bits":
            return super().packed_length(n)
        return -(-n // TRITS_PER_BYTE)

    def pack(self, codes: jax.Array, axis: int) -> jax.Array:
        """codes: [..., n, ...] trits in {0, 1, 2} → [..., packed_length(n), ...] uint8."""
        if self.storage == "bits":
            return super().pack(codes, axis)
        trits = jnp.moveaxis(jnp.asarray(codes), axis, -1).astype(jnp.uint32)
        n = trits.shape[-1]
        pad = -n % TRITS_PER_BYTE
        if pad:
            trits = jnp.pad(trits, [(0, 0)] * (trits.ndim - 1) + [(0, pad)])
        groups = trits.reshape(*trits.shape[:-1], -1, TRITS_PER_BYTE)
        packed = sum(groups[..., i] * p for i, p in enumerate(_POWERS))
        return jnp.moveaxis(packed.astype(jnp.uint8), -1, axis)

    def unpack(self, packed: jax.Array, n: int, axis: int) -> jax.Array:
        """Inverse of `pack`.

        Raises:
          ValueError: if `packed` has the wrong length along `axis` for `n` codes.
        """
        if self.storage == "bits":
            return super().unpack(packed, n, axis)
        packed = jnp.moveaxis(jnp.asarray(packed), axis, -1)
        if packed.shape[-1] != self.packed_length(n):
            raise ValueError(
                f"packed axis has {packed.shape[-1]} bytes, expected {self.packed_length(n)} "
                f"for {n} base-3 codes"
            )
        wide = packed.astype(jnp.uint32)[..., None]
        trits = (wide // jnp.asarray(_POWERS, jnp.uint32)) % 3
        trits = trits.reshape(*packed.shape[:-1], -1)[..., :n].astype(jnp.uint8)
        return jnp.moveaxis(trits, -1, axis)


TERNARY = TernaryFormat(name="ternary")
TERNARY_B3 = TernaryFormat(name="ternary_b3", storage="base3")
