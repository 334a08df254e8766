"""Quantize / dequantize throughput of `lowbit.qarray.quantize` on a 4096 x 4096 float32 matrix.

Formats: int8 per-channel, int4 groups of 128, NF4 groups of 64, MXFP4 (blocks of 32); each is
jitted and timed against the plain fake-quant expression `jnp.round(jnp.clip(x / s, lo, hi)) * s`
(with its own absmax scale) in the same process run, so the ratios are like for like. Throughput
counts the float32 input (64 MiB) once. Run with `python -m benchmarks quantize`.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._machine import cpu_model
from lowbit.qarray import PerChannel, PerGroup, QuantConfig, quantize

SIZE = 4096
REPS = 7
CONFIGS = (
    ("int8", "per-channel", QuantConfig(format="int8", granularity=PerChannel(axes=(1,)))),
    ("int4", "groups of 128", QuantConfig(format="int4", granularity=PerGroup(128, axis=0))),
    ("nf4", "groups of 64", QuantConfig(format="nf4", granularity=PerGroup(64, axis=0))),
    ("mxfp4", "blocks of 32, E8M0", QuantConfig(format="mxfp4", granularity=PerGroup(32, axis=0))),
)


def _median_seconds(fn: Callable[[], object]) -> float:
    """Median wall time of fn() over REPS calls, after a warm-up call (which compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _plain_int8_per_channel(x: jax.Array) -> jax.Array:
    scale = jnp.max(jnp.abs(x), axis=0, keepdims=True) / 127
    return jnp.round(jnp.clip(x / scale, -127, 127)) * scale


def _plain_int4_groups(x: jax.Array) -> jax.Array:
    groups = x.reshape(SIZE // 128, 128, SIZE)
    scale = jnp.max(jnp.abs(groups), axis=1, keepdims=True) / 7
    return (jnp.round(jnp.clip(groups / scale, -7, 7)) * scale).reshape(x.shape)


def run() -> str:
    """Times every configuration; returns a markdown section."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((SIZE, SIZE), np.float32))
    gigabytes = x.size * 4 / 1e9
    plain = {
        "int8": _median_seconds(lambda: jax.jit(_plain_int8_per_channel)(x)),
        "int4": _median_seconds(lambda: jax.jit(_plain_int4_groups)(x)),
    }
    rows = []
    for name, granularity, config in CONFIGS:
        quantize_fn = jax.jit(lambda x, config=config: quantize(x, config))
        dequantize_fn = jax.jit(lambda q: q.dequantize())
        round_trip_fn = jax.jit(lambda x, config=config: quantize(x, config).dequantize())
        q = quantize_fn(x)
        t_q = _median_seconds(lambda f=quantize_fn: f(x))
        t_d = _median_seconds(lambda f=dequantize_fn, q=q: f(q))
        t_rt = _median_seconds(lambda f=round_trip_fn: f(x))
        error = float(jnp.sqrt(jnp.mean((round_trip_fn(x) - x) ** 2)))
        baseline = plain.get(name, plain["int4"])
        rows.append(
            f"| {name} | {granularity} | {t_q * 1e3:.1f} | {t_d * 1e3:.1f} | {t_rt * 1e3:.1f} | "
            f"{gigabytes / t_rt:.2f} | {baseline * 1e3:.1f} | {t_rt / baseline:.2f}x | "
            f"{q.nbytes / 2**20:.1f} | {error:.4f} |"
        )
    header = (
        "## Quantize / dequantize throughput\n\n"
        f"{datetime.date.today().isoformat()}, {cpu_model()}, JAX {jax.__version__} on CPU, "
        f"{SIZE}x{SIZE} float32 "
        f"(64 MiB), median of {REPS} jitted calls. *Plain* is `jnp.round(jnp.clip(x / s, "
        "-q, q)) * s` with an absmax scale of the same granularity (int8 per-channel for int8, "
        "int4 groups of 128 for the 4-bit rows), timed in the same run. Stored MiB is "
        "`QArray.nbytes` (packed codes plus scales); RMS error is against the input "
        "(standard normal).\n\n"
        "| format | granularity | quantize ms | dequantize ms | round trip ms | round trip "
        "GB/s | plain ms | round trip / plain | stored MiB | RMS error |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    return header + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(run())
