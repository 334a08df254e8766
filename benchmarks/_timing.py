"""Best-of-N wall-clock timing shared by the benchmark modules."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


def best_time(
    fn: Callable[[], object], *, min_seconds: float, min_reps: int, max_reps: int
) -> float:
    """Best wall time of ``fn()`` in seconds, after one untimed warm-up call.

    Repeats at least `min_reps` times, then until `min_seconds` have passed or `max_reps`
    runs were made; waits for every result (`jax.block_until_ready`).
    """
    jax.block_until_ready(fn())
    best, total, reps = float("inf"), 0.0, 0
    while reps < min_reps or (total < min_seconds and reps < max_reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        dt = time.perf_counter() - start
        best, total, reps = min(best, dt), total + dt, reps + 1
    return best
