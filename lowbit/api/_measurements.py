"""`Measurements`: every candidate measured on every planned weight, what a size or time
budget's plan is chosen from (`lowbit.api.measure_candidates` fills it, `time_candidates` adds
kernel times, `plan_within` chooses)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from lowbit.algorithms import Measured, knapsack_bounds


@dataclasses.dataclass(frozen=True)
class Measurements:
    """Every candidate measured on every weight: what a plan is chosen from, for any budget.

    Attributes:
      shapes: {path: shape} of the measured weights.
      measured: {path: [Measured, ...]} (the candidates that fit each weight).
      target: ``"lowbit"`` or ``"gguf"``.
      unplanned: {path: why} for weights no candidate fits.
      fixed: bytes the file holds besides the planned weights (`FileBytes.fixed`), or 0.
      file: the file the bytes were counted for (`FileBytes.what`), or None.
    """

    shapes: Mapping[str, tuple[int, ...]]
    measured: Mapping[str, list[Measured]]
    target: str
    unplanned: Mapping[str, str]
    fixed: int = 0
    file: str | None = None

    @property
    def elements(self) -> int:
        return sum(math.prod(self.shapes[p]) for p in self.measured)

    def bounds(self) -> tuple[int, int]:
        """(smallest, largest) total bytes the candidates can give."""
        return knapsack_bounds([[m.nbytes for m in ms] for ms in self.measured.values()])
