"""Benchmark section: how fast a decode GEMV (M = 1) streams its weight, against float32.

K = N = 8192, the README's path (`lowbit.quantize` then ``jax.jit(lowbit.run(fn))``), every
weight rotated over enough copies that together they exceed the last-level cache, so each
call reads its weight from memory (a single copy would be read from cache from the second
call on). GB/s = the bytes the call must read (float32: 4 per weight; quantized: the stored
layout with its scales) over the best call time; the share is that rate over float32's, timed
interleaved in the same run. Run it on another instruction set with ``LOWBIT_CPU_ISA`` and
``XLA_FLAGS=--xla_cpu_max_isa=...`` (``python -m benchmarks bandwidth --label ...``).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import lowbit
from benchmarks._machine import cpu_model, xla_flags_note
from benchmarks._timing import best_times
from lowbit.ops import with_int8_activations

K = N = 8192
PRESETS = ("int4_weight_only", "int8w")
INT8_SUFFIX = " + int8 act."
TARGET = 0.75  # int4 g128 streams >= 75% of float32's GB/s (the AVX2 target of "fast by default")


def _llc_bytes() -> int:
    """The largest cache's size in bytes (32 MiB when unknown)."""
    sizes = []
    for index in range(8):
        path = f"/sys/devices/system/cpu/cpu0/cache/index{index}/size"
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 * 2**20)


def _copies(nbytes: int, llc: int) -> int:
    """Copies whose bytes together exceed the cache twice over (at least 2)."""
    return max(2, -(-2 * llc // nbytes))


def _float_weights(llc: int) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """(x [1, K], a float32 weight [K, N], copies of it that exceed the cache twice over)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, K), np.float32))
    base = jnp.asarray(rng.standard_normal((K, N), np.float32) * 0.02)
    return x, base, [base * (1 + i / 8) for i in range(_copies(base.nbytes, llc))]


def _rotating(call, weights):
    """A function calling `call` on the next of `weights` each time (none stays in cache)."""
    state = {"i": 0}

    def once():
        state["i"] = (state["i"] + 1) % len(weights)
        return call(weights[state["i"]])

    return once


def stream_gbps() -> float:
    """The float32 GEMV's rate (GB/s) at M = 1, K = N = 8192, on copies that exceed the
    last-level cache twice over: the machine's streaming rate, which decode shares are of."""
    x, base, floats = _float_weights(_llc_bytes())
    dot = jax.jit(lambda x, w: x @ w)
    once = _rotating(lambda w: dot(x, w), floats)
    best = best_times({"float32": once}, min_seconds=2.0, min_reps=20, max_reps=60)["float32"]
    return base.nbytes / best / 1e9


def run() -> str:
    begin = time.perf_counter()
    llc = _llc_bytes()
    x, base, floats = _float_weights(llc)
    dot = jax.jit(lambda x, w: x @ w)
    matmul = jax.jit(lowbit.run(lambda p, x: x @ p["kernel"]))
    rotating = _rotating
    fns = {"float32": rotating(lambda w: dot(x, w), floats)}
    nbytes, copies, kinds = {"float32": base.nbytes}, {"float32": len(floats)}, {}
    for preset in PRESETS:
        one = lowbit.quantize({"kernel": base}, preset)
        size = sum(a.nbytes for a in jax.tree.leaves(one))
        weights = [one] + [
            lowbit.quantize({"kernel": base * (1 + i / 8)}, preset)
            for i in range(1, _copies(size, llc))
        ]
        fns[preset] = rotating(lambda p: matmul(p, x), weights)
        nbytes[preset], copies[preset] = size, len(weights)
        kinds[preset] = type(one["kernel"]).__name__
        if preset == "int4_weight_only":  # also with int8 activations (integer dots)
            name = preset + INT8_SUFFIX
            fns[name] = rotating(lambda p: matmul(p, x), with_int8_activations(weights))
            nbytes[name], copies[name], kinds[name] = size, len(weights), kinds[preset]
    del floats
    best = best_times(fns, min_seconds=4.0, min_reps=30, max_reps=120)
    rate = {name: nbytes[name] / best[name] / 1e9 for name in fns}
    lines = [
        "## Decode GEMV streaming rate (M = 1, K = N = 8192, weights from memory)",
        "",
        f"- Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_model()}, {os.cpu_count()} cores, "
        f"last-level cache {llc / 2**20:.0f} MiB; {lowbit.kernels.status()}"
        + xla_flags_note()
        + ". Command: `python -m benchmarks bandwidth` (module docstring).",
        "",
        "| weights | copies rotated | MB read per call | ms per call | GB/s | x float32 GB/s "
        "| x float32 speed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in fns:
        label = name if name == "float32" else f"{name} ({kinds[name]})"
        lines.append(
            f"| {label} | {copies[name]} | {nbytes[name] / 1e6:.1f} | {best[name] * 1e3:.3f} | "
            f"{rate[name]:.1f} | {rate[name] / rate['float32']:.2f} | "
            f"{best['float32'] / best[name]:.2f}x |"
        )
    share = rate["int4_weight_only"] / rate["float32"]
    q8 = rate["int4_weight_only" + INT8_SUFFIX] / rate["float32"]
    lines += [
        "",
        f"- Target: int4 g128 streams >= {TARGET:.0%} of float32's GB/s: {share:.0%} with "
        f"float32 activations (the default), **{'met' if share >= TARGET else 'NOT met'}**; "
        f"{q8:.0%} with int8 activations (`lowbit.ops.with_int8_activations`, opt-in).",
        "- float32's rate is the machine's memory bandwidth at that moment (on a shared "
        "machine it moves from run to run); the int4 kernel with float32 activations runs at "
        "the rate its cores unpack codes and multiply-add them in float32, so its share "
        "follows the machine's bandwidth. "
        f"Section time: {time.perf_counter() - begin:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
