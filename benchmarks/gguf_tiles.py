"""Benchmark section: each GGUF type's tile kernels against its block-row kernel.

One `kernels.gguf_linear` call on int8 activations (llama.cpp's arithmetic, the `gguf`
recipe's default), a ``[K, N] = [4096, 4096]`` weight of random blocks written by
`lowbit.gguf`'s encoder, at 1, 8 and 64 activation rows: the block rows as the file stores
them, and the tiles of 8 rows the loader lays them out as (`kernels.gguf_tile`; a type with
no tiled layout would have its block rows only), on the AVX2 path, the AVX-VNNI path where the
CPU has one (`vpdpbusd` on 32-byte registers from 2 rows up) and the best path this CPU has
(AVX-512 VNNI: pairs of groups in 64-byte registers from 2 rows up). Best
of interleaved calls (`_timing.best_times`); every call reads the same weight (5.5 MB of Q2_K
to 17.8 MB of Q8_0), which stays in the cache levels it fits: mostly the kernels' arithmetic,
not memory.

A file's Q8_0 tensor imports as an int8 weight in groups of 32 with float16 scales, which ran
on lowbit's own int8 layout (`kernels.pack("int8", ...)`, int8 activations) until Q8_0 had
tiles (`lowbit.ops.with_int8_activations` moves it onto them): a second table times the two.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._machine import cpu_model
from benchmarks._timing import best_times

K = N = 4096
ROWS = (1, 8, 64)
TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_0", "Q8_0")


def run() -> str:
    from lowbit import kernels
    from lowbit.gguf import block_type

    begin = time.perf_counter()
    supported = kernels.supported_isas()
    paths = [p for p in ("avx2", "avx2vnni", supported[-1]) if p in supported]
    paths = list(dict.fromkeys(paths))
    before = kernels.set_isa(paths[-1])
    rng = np.random.default_rng(0)
    lines = [
        "## GGUF kernels: tiles of 8 rows against block rows",
        "",
        f"- Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_model()}, {os.cpu_count()} cores; "
        f"{kernels.status()}.",
        f"- One `gguf_linear` call on int8 activations, weight [{K}, {N}] in cache; ms per "
        "call, best of interleaved calls. `python -m benchmarks gguf_tiles`.",
        "",
        "| type | rows | path | block rows ms | tiles ms | rows / tiles |",
        "|---|---:|---|---:|---:|---:|",
    ]
    try:
        for typ in TYPES:
            w = rng.standard_normal((N, K)).astype(np.float32) * 0.02
            rows = jnp.asarray(block_type(typ).encode(w))
            tiles = kernels.gguf_tile(rows, typ) if kernels.gguf_tileable(typ, K, N) else None
            for m in ROWS:
                x = jnp.asarray(rng.standard_normal((m, K)).astype(np.float32))
                for path in paths:
                    kernels.set_isa(path)
                    fns = {}
                    variants = [("rows", rows, False)]
                    if tiles is not None:
                        variants.append(("tiles", tiles, True))
                    for name, data, tiled in variants:
                        fn = jax.jit(
                            lambda x, d, typ=typ, tiled=tiled: kernels.gguf_linear(
                                x, d, typ, int8_activations=True, tiled=tiled
                            )
                        )
                        fn(x, data).block_until_ready()
                        fns[name] = lambda fn=fn, x=x, d=data: fn(x, d).block_until_ready()
                    best = best_times(fns, min_seconds=0.2, min_reps=10, max_reps=200)
                    tiled_ms = f"{best['tiles'] * 1e3:.3f}" if "tiles" in best else "-"
                    ratio = f"{best['rows'] / best['tiles']:.2f}x" if "tiles" in best else "-"
                    lines.append(
                        f"| {typ} | {m} | {path} | {best['rows'] * 1e3:.3f} | {tiled_ms} "
                        f"| {ratio} |"
                    )
        lines += _q8_0_against_int8_layout(rng, paths)
    finally:
        kernels.set_isa(before)
    lines += ["", f"Section time: {time.perf_counter() - begin:.0f} s.", ""]
    return "\n".join(lines)


def _q8_0_against_int8_layout(rng: np.random.Generator, paths: list[str]) -> list[str]:
    """Rows of the second table: the same Q8_0 weight on the int8 layout and as tiles."""
    from lowbit import kernels
    from lowbit.gguf import block_type

    w = rng.standard_normal((N, K)).astype(np.float32) * 0.02
    rows = jnp.asarray(block_type("Q8_0").encode(w))
    d, _, codes = block_type("Q8_0").split(rows)
    int8 = kernels.pack("int8", codes.T, d.T, None, 32)  # [K, N] codes, [K / 32, N] scales
    tiles = kernels.gguf_tile(rows, "Q8_0")
    lines = [
        "",
        "A Q8_0 tensor on lowbit's int8 layout (groups of 32, int8 activations: how a file's "
        "Q8_0 tensors ran before Q8_0 had tiles) and as Q8_0 tiles; ms per call.",
        "",
        "| rows | path | int8 layout ms | Q8_0 tiles ms | int8 / tiles |",
        "|---:|---|---:|---:|---:|",
    ]
    layout = jax.jit(lambda x, p: kernels.weight_only_linear(x, p, int8_activations=True))
    tiled = jax.jit(
        lambda x, t: kernels.gguf_linear(x, t, "Q8_0", int8_activations=True, tiled=True)
    )
    for m in ROWS:
        x = jnp.asarray(rng.standard_normal((m, K)).astype(np.float32))
        for path in paths:
            kernels.set_isa(path)
            layout(x, int8).block_until_ready(), tiled(x, tiles).block_until_ready()
            fns = {
                "int8": lambda x=x: layout(x, int8).block_until_ready(),
                "tiles": lambda x=x: tiled(x, tiles).block_until_ready(),
            }
            best = best_times(fns, min_seconds=0.2, min_reps=10, max_reps=200)
            lines.append(
                f"| {m} | {path} | {best['int8'] * 1e3:.3f} | {best['tiles'] * 1e3:.3f} "
                f"| {best['int8'] / best['tiles']:.2f}x |"
            )
    return lines


if __name__ == "__main__":
    print(run())
