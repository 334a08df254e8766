"""Waiting prompts prefilled together: which ones, and their batch.

A prompt is prefilled as `lowbit.generate` prefills a batch of one: left-padded to its bucketed
width ``W`` (`lowbit.server._programs.prefill`). Prompts of the same width can share that pass:
each row of a ``[b, W]`` batch is left-padded as it would be alone, and a row attends only to
its own slots, so each computes what it would alone (up to the float rounding of a batch's
shape: `SchedulerConfig.deterministic` prefills each alone) while the weights are read once.
A batch takes prompts of one width only (a wider padding would change nothing but cost), in
the order they arrived, at most as many as there are free slots (each is placed at once), and
only prompts of one chunk or less (longer ones may read the prefix cache, one at a time).

Batches have ``b`` rows of `batch_sizes` (2, 4, ...: one compiled program per width and
size); rows past the prompts repeat the first one, and their output is dropped.

Shapes: ``b`` rows, ``W`` the prefill width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def batch_sizes(most: int) -> list[int]:
    """The batch sizes compiled: powers of two from 2 to `most` (none below 2)."""
    out, b = [], 2
    while b <= most:
        out.append(b)
        b *= 2
    return out


def batch_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` holding `n` prompts, or None when none does."""
    return next((b for b in sizes if b >= n), None)


def partners(
    waiting: Sequence[Sequence[int]],
    width: int,
    width_of: Callable[[int], int | None],
    most: int,
) -> list[int]:
    """Indices into `waiting` (prompts, oldest first) of up to `most` prompts to prefill with
    one of width `width`: those whose `width_of` their length is the same (None: a prompt that
    is never batched), oldest first."""
    out: list[int] = []
    for i, prompt in enumerate(waiting):
        if len(out) == most:
            break
        if width_of(len(prompt)) == width:
            out.append(i)
    return out


def batch_tokens(prompts: Sequence[Sequence[int]], width: int, rows: int) -> tuple[np.ndarray, ...]:
    """``tokens [rows, width]`` int32, each prompt left-padded as it is alone, rows past the
    prompts repeating the first one, and ``start [rows]`` int32, each row's first slot."""
    if not 1 <= len(prompts) <= rows:
        raise ValueError(f"{len(prompts)} prompts do not fit a batch of {rows} rows")
    tokens = np.zeros((rows, width), np.int32)
    start = np.zeros((rows,), np.int32)
    for i in range(rows):
        prompt = prompts[i] if i < len(prompts) else prompts[0]
        if len(prompt) > width:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit width {width}")
        start[i] = width - len(prompt)
        tokens[i, start[i] :] = prompt
    return tokens, start
