"""Codebook formats: an explicit sorted table of values, e.g. NF4 (QLoRA's NormalFloat).

`encode` picks the nearest table value; a value exactly halfway between two neighbours takes
the **lower** code (the smaller value). The decision thresholds are precomputed as the
smallest float32 strictly above each exact midpoint, so "nearest" is exact for float32 inputs
even where the midpoint itself is not a float32. Values beyond the ends saturate to the first
or last entry; NaN encodes to the code of the entry nearest zero.

NF4 (Dettmers et al., 2023, "QLoRA", appendix E) puts 8 positive and 7 negative levels at
equally spaced quantiles of the standard normal, plus an exact zero, normalised to [-1, 1]:

  positive: Phi^-1(p_i), p_i = offset - i (offset - 1/2) / 8, i = 0..7
  negative: -Phi^-1(q_j), q_j = offset - j (offset - 1/2) / 7, j = 0..6
  offset = 0.9677083 (between 1 - 1/(2*15) and 1 - 1/(2*16); the published constant)

divided by Phi^-1(offset). As in the published table, the arithmetic is float32 around a
float64 quantile: probabilities (evenly spaced in float64) are rounded to float32, the quantiles
are rounded to float32 and divided in float32. This reproduces the published values exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats._base import Format

NF4_OFFSET = 0.9677083


def normal_float_levels(offset: float = NF4_OFFSET) -> tuple[float, ...]:
    """The 16 NF4 levels, ascending, as float32-representable Python floats.

    Args:
      offset: probability of the outermost quantile (see module docstring).
    Returns:
      16 values from -1.0 to 1.0 with an exact 0.0 at index 7.
    Raises:
      ValueError: if `offset` is not in (0.5, 1).
    """
    if not 0.5 < offset < 1.0:
        raise ValueError(f"offset must be in (0.5, 1), got {offset!r}")
    quantile = NormalDist().inv_cdf
    top = float(np.float32(offset))

    def quantiles(count: int) -> list[float]:
        probabilities = np.linspace(top, 0.5, count + 1)[:-1].astype(np.float32)
        return [quantile(float(p)) for p in probabilities]

    positive, negative = quantiles(8), [-q for q in quantiles(7)]
    values = np.array(sorted([*negative, 0.0, *positive]), np.float32)
    return tuple(float(v) for v in values / values.max())


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodebookFormat(Format):
    """A format given by its table of `2**bits` ascending float32 values (code i → values[i]).

    Attributes:
      values: the table, strictly ascending, one entry per code.
    """

    values: tuple[float, ...]

    def __post_init__(self):
        table = np.asarray(self.values, dtype=np.float64)
        if len(table) != 2**self.bits or not np.all(np.diff(table) > 0):
            raise ValueError(
                f"format {self.name!r}: values must be {2**self.bits} strictly ascending numbers "
                f"for bits={self.bits}, got {len(table)}"
            )
        if not np.array_equal(table.astype(np.float32), table):
            raise ValueError(f"format {self.name!r}: values must be float32-representable")

    @property
    def max_value(self) -> float:
        return self.values[-1]

    @property
    def min_value(self) -> float:
        return self.values[0]

    @functools.cached_property
    def thresholds(self) -> np.ndarray:
        """[2**bits - 1] float32: code = number of thresholds <= y (ties go to the lower code)."""
        table = np.asarray(self.values, dtype=np.float64)
        midpoints = (table[:-1] + table[1:]) / 2  # exact: float32 sums fit in float64
        above = midpoints.astype(np.float32)
        above = np.where(above <= midpoints, np.nextafter(above, np.float32(np.inf)), above)
        return above.astype(np.float32)

    @property
    def _nan_code(self) -> int:
        return int(np.argmin(np.abs(np.asarray(self.values))))

    def encode(self, y: jax.Array) -> jax.Array:
        y = jnp.asarray(y, jnp.float32)
        # 2**bits - 1 compare-and-adds fuse into one elementwise pass (no [..., levels] tensor).
        code = jnp.zeros(y.shape, jnp.uint8)
        for threshold in self.thresholds:
            code = code + (y >= threshold).astype(jnp.uint8)
        return jnp.where(jnp.isnan(y), jnp.uint8(self._nan_code), code)

    def decode(self, codes: jax.Array) -> jax.Array:
        # A chain of selects, not a table gather: it fuses into one elementwise pass and keeps
        # the codes' sharding (a gather from a replicated table into sharded indices is refused
        # on meshes with explicit axes).
        codes = jnp.asarray(codes)
        out = jnp.full(codes.shape, self.values[0], jnp.float32)
        for code, value in enumerate(self.values[1:], start=1):
            out = jnp.where(codes == code, jnp.float32(value), out)
        return out


NF4 = CodebookFormat(name="nf4", bits=4, values=normal_float_levels())
