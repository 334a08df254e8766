"""Kernel time of each candidate on each planned weight: what a plan's time limit
(`plan_within(max_ms_per_token=)`, ``lowbit quantize --max-ms-per-token``) adds up.

A candidate is timed on a random weight of the planned weight's (2-D) shape, laid out as
serving lays it out (`prepare_weight`) and multiplied through the engine's `dot_general` by
`rows` activation rows (1: a decode step), best of a few calls on this machine. Each weight is
contracted over the axis its matmul layout names (`lowbit.recipes.contraction_axis`): a
``kernel`` `[K, N]` over axis 0, an ``embedding`` `[V, D]` over axis 1 as the output head (a
table only looked up costs less than that). A stacked weight `[L, ..., K, N]` counts its 2-D
time once per layer. Each (2-D shape, config, axis) is timed once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.api._measurements import Measurements
from lowbit.ops import dot_general, prepare_weight
from lowbit.qarray import quantize
from lowbit.recipes import Candidate, contraction_axis

REPEATS = 20


def candidate_seconds(
    matrix: tuple[int, int], candidate: Candidate, path: str, *, rows: int = 1
) -> float:
    """Seconds of one product of `rows` activation rows with a `matrix`-shaped weight at
    `path` quantized as `candidate` (see module docstring), best of `REPEATS` calls."""
    axis = contraction_axis(path, 2)
    w = jax.random.normal(jax.random.key(0), matrix, jnp.float32) / np.sqrt(matrix[axis])
    weight = prepare_weight(quantize(w, candidate.config(path, 2)), axis)
    x = jnp.ones((rows, matrix[axis]), jnp.float32)
    dims = (((1,), (axis,)), ((), ()))
    product = jax.jit(lambda x, w: dot_general(x, w, dims))
    jax.block_until_ready(product(x, weight))  # compiles
    best = math.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(product(x, weight))
        best = min(best, time.perf_counter() - start)
    return best


def time_candidates(
    measurements: Measurements,
    *,
    rows: int = 1,
    on_weight: Callable[[int, int], None] | None = None,
) -> Measurements:
    """`measurements` (`measure_candidates`) with every candidate's kernel seconds filled in
    (`Measured.seconds`), for a plan with a time limit."""
    cache: dict[tuple, float] = {}
    timed = {}
    items = list(measurements.measured.items())
    for done, (path, ms) in enumerate(items):
        shape = measurements.shapes[path]
        out = []
        for m in ms:
            # The algorithm (GPTQ) changes the codes, not the layout or the kernel.
            key = (shape[-2:], m.candidate.config(path, 2), contraction_axis(path, 2), rows)
            if key not in cache:
                cache[key] = candidate_seconds(shape[-2:], m.candidate, path, rows=rows)
            out.append(dataclasses.replace(m, seconds=cache[key] * math.prod(shape[:-2])))
        timed[path] = out
        if on_weight is not None:
            on_weight(done + 1, len(items))
    return dataclasses.replace(measurements, measured=timed)
