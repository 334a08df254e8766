"""GPU benchmark: quantized matmuls (Pallas and XLA paths) against bf16, and Llama decode.

Matmuls `x [M, K] @ W [K, N]` at K = N = 8192, M in {1, 4, 16, 256, 4096}, through
`lowbit.kernels.pallas`: bf16 (XLA's dot), w8a8 int8 (`int8_matmul`: per-token int8
activations, per-channel int8 weight, XLA), fp8 e4m3 (`fp8_matmul`, XLA), int4 group 128 and
NF4 group 64 weight-only (`weight_only_matmul`: its dot, GEMV or XLA body), and at M = 1 a
floor: the int4 codes read alone (an XLA column sum). A row's time is the median of a few
measurements, each a run of back-to-back calls (every call inside one compiled program
repeats the product `UNROLL` times behind optimisation barriers, so neither dispatch latency
nor loop-invariant hoisting hides the kernel's time). The products rotate over copies of the
weight that together hold more than `ROTATE_BYTES` (several times the L2), so a small
quantized weight is read from memory, as in a model, not from the cache. TB/s counts the
weight bytes as stored plus the bf16 activations read, once per product; TFLOP/s counts
2 M K N.

For int4, tile configurations and bodies are timed per shape and the fastest is reported
with its tiles, beside the tiles the library picks by default; NF4 reuses int4's choice at
the same shape.

Decode through `lowbit.models.stream_tokens` (prefill and compilation excluded): a
SmolLM2-135M-shaped and a Llama-3-8B-shaped `lowbit.models.Decoder` with random bf16
weights, float against int4 weight-only.

Without a GPU every row says "not measured (no GPU)" at once. Run with
`python -m benchmarks gpu`.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SIZES = (8192,)
BATCHES = (1, 4, 16, 256, 4096)
PATHS = (
    "bf16 (XLA)",
    "w8a8 int8, W [N, K] (XLA)",
    "fp8 e4m3, W [N, K] (XLA)",
    "int4 g128 (Pallas)",
    "nf4 g64 (Pallas)",
    "int4 codes read alone (XLA reduce)",
)
READ_ALONE = PATHS[5]  # a floor: the int4 weight's codes summed, no product (M = 1 only)
BASELINE = PATHS[0]
ROTATE_BYTES = 256 << 20  # weight copies a timed call rotates over (H200 L2: 50 MiB)
# (label, shape, vocab, recipe per weights label, batches)
SMOLLM2 = dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536)
LLAMA3_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336)
# weights: (label, int4 group or None for bf16, GPU_MIN_WEIGHT_ELEMENTS or None to keep it)
ALL_PALLAS = "int4 g64, every layer Pallas"
DECODE_MODELS = (
    ("Llama-3-8B", LLAMA3_8B, 128256, (("bf16", None, None), ("int4 g128", 128, None)), (1, 16)),
    (
        "SmolLM2-135M",
        SMOLLM2,
        49152,
        (("bf16", None, None), ("int4 g64", 64, None), (ALL_PALLAS, 64, 0)),
        (1, 8),
    ),
)
# Small products: the Pallas kernel against XLA's fused dequantize-and-dot (the engine's
# path under GPU_MIN_WEIGHT_ELEMENTS), int4 g64, (K, N) and M.
FLOOR_SHAPES = ((576, 1536), (1536, 576), (1024, 2048), (2048, 1024), (1536, 1536))
FLOOR_BATCHES = (1, 16)
DECODE_CHUNK, DECODE_CHUNKS = 32, 4  # steps per compiled decode call; calls (first compiles)
PROMPT = 8
UNROLL = 8  # products per compiled call
MEASUREMENTS = 5
MIN_CALL_SECONDS = 0.02  # each measurement runs calls until about this long
# Budgets from the start: no matmul row starts after the first, no decode row after the
# second (an 8B-shaped row builds, quantizes and compiles a 32-layer model: a margin), no
# small-product row after the third. Rows left say so.
MATMUL_BUDGET_S, DECODE_BUDGET_S, FLOOR_BUDGET_S = 110.0, 260.0, 290.0
# The targets, as bf16 time / path time: (K = N, M, path, at least).
MATMUL_TARGETS = (
    (8192, 1, PATHS[3], 3.0),
    (8192, 16, PATHS[3], 2.5),
    (8192, 1, PATHS[4], 2.5),
    (8192, 4096, PATHS[1], 1.7),
    (8192, 4096, PATHS[3], 0.95),
    (8192, 4096, PATHS[4], 0.95),
)
# (model, weights, batch, at least, as tokens/s against bf16)
DECODE_TARGETS = (("Llama-3-8B", "int4 g128", 1, 2.5), ("SmolLM2-135M", "int4 g64", 1, 1.0))
# int4 tile candidates: weight_only_matmul keyword arguments ({}: the library's choice).
ROW_TILES = (
    {},
    {"split_k": 8},
    {"num_warps": 8},
    {"block_n": 64, "split_k": 8},
    {"block_n": 256, "num_warps": 8},
    {"body": "gemv", "block_n": 256, "block_k": 128, "split_k": 8, "num_warps": 8},
)
FEW_ROW_TILES = (
    {},
    {"split_k": 8},
    {"num_warps": 8},
)
SMALL_M_TILES = (
    {},
    {"split_k": 8},
    {"num_warps": 8},
)
MID_M_TILES = ({}, {"body": "xla"}, {"block_m": 64, "block_n": 128, "block_k": 64})
LARGE_M_TILES = ({}, {"body": "dot"})
# A candidate whose result is further than this from the float product (relative to its
# largest element) is refused, not timed: bfloat16 outputs round at about 4e-3.
MAX_ERROR = 2e-2
SMOKE = os.environ.get("LOWBIT_BENCH_SMOKE", "") not in ("", "0")
if SMOKE:
    # A quick check that this code runs (CPU: kernels interpreted), not a measurement.
    SIZES, BATCHES, UNROLL, MEASUREMENTS, MIN_CALL_SECONDS = (256,), (1, 16), 2, 1, 0.0
    ROTATE_BYTES = 1 << 16
    tiny = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)
    DECODE_MODELS = (("tiny", tiny, 256, (("bf16", None, None), ("int4 g64", 64, 0)), (1,)),)
    FLOOR_SHAPES, FLOOR_BATCHES = ((128, 256),), (1,)
    DECODE_CHUNK, DECODE_CHUNKS = 2, 2
    ROW_TILES, FEW_ROW_TILES = ROW_TILES[:2], FEW_ROW_TILES[:2]
    SMALL_M_TILES, MID_M_TILES = SMALL_M_TILES[:2], MID_M_TILES[:2]


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
    """A jitted `(x, copies, carry) -> carry` running `fn(x, w)` UNROLL times in sequence, w
    rotating over the weight's copies.

    The barriers make each product depend on the previous one's carry (no hoisting, no common
    subexpression) and keep XLA from shrinking a product to the one element read from it.
    """

    def run(x, copies, carry):
        for i in range(UNROLL):
            w = copies[i % len(copies)]
            x, w, carry = jax.lax.optimization_barrier((x, w, carry))
            y = fn(x, w)
            carry, y = jax.lax.optimization_barrier((carry, y))
            carry = carry + y[0, 0].astype(jnp.float32)
        return carry

    return jax.jit(run)


def _copies(w: Any) -> tuple:
    """`w` and copies of it in their own buffers: more than `ROTATE_BYTES` together (at most
    `UNROLL`), so back-to-back products read the weight from memory."""
    n = max(1, min(UNROLL, math.ceil(ROTATE_BYTES / _nbytes(w))))
    return (w,) + tuple(jax.tree.map(lambda a: jnp.array(a, copy=True), w) for _ in range(n - 1))


def _time_product(fn: Callable, x: jax.Array, copies: tuple) -> float:
    """Median seconds per product of `fn(x, w)` (compile and warm-up excluded)."""
    run = _repeated(fn)
    carry = jax.block_until_ready(run(x, copies, jnp.float32(0)))  # compiles
    start = time.perf_counter()
    carry = jax.block_until_ready(run(x, copies, carry))
    calls = max(1, min(200, int(MIN_CALL_SECONDS / max(time.perf_counter() - start, 1e-6))))
    samples = []
    for _ in range(MEASUREMENTS):
        start = time.perf_counter()
        for _ in range(calls):
            carry = run(x, copies, carry)
        jax.block_until_ready(carry)
        samples.append((time.perf_counter() - start) / (calls * UNROLL))
    return statistics.median(samples)


# --- weights ------------------------------------------------------------------------------------
def _weights(k: int, key: jax.Array) -> dict[str, tuple]:
    """Every path's weight for a [k, k] random matrix (quantized on the device), with copies.

    w8a8 and fp8 weights are stored [N, K] (scales [N, 1]), the layout cuBLASLt reads.
    """
    from lowbit.qarray import PerChannel, PerGroup, QuantConfig, quantize

    w = jax.random.normal(key, (k, k), jnp.float32) / np.sqrt(k)
    with_activation = lambda q, fmt: dataclasses.replace(q, activation=QuantConfig(format=fmt))
    rows = PerChannel((0,))  # of w.T [N, K]: one scale an output channel
    int4 = quantize(w, "int4", granularity=PerGroup(128, 0))
    out = {
        BASELINE: w.astype(jnp.bfloat16),
        PATHS[1]: with_activation(quantize(w.T, "int8", granularity=rows), "int8"),
        PATHS[2]: with_activation(quantize(w.T, "fp8_e4m3fn", granularity=rows), "fp8"),
        PATHS[3]: int4,
        PATHS[4]: quantize(w, "nf4", granularity=PerGroup(64, 0)),
        READ_ALONE: int4,
    }
    del w
    return {path: jax.block_until_ready(_copies(q)) for path, q in out.items()}


def _nbytes(w: Any) -> int:
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(w)))


def _product(path: str, tiles: dict | None = None) -> Callable:
    from lowbit.kernels import pallas

    if path == BASELINE:
        return lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if path == PATHS[1]:
        return lambda x, w: pallas.int8_matmul(x, w, contract_axis=1)
    if path == PATHS[2]:
        return lambda x, w: pallas.fp8_matmul(x, w, contract_axis=1)
    if path == READ_ALONE:
        return lambda x, w: jnp.sum(w.codes, axis=0, dtype=jnp.int32)[None, :]
    kwargs = dict(tiles or {})
    return lambda x, w: pallas.weight_only_matmul(x, w, interpret=not _has_gpu(), **kwargs)


def _tiles_label(m: int, w: Any, tiles: dict) -> str:
    from lowbit.kernels import pallas

    names = {"block_m": "m", "block_n": "n", "block_k": "k", "split_k": "split_k"}
    names |= {"num_warps": "num_warps", "num_stages": "num_stages"}
    want = pallas.Blocks(0, 0, 0, 0)
    want = dataclasses.replace(want, **{names[k]: v for k, v in tiles.items() if k in names})
    return str(pallas.blocks_for(w, m, want, body=tiles.get("body")))


def _int4_candidates(m: int) -> tuple[dict, ...]:
    if m == 1:
        return ROW_TILES
    if m <= 4:
        return FEW_ROW_TILES
    if m <= 64:
        return SMALL_M_TILES
    return MID_M_TILES if m < 1024 else LARGE_M_TILES


def _nf4_candidates(int4_tiles: dict | None) -> list[dict]:
    """int4's tiles with block_k capped at NF4's group of 64, then the library's choice."""
    if not int4_tiles:
        return [{}]
    tiles = dict(int4_tiles)
    if tiles.get("block_k", 0) > 64:
        tiles["block_k"] = 64
    return [tiles, {}]


