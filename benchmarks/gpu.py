"""GPU benchmark: quantized matmuls (Pallas and XLA paths) against bf16, and Llama decode.

Matmuls `x [M, K] @ W [K, N]` at K = N in {4096, 8192}, M in {1, 16, 256, 4096}, through
`lowbit.kernels.pallas`: bf16 (XLA's dot), w8a8 int8 (`int8_matmul`: per-token int8
activations, per-channel int8 weight, XLA), fp8 e4m3 (`fp8_matmul`, XLA), int4 group 128 and
NF4 group 64 weight-only (`weight_only_matmul`, Pallas/Triton). A row's time is the median of
a few measurements, each a run of back-to-back calls (every call inside one compiled program
repeats the product `UNROLL` times behind optimisation barriers, so neither dispatch latency
nor loop-invariant hoisting hides the kernel's time). TB/s counts the weight bytes as stored
plus the bf16 activations read, once per product; TFLOP/s counts 2 M K N.

For int4, a few tile configurations are timed per shape and the fastest is reported (its
tiles in the last column); NF4 reuses int4's choice at the same shape.

The int8 and fp8 GEMMs are also timed alone at 8192² with the weight stored [K, N] and [N, K]:
cuBLASLt reads it K-major, and the w8a8 / fp8 rows above store it that way.

Decode: a SmolLM2-135M-shaped `lowbit.models.Decoder` with random bf16 weights (float, `int8w`,
`int4w_g64` recipes) through `lowbit.models.stream_tokens`, batch 1 and 8: tokens per second
of the compiled decode loop (prefill and compilation excluded).

Without a GPU every row says "not measured (no GPU)" at once. Run with
`python -m benchmarks gpu`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SIZES = (4096, 8192)
BATCHES = (1, 16, 256, 4096)
PATHS = (
    "bf16 (XLA)",
    "w8a8 int8, W [N, K] (XLA)",
    "fp8 e4m3, W [N, K] (XLA)",
    "int4 g128 (Pallas)",
    "nf4 g64 (Pallas)",
)
BASELINE = PATHS[0]
LLAMA_WEIGHTS = (("bf16", None), ("int8 weights", "int8w"), ("int4 weights g64", "int4w_g64"))
LLAMA_BATCHES = (1, 8)
LLAMA_SHAPE = dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536)
LLAMA_VOCAB = 49152
DECODE_CHUNK, DECODE_CHUNKS = 32, 4  # steps per compiled decode call; calls (first compiles)
PROMPT = 8
UNROLL = 8  # products per compiled call
MEASUREMENTS = 5
MIN_CALL_SECONDS = 0.02  # each measurement runs calls until about this long
# Budgets from the start: no matmul row starts after the first, no decode row after the
# second (a decode row compiles a 30-layer model twice: it needs a margin), no GEMM-layout row
# (a diagnostic, so last) after the third. Rows left say so.
MATMUL_BUDGET_S, DECODE_BUDGET_S, LAYOUT_BUDGET_S = 180.0, 250.0, 290.0
# The targets, as bf16 time / path time: (K = N, M, path, at least).
MATMUL_TARGETS = (
    (8192, 1, PATHS[3], 2.5),
    (8192, 4096, PATHS[1], 1.6),
    (8192, 4096, PATHS[2], 1.6),
)
DECODE_TARGET = ("int4 weights g64", 1, 1.3)
# The int8 / fp8 GEMMs alone (no activation quantization) with the weight stored either way.
LAYOUT_SIZE, LAYOUT_BATCHES = 8192, (16, 256, 4096)
# int4 tile candidates (block_m, block_n, block_k, split_k, num_warps; 0 = choose).
ROW_TILES = ((0, 0, 0, 0, 0), (0, 256, 128, 0, 0), (0, 0, 0, 8, 0), (0, 0, 0, 0, 8))
SMALL_M_TILES = ((0, 0, 0, 0, 0), (0, 64, 128, 0, 0))
LARGE_M_TILES = ((0, 0, 0, 0, 0), (128, 128, 64, 0, 8), (128, 256, 64, 1, 8))
SMOKE = os.environ.get("LOWBIT_BENCH_SMOKE", "") not in ("", "0")
if SMOKE:
    # A quick check that this code runs (CPU: kernels interpreted), not a measurement.
    SIZES, BATCHES, UNROLL, MEASUREMENTS, MIN_CALL_SECONDS = (256,), (1, 16), 2, 1, 0.0
    LLAMA_SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)
    LLAMA_VOCAB, DECODE_CHUNK, DECODE_CHUNKS = 256, 2, 2
    LAYOUT_SIZE, LAYOUT_BATCHES = 256, (16,)
    ROW_TILES, SMALL_M_TILES, LARGE_M_TILES = ROW_TILES[:2], SMALL_M_TILES[:2], LARGE_M_TILES[:2]


@dataclasses.dataclass
class Row:
    """One timed product (time None: not measured, `note` says why)."""

    size: int
    m: int
    path: str
    seconds: float | None = None
    weight_bytes: int = 0
    tiles: str = ""
    note: str = ""


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


# --- timing -------------------------------------------------------------------------------------
def _repeated(fn: Callable[[jax.Array, Any], jax.Array]) -> Callable:
    """A jitted `(x, w, carry) -> carry` running `fn(x, w)` UNROLL times in sequence.

    The barriers make each product depend on the previous one's carry (no hoisting, no common
    subexpression) and keep XLA from shrinking a product to the one element read from it.
    """

    def run(x, w, carry):
        for _ in range(UNROLL):
            x, w, carry = jax.lax.optimization_barrier((x, w, carry))
            y = fn(x, w)
            carry, y = jax.lax.optimization_barrier((carry, y))
            carry = carry + y[0, 0].astype(jnp.float32)
        return carry

    return jax.jit(run)


def _time_product(fn: Callable, x: jax.Array, w: Any) -> float:
    """Median seconds per product of `fn(x, w)` (compile and warm-up excluded)."""
    run = _repeated(fn)
    carry = jax.block_until_ready(run(x, w, jnp.float32(0)))  # compiles
    start = time.perf_counter()
    carry = jax.block_until_ready(run(x, w, carry))
    calls = max(1, min(200, int(MIN_CALL_SECONDS / max(time.perf_counter() - start, 1e-6))))
    samples = []
    for _ in range(MEASUREMENTS):
        start = time.perf_counter()
        for _ in range(calls):
            carry = run(x, w, carry)
        jax.block_until_ready(carry)
        samples.append((time.perf_counter() - start) / (calls * UNROLL))
    return statistics.median(samples)


# --- weights ------------------------------------------------------------------------------------
def _weights(k: int, key: jax.Array) -> dict[str, Any]:
    """Every path's weight for a [k, k] random matrix (quantized on the device).

    w8a8 and fp8 weights are stored [N, K] (scales [N, 1]), the layout cuBLASLt reads.
    """
    from lowbit.qarray import PerChannel, PerGroup, QuantConfig, quantize

    w = jax.random.normal(key, (k, k), jnp.float32) / np.sqrt(k)
    with_activation = lambda q, fmt: dataclasses.replace(q, activation=QuantConfig(format=fmt))
    rows = PerChannel((0,))  # of w.T [N, K]: one scale an output channel
    out = {
        BASELINE: w.astype(jnp.bfloat16),
        PATHS[1]: with_activation(quantize(w.T, "int8", granularity=rows), "int8"),
        PATHS[2]: with_activation(quantize(w.T, "fp8_e4m3fn", granularity=rows), "fp8"),
        PATHS[3]: quantize(w, "int4", granularity=PerGroup(128, 0)),
        PATHS[4]: quantize(w, "nf4", granularity=PerGroup(64, 0)),
    }
    return jax.block_until_ready(out)


def _nbytes(w: Any) -> int:
    return int(w.nbytes)


def _product(path: str, tiles: tuple[int, ...] = ()) -> Callable:
    from lowbit.kernels import pallas

    if path == BASELINE:
        return lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if path == PATHS[1]:
        return lambda x, w: pallas.int8_matmul(x, w, contract_axis=1)
    if path == PATHS[2]:
        return lambda x, w: pallas.fp8_matmul(x, w, contract_axis=1)
    names = ("block_m", "block_n", "block_k", "split_k", "num_warps")
    kwargs = {n: v for n, v in zip(names, tiles, strict=False) if v}
    return lambda x, w: pallas.weight_only_matmul(x, w, interpret=not _has_gpu(), **kwargs)


def _tiles_label(m: int, w: Any, tiles: tuple[int, ...]) -> str:
    from lowbit.kernels import pallas

    names = ("m", "n", "k", "split_k", "num_warps")
    want = pallas.Blocks(**dict(zip(names, (*tiles, 0, 0, 0, 0, 0)[:5], strict=True)))
    return str(pallas.blocks_for(w, m, want))


def _int4_candidates(m: int) -> tuple[tuple[int, ...], ...]:
    if m == 1:
        return ROW_TILES
    return SMALL_M_TILES if m <= 64 else LARGE_M_TILES


def _nf4_candidates(int4_tiles: tuple[int, ...]) -> list[tuple[int, ...]]:
    """int4's tiles with block_k capped at NF4's group of 64, then the default choice."""
    if not int4_tiles:
        return [()]
    bm, bn, bk, *rest = int4_tiles
    return [(bm, bn, min(bk, 64) if bk else 0, *rest), ()]


def _time_pallas(path: str, m: int, x: jax.Array, w: Any, candidates, deadline: float):
    """(seconds, tiles label, candidate) of the fastest candidate tiles that run."""
    best: tuple[float, str, tuple] | None = None
    errors = []
    for tiles in candidates:
        if best is not None and time.perf_counter() > deadline:
            break
        try:
            seconds = _time_product(_product(path, tiles), x, w)
        except Exception as e:  # a candidate Triton rejects: try the next one
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            print(f"[gpu] {path} M={m} tiles {tiles}: {errors[-1]}", file=sys.stderr, flush=True)
            continue
        if best is None or seconds < best[0]:
            best = (seconds, _tiles_label(m, w, tiles), tiles)
    if best is None:
        raise RuntimeError("; ".join(errors) or "no candidate tiles")
    return best


def _matmul_rows(deadline: float) -> list[Row]:
    rows = []
    key = jax.random.key(0)
    for k in SIZES:
        weights = _weights(k, key)
        for m in BATCHES:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            chosen: tuple = ()
            for path in PATHS:
                row = Row(k, m, path, weight_bytes=_nbytes(weights[path]))
                if time.perf_counter() > deadline:
                    row.note = "not measured (time budget)"
                    rows.append(row)
                    continue
                try:
                    if path == PATHS[3]:
                        candidates = _int4_candidates(m)
                        row.seconds, row.tiles, chosen = _time_pallas(
                            path, m, x, weights[path], candidates, deadline
                        )
                    elif path == PATHS[4]:
                        candidates = _nf4_candidates(chosen)
                        row.seconds, row.tiles, _ = _time_pallas(
                            path, m, x, weights[path], candidates, deadline
                        )
                    else:
                        row.seconds = _time_product(_product(path), x, weights[path])
                except Exception as e:
                    row.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                print(f"[gpu] K=N={k} M={m} {path}: {_ms(row)}", file=sys.stderr, flush=True)
        del weights
    return rows


# --- weight layout of the int8 / fp8 GEMMs ------------------------------------------------------
def _layout_rows(deadline: float) -> list[tuple[str, int, str, str]]:
    """(GEMM, M, weight layout, ms text): XLA's int8 -> int32 and fp8 -> float32 dots with the
    weight stored [K, N] (contracted on axis 0) or [N, K] (axis 1)."""
    k = LAYOUT_SIZE
    key = jax.random.key(1)
    w = jax.random.normal(key, (k, k), jnp.float32) / np.sqrt(k)
    gemms = (
        ("int8", jnp.int8, jnp.int32, 300.0),
        ("fp8 e4m3", jnp.float8_e4m3fn, jnp.float32, 50.0),
    )
    out = []
    for label, dtype, acc, gain in gemms:
        stored = {"[K, N]": (w * gain).astype(dtype), "[N, K]": (w.T * gain).astype(dtype)}
        for m in LAYOUT_BATCHES:
            x = (jax.random.normal(jax.random.fold_in(key, m), (m, k)) * 20).astype(dtype)
            for layout, weight in stored.items():
                axis = 0 if layout == "[K, N]" else 1
                dims = (((1,), (axis,)), ((), ()))
                fn = lambda x, w, dims=dims, acc=acc: jax.lax.dot_general(
                    x, w, dims, preferred_element_type=acc
                )
                text = _timed_ms(fn, x, weight, deadline)
                out.append((label, m, layout, text))
                print(f"[gpu] {label} GEMM M={m} W {layout}: {text}", file=sys.stderr, flush=True)
    return out + _w8a8_parts(w, key, deadline)


def _timed_ms(fn: Callable, x: Any, w: Any, deadline: float) -> str:
    """`_time_product` in ms as table text, or why it was not measured."""
    if time.perf_counter() > deadline:
        return "not measured (time budget)"
    try:
        return f"{_time_product(fn, x, w) * 1e3:.4f}"
    except Exception as e:
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _w8a8_parts(w: jax.Array, key: jax.Array, deadline: float) -> list[tuple[str, int, str, str]]:
    """w8a8's two steps beside its GEMM at the largest M: the per-token int8 quantization of
    bf16 activations, and the int32 result scaled per token and channel to bf16."""
    from lowbit.kernels import pallas

    m, k = LAYOUT_BATCHES[-1], w.shape[0]
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    acc = jax.random.randint(key, (m, k), -(2**20), 2**20, jnp.int32)
    scales = (jnp.full((m, 1), 1e-3, jnp.float32), jnp.full((1, k), 1e-3, jnp.float32))
    parts = (
        ("w8a8 step: quantize x rows", lambda x, _: pallas.quantize_rows(x, "int8")[0], x, None),
        (
            "w8a8 step: scale int32 result",
            lambda a, s: (a.astype(jnp.float32) * s[0] * s[1]).astype(jnp.bfloat16),
            acc,
            scales,
        ),
    )
    out = []
    for label, fn, first, second in parts:
        text = _timed_ms(fn, first, second, deadline)
        out.append((label, m, "", text))
        print(f"[gpu] {label} M={m}: {text}", file=sys.stderr, flush=True)
    return out


def _layout_table(rows: list[tuple[str, int, str, str]]) -> list[str]:
    lines = [
        f"| GEMM ({LAYOUT_SIZE}²) | M | weight stored | median ms |",
        "| --- | ---: | --- | ---: |",
    ]
    return lines + [f"| {g} | {m} | {layout} | {text} |" for g, m, layout, text in rows]


# --- Llama decode -------------------------------------------------------------------------------
def _llama_params(recipe: str | None):
    from flax import nnx

    import lowbit
    from lowbit.models import Decoder, DecoderConfig

    config = DecoderConfig(vocab_size=LLAMA_VOCAB, **LLAMA_SHAPE)
    model = Decoder(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.split(model)[1])
    if recipe is not None:
        params = lowbit.quantize(params, recipe)
    return model, jax.block_until_ready(params)


def _decode_tok_s(model, params, batch: int) -> float:
    """Tokens per second (all rows) of the decode loop, after its first (compiling) call."""
    from lowbit.models import stream_tokens

    prompts = [[1 + (i + j) % 100 for j in range(PROMPT)] for i in range(batch)]
    stream = stream_tokens(
        model,
        prompts,
        params=params,
        max_new_tokens=1 + DECODE_CHUNK * DECODE_CHUNKS,
        chunk=DECODE_CHUNK,
    )
    next(stream)  # prefill (compiles)
    next(stream)  # first decode call (compiles)
    start = time.perf_counter()
    steps = sum(chunk.shape[1] for chunk in stream)
    return batch * steps / (time.perf_counter() - start)


def _decode_rows(deadline: float) -> list[tuple[str, int, str]]:
    """(weights, batch, tok/s text) per decode row."""
    out = []
    for label, recipe in LLAMA_WEIGHTS:
        failed = "not measured (time budget)" if time.perf_counter() > deadline else ""
        if not failed:
            try:
                model, params = _llama_params(recipe)
            except Exception as e:
                failed = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        for batch in LLAMA_BATCHES:
            if not failed and time.perf_counter() > deadline:
                failed = "not measured (time budget)"
            if failed:
                out.append((label, batch, failed))
                continue
            try:
                text = f"{_decode_tok_s(model, params, batch):.0f}"
            except Exception as e:
                text = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            out.append((label, batch, text))
            print(f"[gpu] decode {label} batch {batch}: {text}", file=sys.stderr, flush=True)
    return out


# --- report -------------------------------------------------------------------------------------
def _ms(row: Row) -> str:
    return row.note or ("n/a" if row.seconds is None else f"{row.seconds * 1e3:.4f} ms")


def _matmul_table(rows: list[Row]) -> list[str]:
    base = {(r.size, r.m): r.seconds for r in rows if r.path == BASELINE}
    lines = [
        "| K = N | M | path | median ms | TB/s | TFLOP/s | vs bf16 | tiles |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r.seconds is None:
            lines.append(f"| {r.size} | {r.m} | {r.path} | {r.note} | | | | |")
            continue
        moved = r.weight_bytes + r.m * r.size * 2
        flops = 2 * r.m * r.size * r.size
        ref = base.get((r.size, r.m))
        ratio = f"{ref / r.seconds:.2f}x" if ref else "n/a"
        lines.append(
            f"| {r.size} | {r.m} | {r.path} | {r.seconds * 1e3:.4f} | "
            f"{moved / r.seconds / 1e12:.2f} | {flops / r.seconds / 1e12:.1f} | {ratio} | "
            f"{r.tiles} |"
        )
    return lines


def _decode_table(rows: list[tuple[str, int, str]]) -> list[str]:
    lines = ["| weights | batch | decode tok/s (all rows) |", "| --- | ---: | ---: |"]
    lines += [f"| {label} | {batch} | {text} |" for label, batch, text in rows]
    return lines


def _device_line() -> str:
    if not _has_gpu():
        return "no GPU (default backend: " + jax.default_backend() + ")"
    device = jax.devices()[0]
    return f"{device.device_kind}, JAX {jax.__version__}"


def _report(
    matmuls: list[Row], layouts: list, decode: list[tuple[str, int, str]], seconds: float
) -> str:
    today = datetime.date.today().isoformat()
    lines = [
        "## GPU: quantized matmuls and decode",
        "",
        f"{today}, {_device_line()}; whole section {seconds:.0f} s"
        + (" (smoke run: interpreted kernels, not a measurement)" if SMOKE else "")
        + ".",
        "",
        "`x [M, K] bf16 @ W [K, N]`. Median of "
        f"{MEASUREMENTS} measurements, each a run of back-to-back calls of {UNROLL} "
        "products; TB/s = (weight bytes as stored + bf16 activation bytes) / time, TFLOP/s = "
        "2 M K N / time, vs bf16 = bf16 time / this time at the same shape. w8a8 and fp8 include "
        "the per-token activation quantization, with the weight stored [N, K] (`contract_axis=1`; "
        "stored [K, N], XLA picks slower GEMMs: see `lowbit.kernels.pallas`); int4 / NF4 are "
        "`weight_only_matmul` (Pallas, Triton), tiles `block_m x block_n x block_k`, K split, "
        "warps.",
        "",
        *_matmul_table(matmuls),
        "",
        "The int8 and fp8 GEMMs alone (`lax.dot_general`, no activation quantization), the "
        "weight stored [K, N] (contracted on axis 0, as a Flax kernel) or [N, K]; then w8a8's "
        'two other steps at the largest M ("w8a8 step" rows, one [M, K] operand each): the '
        "per-token int8 quantization of bf16 activations and the scaling of the int32 result "
        "to bf16:",
        "",
        *_layout_table(layouts),
        "",
        "Decode: SmolLM2-135M-shaped Llama (dim 576, 30 layers, 9 heads / 3 KV heads, ffn "
        f"1536, vocab {LLAMA_VOCAB}), random bf16 weights, `lowbit.models.stream_tokens`, "
        f"{PROMPT}-token prompts, {DECODE_CHUNK} steps per compiled call, timed over "
        f"{DECODE_CHUNKS - 1} calls after the first. Quantized weights go through the engine's "
        "quantized `dot_general`: on CUDA, int4 and int8 weight-only layers of at least "
        "`GPU_MIN_WEIGHT_ELEMENTS` run `weight_only_matmul` (Pallas), smaller ones (all of "
        "this model's) XLA's fused dequantize-and-dot.",
        "",
        *_decode_table(decode),
        "",
        "Targets (the issue names an H100; the card is named above):",
        "",
        *_targets(matmuls, decode),
    ]
    return "\n".join(lines) + "\n"


def _targets(matmuls: list[Row], decode: list[tuple[str, int, str]]) -> list[str]:
    """One line per target: the measured ratio to bf16 and met / MISSED, or not measured."""
    seconds = {(r.size, r.m, r.path): r.seconds for r in matmuls}
    lines = []
    for k, m, path, goal in MATMUL_TARGETS:
        ours, base = seconds.get((k, m, path)), seconds.get((k, m, BASELINE))
        result = "not measured"
        if ours and base:
            result = f"{base / ours:.2f}x: " + ("met" if base / ours >= goal else "MISSED")
        lines.append(f"- {path} at M = {m}, {k}²: >= {goal}x bf16: {result}")
    tok_s = {(label, b): text for label, b, text in decode}
    label, batch, goal = DECODE_TARGET
    ours, base = tok_s.get((label, batch), ""), tok_s.get(("bf16", batch), "")
    result = "not measured"
    if ours.isdigit() and base.isdigit():
        ratio = int(ours) / int(base)
        result = f"{ratio:.2f}x: " + ("met" if ratio >= goal else "MISSED")
    lines.append(f"- decode, {label}, batch {batch}: >= {goal}x bf16: {result}")
    return lines


def _not_measured(reason: str) -> tuple[list[Row], list, list[tuple[str, int, str]]]:
    rows = [Row(k, m, p, note=reason) for k in SIZES for m in BATCHES for p in PATHS]
    layouts = [
        (g, m, layout, reason)
        for g in ("int8", "fp8 e4m3")
        for m in LAYOUT_BATCHES
        for layout in ("[K, N]", "[N, K]")
    ]
    steps = ("w8a8 step: quantize x rows", "w8a8 step: scale int32 result")
    layouts += [(label, LAYOUT_BATCHES[-1], "", reason) for label in steps]
    decode = [(label, b, reason) for label, _ in LLAMA_WEIGHTS for b in LLAMA_BATCHES]
    return rows, layouts, decode


def not_measured() -> str:
    """The section with every row saying "not measured (no GPU)"."""
    return _report(*_not_measured("not measured (no GPU)"), 0.0)


def run() -> str | None:
    """The section, or None without a GPU (a measured section is then left as it is)."""
    start = time.perf_counter()
    if not _has_gpu() and not SMOKE:
        return None
    matmuls = _matmul_rows(start + MATMUL_BUDGET_S)
    decode = _decode_rows(start + DECODE_BUDGET_S)
    layouts = _layout_rows(start + LAYOUT_BUDGET_S)
    return _report(matmuls, layouts, decode, time.perf_counter() - start)


if __name__ == "__main__":
    print(run())
