"""Ops-layer benchmark: quantized models through the public path, CPU kernels on and off.

Three tables, each timed in one run with its float32 baseline beside it:

1. One linear layer `y = x @ W`, K = N = 4096, M in {1, 64}, as `jax.jit(lowbit.run(fn))`
   with W a `lowbit.qarray.quantize`d QArray: float32, int8 weight-only (per channel), int4
   weight-only (groups of 128), w8a8 (int8 per channel, dynamic per-token int8 activations).
   "stored layout" routes to `lowbit.kernels` with the weight prepared once
   (`lowbit.ops.prepare_weight`: the kernel layout in place of the codes, the serving flow);
   "repack per call" is a QArray without it (the layout is rebuilt inside every call);
   "kernels off" is the same script in a subprocess with `LOWBIT_DISABLE_KERNELS=1` (the
   pure-JAX paths). The kernel alone on a pre-packed weight is timed too.
2. Engine trace cost: `jax.jit(f).lower(params, x)` time of a 32-layer MLP (d = 256), float
   vs `lowbit.run` with int8 weights.
3. The same w8a8 MLP's runtime (64 tokens) through `lowbit.run` vs the same math written by
   hand (per-token int8 quantize, `lax.dot_general` int8 x int8 -> int32, scale epilogue).

Run with `python -m benchmarks ops`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

import lowbit
from benchmarks._timing import best_time
from lowbit import kernels
from lowbit.ops import _cpu_kernels, prepare_weight
from lowbit.qarray import PerChannel, PerGroup, PerToken, QuantConfig, quantize

SIZE = 4096
BATCHES = (1, 64)
MLP_LAYERS, MLP_WIDTH, MLP_TOKENS = 32, 256, 64
MIN_SECONDS = 0.5  # per measurement: repeat until this much time has passed...
MIN_REPS, MAX_REPS = 2, 20  # ...within these bounds; the minimum is reported
TRACE_REPS = 3
INT8_TOKEN = QuantConfig(format="int8", granularity=PerToken())
# name -> (weight config, activation config)
LINEAR = {
    "int8 weight-only": (QuantConfig(format="int8", granularity=PerChannel((1,))), None),
    "int4 g128 weight-only": (QuantConfig(format="int4", granularity=PerGroup(128, 0)), None),
    "w8a8": (QuantConfig(format="int8", granularity=PerChannel((1,))), INT8_TOKEN),
}


def _time(fn: Callable[[], object]) -> float:
    """Best wall time of fn() in seconds (after one warm-up call)."""
    return best_time(fn, min_seconds=MIN_SECONDS, min_reps=MIN_REPS, max_reps=MAX_REPS)


def _quantized(w: jax.Array, name: str):
    config, activation = LINEAR[name]
    q = jax.jit(quantize, static_argnums=(1,))(w, config)
    return dataclasses.replace(q, activation=activation)


def _linear(x, w):
    return x @ w


def _linear_times() -> dict[str, float]:
    """{"<name> M=<m>": seconds} for float32 and each quantized layout, plus repack costs."""
    key_w, key_x = jax.random.split(jax.random.key(0))
    w = jax.random.normal(key_w, (SIZE, SIZE), jnp.float32) / SIZE**0.5
    run = jax.jit(lowbit.run(_linear))
    times = {}
    weights = {name: _quantized(w, name) for name in LINEAR}
    for m in BATCHES:
        x = jax.random.normal(key_x, (m, SIZE), jnp.float32)
        times[f"float32 M={m}"] = _time(lambda x=x: run(x, w))
        for name, q in weights.items():
            times[f"{name} M={m}"] = _time(lambda x=x, q=q: run(x, q))
            route = _cpu_kernels.kernel_route(x, q, (((1,), (0,)), ((), ())))
            if route is None:
                continue
            stored = prepare_weight(q, 0)
            times[f"{name} M={m} stored"] = _time(lambda x=x, q=stored: run(x, q))
            call = kernels.w8a8_linear if route.kind == "w8a8" else kernels.weight_only_linear
            kernel_only = jax.jit(call)
            times[f"{name} M={m} kernel only"] = _time(
                lambda x=x, p=stored.weight, k=kernel_only: k(x, p)
            )
    return times


def _mlp(params, x):
    for w in params[:-1]:
        x = jax.nn.relu(x @ w)
    return x @ params[-1]


def _mlp_params():
    keys = jax.random.split(jax.random.key(1), MLP_LAYERS)
    shape = (MLP_WIDTH, MLP_WIDTH)
    return [jax.random.normal(k, shape, jnp.float32) / MLP_WIDTH**0.5 for k in keys]


def _trace_seconds(fn, params, x) -> float:
    """Best time of `jax.jit(fn).lower(params, x)`, a fresh function each time, JAX's caches
    cleared first (lowbit's products and row sums are jitted: traced once per shape and
    process, which the first trace of a process pays)."""
    best = float("inf")
    for _ in range(TRACE_REPS):
        jax.clear_caches()
        fresh = jax.jit(lambda p, x: fn(p, x))
        start = time.perf_counter()
        fresh.lower(params, x)
        best = min(best, time.perf_counter() - start)
    return best


def _hand_w8a8_mlp(layers, x):
    """w8a8 written by hand: codes [d, d] int8, scales [1, d] per weight."""
    for i, (codes, w_scale) in enumerate(layers):
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        x_scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        xq = jnp.round(jnp.clip(x / x_scale, -127.0, 127.0)).astype(jnp.int8)
        acc = lax.dot_general(xq, codes, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        x = acc.astype(jnp.float32) * x_scale * w_scale
        if i < len(layers) - 1:
            x = jax.nn.relu(x)
    return x


def _mlp_times() -> dict[str, float]:
    params = _mlp_params()
    x = jax.random.normal(jax.random.key(2), (MLP_TOKENS, MLP_WIDTH), jnp.float32)
    int8 = [_quantized(w, "int8 weight-only") for w in params]
    w8a8 = [prepare_weight(dataclasses.replace(q, activation=INT8_TOKEN), 0) for q in int8]
    prepared = [prepare_weight(q, 0) for q in int8]
    hand = [(q.codes, q.scale_values()) for q in int8]
    run = lowbit.run(_mlp)
    return {
        "trace float": _trace_seconds(_mlp, params, x),
        "trace int8": _trace_seconds(run, int8, x),
        "trace int8 prepared": _trace_seconds(run, prepared, x),
        "mlp float": _time(lambda: jax.jit(_mlp)(params, x)),
        "mlp w8a8 lowbit": _time(lambda: jax.jit(run)(w8a8, x)),
        "mlp w8a8 hand": _time(lambda: jax.jit(_hand_w8a8_mlp)(hand, x)),
    }


def measure() -> dict[str, float]:
    """Every timing of this module in this process (kernels as the environment says)."""
    return {**_linear_times(), **_mlp_times()}


def _measure_without_kernels() -> dict[str, float]:
    env = {**os.environ, "LOWBIT_DISABLE_KERNELS": "1"}
    root = Path(__file__).resolve().parent.parent
    code = "import json, benchmarks.ops as b; print(json.dumps(b.measure()))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"kernels-off measurement failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _linear_table(on: dict[str, float], off: dict[str, float]) -> list[str]:
    lines = [
        f"### One linear layer, K = N = {SIZE} (`jax.jit(lowbit.run(lambda x, w: x @ w))`)",
        "",
        "| weights | M | stored layout ms | float32 / stored | repack per call ms "
        "| kernels off ms | kernel only ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in BATCHES:
        f32 = on[f"float32 M={m}"]
        lines.append(f"| float32 | {m} | {_ms(f32)} | | | {_ms(off[f'float32 M={m}'])} | |")
        for name in LINEAR:
            per_call, k_off = on[f"{name} M={m}"], off[f"{name} M={m}"]
            stored = on.get(f"{name} M={m} stored")
            alone = on.get(f"{name} M={m} kernel only")
            if stored is None:
                lines.append(f"| {name} | {m} | n/a | | {_ms(per_call)} | {_ms(k_off)} | n/a |")
                continue
            lines.append(
                f"| {name} | {m} | {_ms(stored)} | {f32 / stored:.2f}x | {_ms(per_call)} "
                f"| {_ms(k_off)} | {_ms(alone)} |"
            )
    return lines


def _mlp_tables(on: dict[str, float], off: dict[str, float]) -> list[str]:
    return [
        "",
        f"### Engine trace cost: {MLP_LAYERS}-layer MLP, d = {MLP_WIDTH} "
        "(`jax.jit(f).lower(params, x)`)",
        "",
        "| | float ms | lowbit.run int8 ms | ratio | int8 prepared ms | ratio |",
        "|---|---|---|---|---|---|",
        f"| kernels on | {_ms(on['trace float'])} | {_ms(on['trace int8'])} "
        f"| {on['trace int8'] / on['trace float']:.2f}x | {_ms(on['trace int8 prepared'])} "
        f"| {on['trace int8 prepared'] / on['trace float']:.2f}x |",
        f"| kernels off | {_ms(off['trace float'])} | {_ms(off['trace int8'])} "
        f"| {off['trace int8'] / off['trace float']:.2f}x | - | - |",
        "",
        f"### PTQ w8a8 MLP ({MLP_LAYERS} layers, d = {MLP_WIDTH}, {MLP_TOKENS} tokens) vs the "
        "same math by hand",
        "",
        "| | float32 ms | lowbit.run w8a8 ms | hand-written w8a8 ms | lowbit / hand |",
        "|---|---|---|---|---|",
        f"| kernels on | {_ms(on['mlp float'])} | {_ms(on['mlp w8a8 lowbit'])} "
        f"| {_ms(on['mlp w8a8 hand'])} | {on['mlp w8a8 lowbit'] / on['mlp w8a8 hand']:.2f} |",
        f"| kernels off | {_ms(off['mlp float'])} | {_ms(off['mlp w8a8 lowbit'])} "
        f"| {_ms(off['mlp w8a8 hand'])} | {off['mlp w8a8 lowbit'] / off['mlp w8a8 hand']:.2f} |",
    ]


def run() -> str:
    on = measure()
    off = _measure_without_kernels()
    header = [
        f"Date: {time.strftime('%Y-%m-%d')}. "
        "Quantized inference through the public path (`lowbit.run`), CPU kernels on and off.",
        f"{kernels.status()}. Best of up to {MAX_REPS} calls; kernels-off numbers come from a "
        "subprocess with `LOWBIT_DISABLE_KERNELS=1` that times its own float32 baseline.",
        "Stored layout: the weight prepared once (`prepare_weight`, as `lowbit.prepare` and "
        "`load_checkpoint(kernel_axes=)` do); repack per call: the logical QArray; "
        '"kernel only" calls the kernel on the stored layout directly. In the MLP tables the '
        "w8a8 weights are prepared.",
        "",
    ]
    return "\n".join(header + _linear_table(on, off) + _mlp_tables(on, off)) + "\n"


if __name__ == "__main__":
    print(run())
