"""Kernel time of each candidate on each planned weight: what a plan's time limit
(`plan_within(max_ms_per_token=)`, ``lowbit quantize --max-ms-per-token``) adds up.

A candidate is timed on a random weight of the planned weight's (2-D) shape, laid out as
serving lays it out (`prepare_weight`) and multiplied through the engine's `dot_general` by
`rows` activation rows (1: a decode step), best of a few calls on this machine. A kernel
`[K, N]` is contracted over its axis 0; an embedding `[V, D]` over its axis 1, as the output
head (a table only looked up costs less than that). A stacked weight `[L, ..., K, N]` counts
its 2-D time once per layer. Each (shape, candidate, axis) is timed once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops import dot_general, prepare_weight
from lowbit.qarray import quantize
from lowbit.recipes import Candidate

if TYPE_CHECKING:  # _budget imports this module
    from lowbit.api._budget import Measurements

REPEATS = 20


def _contract_axis(path: str) -> int:
    return 1 if path.rsplit("/", 1)[-1] == "embedding" else 0


def candidate_seconds(
    shape: tuple[int, ...], candidate: Candidate, path: str, *, rows: int = 1
) -> float:
    """Seconds of one product of `rows` activation rows with a weight of `shape` quantized
    as `candidate` (see module docstring; a stacked weight counts once per layer), best of
    `REPEATS` calls."""
    matrix = tuple(shape[-2:])
    layers = math.prod(shape[:-2])
    config = candidate.config(path, 2)
    w = jax.random.normal(jax.random.key(0), matrix, jnp.float32) / np.sqrt(matrix[0])
    axis = _contract_axis(path)
    weight = prepare_weight(quantize(w, config), axis)
    x = jnp.ones((rows, matrix[axis]), jnp.float32)
    dims = (((1,), (axis,)), ((), ()))
    product = jax.jit(lambda x, w: dot_general(x, w, dims))
    jax.block_until_ready(product(x, weight))  # compiles
    best = math.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(product(x, weight))
        best = min(best, time.perf_counter() - start)
    return best * layers


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
            key = (shape[-2:], m.candidate.config(path, 2), _contract_axis(path), rows)
            if key not in cache:
                cache[key] = candidate_seconds(shape[-2:], m.candidate, path, rows=rows)
            out.append(dataclasses.replace(m, seconds=cache[key] * math.prod(shape[:-2])))
        timed[path] = out
        if on_weight is not None:
            on_weight(done + 1, len(items))
    return dataclasses.replace(measurements, measured=timed)