def _check_error(fn: Callable, x: jax.Array, q: Any) -> None:
    """Raise if `fn(x, q)` is further than MAX_ERROR from the float32 product."""
    ref = jnp.dot(x.astype(jnp.float32), q.dequantize(jnp.float32), precision="highest")
    err = jnp.max(jnp.abs(fn(x, q).astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))
    if not float(err) <= MAX_ERROR:
        raise ValueError(f"relative error {float(err):.2e} > {MAX_ERROR}")


def _time_pallas(path: str, m: int, x: jax.Array, copies: tuple, candidates, deadline: float):
    """(seconds, tiles label, candidate) of the fastest candidate tiles that run; the label
    ends with the library's own choice when another won."""
    best: tuple[float, str, dict] | None = None
    errors, default = [], None
    for tiles in candidates:
        if best is not None and time.perf_counter() > deadline:
            break
        try:
            _check_error(_product(path, tiles), x, copies[0])
            seconds = _time_product(_product(path, tiles), x, copies)
        except Exception as e:  # a candidate Triton rejects: try the next one
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            print(f"[gpu] {path} M={m} tiles {tiles}: {errors[-1]}", file=sys.stderr, flush=True)
            continue
        label = _tiles_label(m, copies[0], tiles)
        print(f"[gpu] {path} M={m} {label}: {seconds * 1e3:.4f} ms", file=sys.stderr, flush=True)
        if not tiles:
            default = (seconds, label)
        if best is None or seconds < best[0]:
            best = (seconds, label, tiles)
    if best is None:
        raise RuntimeError("; ".join(errors) or "no candidate tiles")
    label = best[1]
    if default is not None and default[1] != best[1]:
        label += f" (default {default[1]}: {default[0] * 1e3:.4f} ms)"
    return best[0], label, best[2]


