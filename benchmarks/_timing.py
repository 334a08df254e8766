"""Best-of-N wall-clock timing shared by the benchmark modules."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import jax

K = TypeVar("K")


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


def best_times(
    fns: Mapping[K, Callable[[], object]], *, min_seconds: float, min_reps: int, max_reps: int
) -> dict[K, float]:
    """Best wall time of each of `fns` in seconds, the calls interleaved.

    Each round runs every function, in an order shuffled per round, as one untimed call then
    one timed call: a stretch of load on a shared machine slows every candidate rather than
    the one that happened to run then, and no candidate's time depends on which one ran
    before it (the untimed call brings its operands back into cache, as consecutive calls
    of a sequential best-of-N do). Rounds repeat at least `min_reps` times, then until the
    slowest candidate has run `min_seconds` in all or `max_reps` rounds were made.
    """
    keys = list(fns)
    order = random.Random(0)
    best = dict.fromkeys(keys, float("inf"))
    total = dict.fromkeys(keys, 0.0)
    reps = 0
    while reps < min_reps or (min(total.values()) < min_seconds and reps < max_reps):
        order.shuffle(keys)
        for key in keys:
            jax.block_until_ready(fns[key]())
            start = time.perf_counter()
            jax.block_until_ready(fns[key]())
            dt = time.perf_counter() - start
            best[key], total[key] = min(best[key], dt), total[key] + dt
        reps += 1
    return best