def _matmul_rows(deadline: float) -> list[Row]:
    rows = []
    key = jax.random.key(0)
    for k in SIZES:
        weights = _weights(k, key)
        for m in BATCHES:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            chosen: dict | None = None
            for path in PATHS:
                if path == READ_ALONE and m != 1:
                    continue
                stored = weights[path][0]
                read = stored.codes.nbytes if path == READ_ALONE else _nbytes(stored)
                row = Row(k, m, path, weight_bytes=read)
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


# --- Llama decode -------------------------------------------------------------------------------
def _llama_params(shape: dict, vocab: int, group: int | None):
    from flax import nnx

    import lowbit
    from lowbit.models import Decoder, DecoderConfig
    from lowbit.recipes import Recipe, matmul_rules

    config = DecoderConfig(vocab_size=vocab, **shape)
    model = Decoder(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.split(model)[1])
    if group is not None:
        recipe = Recipe(rules=matmul_rules("int4", group_size=group), name=f"int4 g{group}")
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


def _decode_rows(deadline: float) -> list[tuple[str, str, int, str]]:
    """(model, weights, batch, tok/s text) per decode row."""
    out = []
    from lowbit.ops import _accelerated

    floor = _accelerated.GPU_MIN_WEIGHT_ELEMENTS
    for name, shape, vocab, weights, batches in DECODE_MODELS:
        for label, group, min_elements in weights:
            _accelerated.GPU_MIN_WEIGHT_ELEMENTS = floor if min_elements is None else min_elements
            failed = "not measured (time budget)" if time.perf_counter() > deadline else ""
            model = params = None
            if not failed:
                try:
                    model, params = _llama_params(shape, vocab, group)
                except Exception as e:
                    failed = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            for batch in batches:
                if not failed and time.perf_counter() > deadline:
                    failed = "not measured (time budget)"
                if failed:
                    out.append((name, label, batch, failed))
                    continue
                try:
                    text = f"{_decode_tok_s(model, params, batch):.0f}"
                except Exception as e:
                    text = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                out.append((name, label, batch, text))
                print(f"[gpu] decode {name} {label} batch {batch}: {text}", file=sys.stderr)
            del model, params
    _accelerated.GPU_MIN_WEIGHT_ELEMENTS = floor
    return out


# --- small products: where the kernel starts to pay ----------------------------------------------
def _floor_rows(deadline: float) -> list[tuple[int, int, int, str, str]]:
    """(K, N, M, Pallas ms text, XLA ms text) for int4 g64 weights of FLOOR_SHAPES."""
    from lowbit.qarray import PerGroup, quantize

    out = []
    key = jax.random.key(2)
    xla = lambda x, w: jnp.dot(x, w.dequantize(x.dtype), preferred_element_type=jnp.float32)
    for k, n in FLOOR_SHAPES:
        w = jax.random.normal(key, (k, n), jnp.float32) / np.sqrt(k)
        copies = jax.block_until_ready(_copies(quantize(w, "int4", granularity=PerGroup(64, 0))))
        for m in FLOOR_BATCHES:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            pallas_ms = _timed_ms(_product(PATHS[3]), x, copies, deadline)
            xla_ms = _timed_ms(lambda x, w: xla(x, w).astype(x.dtype), x, copies, deadline)
            out.append((k, n, m, pallas_ms, xla_ms))
            print(f"[gpu] small {k}x{n} M={m}: {pallas_ms} / {xla_ms}", file=sys.stderr)
    return out


def _timed_ms(fn: Callable, x: Any, copies: tuple, deadline: float) -> str:
    """`_time_product` in ms as table text, or why it was not measured."""
    if time.perf_counter() > deadline:
        return "not measured (time budget)"
    try:
        return f"{_time_product(fn, x, copies) * 1e3:.4f}"
    except Exception as e:
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _floor_table(rows: list[tuple[int, int, int, str, str]]) -> list[str]:
    lines = [
        "| K x N | M | Pallas ms | XLA fused ms | XLA / Pallas |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k, n, m, ours, theirs in rows:
        numbers = ours.replace(".", "", 1).isdigit() and theirs.replace(".", "", 1).isdigit()
        ratio = f"{float(theirs) / float(ours):.2f}x" if numbers else ""
        lines.append(f"| {k} x {n} | {m} | {ours} | {theirs} | {ratio} |")
    return lines


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


def _decode_table(rows: list[tuple[str, str, int, str]]) -> list[str]:
    base = {(n, b): t for n, label, b, t in rows if label == "bf16"}
    lines = [
        "| model shape | weights | batch | decode tok/s (all rows) | vs bf16 |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, label, batch, text in rows:
        ref = base.get((name, batch), "")
        ratio = f"{int(text) / int(ref):.2f}x" if text.isdigit() and ref.isdigit() else ""
        lines.append(f"| {name} | {label} | {batch} | {text} | {ratio} |")
    return lines


def _device_line() -> str:
    if not _has_gpu():
        return "no GPU (default backend: " + jax.default_backend() + ")"
    device = jax.devices()[0]
    # The PJRT client's version string names the CUDA it was built for, where it has one.
    version = getattr(getattr(device, "client", None), "platform_version", "")
    return f"{device.device_kind}, JAX {jax.__version__}" + (f", {version}" if version else "")


def _report(
    matmuls: list[Row], floors: list, decode: list[tuple[str, str, int, str]], seconds: float
) -> str:
    from lowbit.kernels import pallas

    today = datetime.date.today().isoformat()
    models = "; ".join(
        f"{name} (dim {shape['dim']}, {shape['n_layers']} layers, {shape['n_heads']} heads / "
        f"{shape['n_kv_heads']} KV heads, ffn {shape['ffn_dim']}, vocab {vocab})"
        for name, shape, vocab, _, _ in DECODE_MODELS
    )
    lines = [
        "## GPU: quantized matmuls and decode",
        "",
        f"{today}, {_device_line()}; whole section {seconds:.0f} s"
        + (" (smoke run: interpreted kernels, not a measurement)" if SMOKE else "")
        + ". `python -m benchmarks gpu` (`benchmarks/gpu_check.sh`).",
        "",
        "`x [M, K] bf16 @ W [K, N]`. Median of "
        f"{MEASUREMENTS} measurements, each a run of back-to-back calls of {UNROLL} "
        f"products rotating over copies of the weight (more than {ROTATE_BYTES >> 20} MiB "
        "together, so no weight is read from the L2); TB/s = (weight bytes as stored + bf16 "
        "activation bytes) / time, TFLOP/s = 2 M K N / time, vs bf16 = bf16 time / this time "
        "at the same shape. w8a8 and fp8 include the per-token activation quantization, with "
        "the weight stored [N, K] (`contract_axis=1`); int4 / NF4 are `weight_only_matmul` "
        "(Pallas, Triton): `gemv` tiles are the GEMV body (`rows x block_n x block_k`), the "
        "others the dot body (`block_m x block_n x block_k`), then the K split, warps and "
        "stages; 'xla' is the body that dequantizes the weight in bf16 and runs XLA's dot "
        f"(the default from `XLA_MIN_ROWS` = {pallas.XLA_MIN_ROWS} rows). The fastest of the "
        "timed candidates is reported, with the library's default beside it when another "
        f"won; each candidate's result is checked against the float32 product first (at most "
        f"{MAX_ERROR} of its largest element).",
        "",
        *_matmul_table(matmuls),
        "",
        "Small products, where the kernel starts to pay: int4 g64 weights, the Pallas kernel "
        "(library's tiles) against XLA's fused dequantize-and-dot (`jnp.dot(x, "
        "q.dequantize())`, the engine's path for weights under `GPU_MIN_WEIGHT_ELEMENTS` = "
        f"{_floor_value()}), same timing:",
        "",
        *_floor_table(floors),
        "",
        f"Decode: {models}; random bf16 weights, `lowbit.models.stream_tokens`, {PROMPT}-token "
        f"prompts, {DECODE_CHUNK} steps per compiled call, timed over {DECODE_CHUNKS - 1} "
        "calls after the first. int4 is symmetric int4 weight-only on every linear layer in "
        "groups of the size named (embeddings in bf16). Quantized weights go through the "
        "engine's quantized `dot_general`: on CUDA, layers of at least "
        "`GPU_MIN_WEIGHT_ELEMENTS` run `weight_only_matmul` (Pallas), smaller ones (all of "
        "SmolLM2's) XLA's fused dequantize-and-dot.",
        "",
        *_decode_table(decode),
        "",
        "Targets (bf16 time / path time, or tokens/s against bf16):",
        "",
        *_targets(matmuls, decode),
    ]
    return "\n".join(lines) + "\n"


def _targets(matmuls: list[Row], decode: list[tuple[str, str, int, str]]) -> list[str]:
    """One line per target: the measured ratio to bf16 and met / MISSED, or not measured."""
    seconds = {(r.size, r.m, r.path): r.seconds for r in matmuls}
    lines = []
    for k, m, path, goal in MATMUL_TARGETS:
        ours, base = seconds.get((k, m, path)), seconds.get((k, m, BASELINE))
        result = "not measured"
        if ours and base:
            result = f"{base / ours:.2f}x: " + ("met" if base / ours >= goal else "MISSED")
        lines.append(f"- {path} at M = {m}, {k}²: >= {goal}x bf16: {result}")
    tok_s = {(name, label, b): text for name, label, b, text in decode}
    for name, label, batch, goal in DECODE_TARGETS:
        ours, base = tok_s.get((name, label, batch), ""), tok_s.get((name, "bf16", batch), "")
        result = "not measured"
        if ours.isdigit() and base.isdigit():
            ratio = int(ours) / int(base)
            result = f"{ratio:.2f}x: " + ("met" if ratio >= goal else "MISSED")
        lines.append(f"- decode, {name} shape, {label}, batch {batch}: >= {goal}x bf16: {result}")
    return lines


def _floor_value() -> int:
    from lowbit.ops import _accelerated

    return _accelerated.GPU_MIN_WEIGHT_ELEMENTS


def _not_measured(reason: str) -> tuple[list[Row], list, list[tuple[str, str, int, str]]]:
    rows = [Row(k, m, p, note=reason) for k in SIZES for m in BATCHES for p in PATHS]
    floors = [(k, n, m, reason, reason) for k, n in FLOOR_SHAPES for m in FLOOR_BATCHES]
    decode = [
        (name, label, b, reason)
        for name, _, _, weights, batches in DECODE_MODELS
        for label, _, _ in weights
        for b in batches
    ]
    return rows, floors, decode


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
    floors = _floor_rows(start + FLOOR_BUDGET_S)
    return _report(matmuls, floors, decode, time.perf_counter() - start)


if __name__ == "__main__":
    print(run())
