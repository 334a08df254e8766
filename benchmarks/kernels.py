"""CPU kernel benchmark: quantized linear layers against XLA's float32 `jnp.dot`.

Shapes: K = N in {4096, 8192}, M in {1, 8, 64, 512}. Every kernel and the float32 baseline
are timed in the same process run, so ratios are like for like. Run with
`python -m benchmarks kernels`.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._machine import cpu_model
from benchmarks._timing import best_time
from lowbit import kernels

SIZES = (4096, 8192)
BATCHES = (1, 8, 64, 512)
# Small layers (SmolLM2-135M's MLP), timed at M = 1 for the bandwidth table only.
SMALL = ((576, 1536), (1536, 576))
# name -> (kind, group_size). "uint4" is asymmetric int4 (a float zero point per group);
# MXFP4 runs as fp4 E2M1 codes with its E8M0 block scales decoded to float32, group 32.
WEIGHT_ONLY = {
    "int8": ("int8", None),
    "int4 g32": ("int4", 32),
    "int4 g64": ("int4", 64),
    "int4 g128": ("int4", 128),
    "uint4 g32": ("uint4", 32),
    "uint4 g128": ("uint4", 128),
    "nf4 g64": ("nf4", 64),
    "mxfp4": ("fp4", 32),
    "fp8": ("fp8", None),
}
# int4 weights (group 128) x dynamic int8 activations.
W4A8 = "w4a8 g128"
# Linear K = N for the torchao comparison, and the MLP anchor (d_model, d_ffn, layers, tokens).
PEER_SIZE = 4096
MLP = (1024, 4096, 4, 512)
# LOWBIT_BENCH_SMOKE=1 shrinks every shape and repeat count: a quick check that the benchmark
# code runs (the 1-thread peer subprocess inherits it), not a measurement.
if os.environ.get("LOWBIT_BENCH_SMOKE", "") not in ("", "0"):
    SIZES, SMALL, PEER_SIZE, MLP = (256, 512), ((96, 160), (160, 96)), 256, (128, 256, 2, 64)
MIN_SECONDS = 0.6  # per measurement: repeat until this much time has passed...
MIN_REPS, MAX_REPS = 2, 30  # ...within these bounds; the minimum is reported
if os.environ.get("LOWBIT_BENCH_SMOKE", "") not in ("", "0"):
    MIN_SECONDS, MIN_REPS, MAX_REPS = 0.01, 1, 2
TORCH_BUDGET_S = 2.0  # torch._int_mm calls slower than this end its column


def _time(fn: Callable[[], object]) -> float:
    """Best wall time of fn() in seconds (after one warm-up call)."""
    return best_time(fn, min_seconds=MIN_SECONDS, min_reps=MIN_REPS, max_reps=MAX_REPS)


def _bandwidth() -> tuple[float, float]:
    """(numpy copyto GB/s counting read + write, jitted XLA sum GB/s counting reads) on 256 MiB.

    A decode GEMV only reads its weight stream, so the read figure is the one to compare with.
    """
    src = np.random.default_rng(0).standard_normal(64 << 20).astype(np.float32)
    dst = np.empty_like(src)
    copy_s = _time(lambda: np.copyto(dst, src))
    a = jnp.asarray(src)
    total = jax.jit(jnp.sum)
    read_s = _time(lambda: total(a))
    return 2 * src.nbytes / copy_s / 1e9, src.nbytes / read_s / 1e9


def _weights(
    k: int, n: int, rng: np.random.Generator, names=None
) -> dict[str, kernels.PreparedWeight]:
    out = {}
    nibbles = jnp.asarray(rng.integers(0, 16, (k, n), dtype=np.uint8))
    int8 = jnp.asarray(rng.integers(-127, 128, (k, n), dtype=np.int8))
    for name, (kind, gs) in WEIGHT_ONLY.items():
        if names is not None and name not in names:
            continue
        groups = 1 if gs is None else -(-k // gs)
        scale = jnp.asarray(rng.uniform(0.001, 0.01, (groups, n)).astype(np.float32))
        zp = jnp.full((groups, n), 7.5, jnp.float32) if kind == "uint4" else None
        if kind == "int8":
            codes = int8
        elif kind == "fp8":
            codes = int8.astype(jnp.float8_e4m3fn)
        else:
            codes = nibbles
        out[name] = jax.block_until_ready(kernels.pack(kind, codes, scale, zp, gs))
    if names is None or "w8a8" in names:
        scale = jnp.asarray(rng.uniform(0.001, 0.01, (1, n)).astype(np.float32))
        out["w8a8"] = jax.block_until_ready(kernels.pack("w8a8", int8, scale))
    if names is None or W4A8 in names:
        scale = jnp.asarray(rng.uniform(0.001, 0.01, (-(-k // 128), n)).astype(np.float32))
        out[W4A8] = jax.block_until_ready(kernels.pack("w4a8", nibbles, scale, None, 128))
    return out


def _weight_bytes(w: kernels.PreparedWeight) -> int:
    return sum(int(a.nbytes) for a in (w.data, w.scale, w.colsum) if a is not None)


def _torch():
    """The torch module if importable (optional: only for a `torch._int_mm` column)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _time_torch(torch, x: jax.Array, w: kernels.PreparedWeight, skip: bool) -> float:
    """Time of torch._int_mm on the same int8 operands (NaN when skipped or unsupported).

    On CPU it may fall back to a slow generic path: one timed call is enough to show that.
    """
    if skip:
        return float("nan")
    tw = torch.from_numpy(np.array(kernels.prepared_to_logical(w)["codes"]))
    tx = torch.from_numpy(np.array(kernels.quantize_per_token(x)[0]))
    try:
        start = time.perf_counter()
        torch._int_mm(tx, tw)
        first = time.perf_counter() - start
        if first > TORCH_BUDGET_S / 4:
            return first
        return _time(lambda: torch._int_mm(tx, tw))
    except RuntimeError:
        return float("nan")


def run() -> str:
    rng = np.random.default_rng(0)
    copy_bw, read_bw = _bandwidth()
    bw = max(copy_bw, read_bw)
    torch = _torch()
    names = ["f32 jnp.dot", *WEIGHT_ONLY, "w8a8", W4A8] + (["torch._int_mm"] if torch else [])
    dot = jax.jit(jnp.dot)
    wo = jax.jit(kernels.weight_only_linear)
    q8 = jax.jit(kernels.w8a8_linear)
    q4 = jax.jit(kernels.w4a8_linear)
    results: dict[tuple[int, int], dict[str, float]] = {}
    wbytes: dict[tuple[int, str], int] = {}
    slow = False  # torch._int_mm has been too slow already: skip its larger shapes
    for k in SIZES:
        wf = jnp.asarray(rng.standard_normal((k, k), dtype=np.float32))
        ws = _weights(k, k, rng)
        wbytes[(k, "f32 jnp.dot")] = int(wf.nbytes)
        for name, w in ws.items():
            wbytes[(k, name)] = _weight_bytes(w)
        for m in BATCHES:
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            row = {"f32 jnp.dot": _time(lambda x=x, wf=wf: dot(x, wf))}
            for name in WEIGHT_ONLY:
                row[name] = _time(lambda x=x, w=ws[name]: wo(x, w))
            row["w8a8"] = _time(lambda x=x, w=ws["w8a8"]: q8(x, w))
            row[W4A8] = _time(lambda x=x, w=ws[W4A8]: q4(x, w))
            if torch is not None:
                row["torch._int_mm"] = _time_torch(torch, x, ws["w8a8"], slow)
                slow = slow or row["torch._int_mm"] > TORCH_BUDGET_S
            results[(k, m)] = row
            print(
                f"[kernels] K=N={k} M={m}: "
                + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in row.items()),
                flush=True,
            )
    small = _small_layers(rng, wo, wbytes)
    report = _report(results, wbytes, names, copy_bw, read_bw, bw, small)
    return report + _peer_report(rng)


def _small_layers(rng, wo, wbytes) -> dict[tuple[int, int], dict[str, float]]:
    """M = 1 times of every weight-only kind on the small layer shapes."""
    out = {}
    for k, n in SMALL:
        ws = _weights(k, n, rng, names=WEIGHT_ONLY)
        x = jnp.asarray(rng.standard_normal((1, k), dtype=np.float32))
        out[(k, n)] = {name: _time(lambda w=w, x=x: wo(x, w)) for name, w in ws.items()}
        for name, w in ws.items():
            wbytes[((k, n), name)] = _weight_bytes(w)
    return out


def _fmt(t: float, base: float) -> str:
    if np.isnan(t):
        return "n/a"
    ratio = base / t
    return f"{t * 1e3:.2f} ({ratio:.1f}x)" if ratio >= 0.1 else f"{t * 1e3:.2f} ({ratio:.2g}x)"


def _report(results, wbytes, names, copy_bw, read_bw, bw, small) -> str:
    threads = os.cpu_count()
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    lines = [
        "## CPU kernels (`benchmarks/kernels.py`)",
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {cpu_model()}, {threads} cores; jax {jax.__version__}",
        f"- {kernels.status()}",
        f"- Load average when the run ended: {load} (shared machine: absolute times are noisy,"
        " ratios are taken within the same run)",
        f"- Memory bandwidth on 256 MiB: numpy `copyto` {copy_bw:.1f} GB/s (read + write),"
        f" jitted `jnp.sum` {read_bw:.1f} GB/s (read)",
        "",
        "Best wall time in ms, speed-up over XLA float32 `jnp.dot` of the same shape in"
        " parentheses (inputs float32, outputs float32).",
        "",
    ]
    for k in SIZES:
        lines += [f"### K = N = {k}", ""]
        lines.append("| M | " + " | ".join(names) + " |")
        lines.append("|---" * (len(names) + 1) + "|")
        for m in BATCHES:
            row = results[(k, m)]
            base = row["f32 jnp.dot"]
            cells = [f"{base * 1e3:.2f}"] + [_fmt(row[n], base) for n in names[1:]]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "### Decode (M = 1) against memory bandwidth",
        "",
        "Weight bytes streamed per call (packed weight incl. scales) divided by the call time,"
        f" and that as a share of the better bandwidth figure above ({bw:.1f} GB/s).",
        "",
        "| kernel | "
        + " | ".join(f"K=N={k}: MB, GB/s, % of bw" for k in SIZES)
        + " | "
        + " | ".join(f"{k}x{n}: us, % of bw" for k, n in SMALL)
        + " |",
        "|---" * (len(SIZES) + len(SMALL) + 1) + "|",
    ]
    for name in [n for n in names if n != "torch._int_mm"]:
        cells = []
        for k in SIZES:
            nbytes, t = wbytes[(k, name)], results[(k, 1)][name]
            cells.append(
                f"{nbytes / 1e6:.0f}, {nbytes / t / 1e9:.1f}, {100 * nbytes / t / 1e9 / bw:.0f}%"
            )
        for shape in SMALL:
            if name in small[shape]:
                nbytes, t = wbytes[(shape, name)], small[shape][name]
                cells.append(f"{t * 1e6:.0f}, {100 * nbytes / t / 1e9 / bw:.0f}%")
            else:
                cells.append("")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "### Targets", ""] + _targets(results) + _bw_targets(results, wbytes, small, bw)
    lines += ["", "### Notes", ""] + _notes(results, "torch._int_mm" in names)
    return "\n".join(lines) + "\n"


def _notes(results, with_torch: bool) -> list[str]:
    active = kernels.status().split("isa=")[-1].split(" ")[0]
    notes = [
        f"- Paths that ran: `{active}`."
        + (
            " w8a8 on AMX-INT8 tiles (`tdpbusd`, 16 x 16 x 64 per instruction); weight-only"
            " kinds on the AVX-512 VNNI path's code (4-bit codes decoded by `vpermps` table"
            " lookups, 8-bit by widening converts)."
            if active == "amx"
            else ""
        ),
        "- Weight-only kernels unpack codes in registers for M <= 16 (decode). For larger M"
        " they dequantize a 512-deep K block of 32 columns into cache once per 128 rows and run"
        " a float32 register-tiled GEMM over it, so at M = 512 they are bounded by the same FMA"
        " throughput as float32 and land near 1x: their purpose there is not materializing the"
        " full float weight, the speed-up is at decode sizes where the weight stream dominates.",
        "- Decode with float32 activations costs three 512-bit operations per 16 weights (widen"
        " the codes, look up or convert, multiply-add), and AVX-512 issues two per cycle: about"
        " 5 bytes of 4-bit codes (10 of 8-bit codes) per cycle and core, near this machine's"
        " read bandwidth, so M = 1 is compute bound here as much as memory bound. Shares above"
        " 100% mean the weight came from cache: this VM reports 4 MiB of L2 per core and a"
        " 480 MiB L3, so the 4096^2 weights (9-17 MB) are cache resident between calls while"
        " the bandwidth probe reads 256 MiB.",
    ]
    if active in ("avx512bw", "avx2", "scalar"):
        notes.append(
            "- w8a8 on this CPU: no VNNI. Exact u8 x s8 products without VNNI need int16"
            " `vpmaddwd` plus an add, while `vpmaddubsw` can saturate with 8-bit activations;"
            " its gains come from the 4x smaller weight stream (decode, small M)."
        )
    notes.append(
        "- The machine was shared with other jobs during the run (see load average): times are"
        " best-of-N wall clock, and compute-bound kernels suffer more from CPU contention than"
        " the bandwidth-bound float32 GEMV, so ratios at M = 1 understate an idle machine."
    )
    if with_torch:
        notes.append(
            "- torch._int_mm (torch CPU wheel): n/a means skipped after a call took over"
            f" {TORCH_BUDGET_S:g} s at a smaller shape (its CPU path is not a tuned GEMM)."
        )
    return notes


def _speedup(results, k: int, m: int, name: str) -> float:
    row = results[(k, m)]
    return row["f32 jnp.dot"] / row[name]


def _targets(results) -> list[str]:
    out = []

    def check(label: str, values: dict[str, float], goal: float) -> None:
        met = all(v >= goal for v in values.values())
        detail = ", ".join(f"{where} {v:.1f}x" for where, v in values.items())
        out.append(f"- {label} (goal >= {goal:g}x): **{'met' if met else 'NOT met'}** ({detail})")

    big = max(SIZES)
    check(
        f"int4 weight-only, M=1, {big}^2",
        {name: _speedup(results, big, 1, name) for name in ("int4 g64", "int4 g128")},
        5.0,
    )
    check("int8 weight-only, M=1", {f"{k}^2": _speedup(results, k, 1, "int8") for k in SIZES}, 2.5)
    check(
        "w8a8, M >= 64",
        {
            f"{k}^2 M={m}": _speedup(results, k, m, "w8a8")
            for k in SIZES
            for m in BATCHES
            if m >= 64
        },
        3.0,
    )
    m = BATCHES[-1]
    ratios = {f"{name} {k}^2": _speedup(results, k, m, name) for k in SIZES for name in WEIGHT_ONLY}
    worst = min(ratios, key=ratios.get)
    ok = ratios[worst] >= 1.0
    out.append(
        f"- weight-only, M={m} (goal >= 1x float32): **{'met' if ok else 'NOT met'}** (lowest:"
        f" {worst} {ratios[worst]:.2f}x, highest: {max(ratios.values()):.2f}x)"
    )
    return out


def _bw_targets(results, wbytes, small, bw) -> list[str]:
    """Decode (M = 1) share of the read bandwidth: >= 60% at K = N sizes, >= 50% small."""
    out = []
    big = [(k, results[(k, 1)]) for k in SIZES]
    for label, goal, cases in (
        ("M=1 weight-only, K=N in " + "/".join(map(str, SIZES)), 60, big),
        ("M=1 weight-only, " + " and ".join(f"{k}x{n}" for k, n in SMALL), 50, list(small.items())),
    ):
        shares = {
            f"{name} {where if isinstance(where, int) else 'x'.join(map(str, where))}": 100
            * wbytes[(where, name)]
            / row[name]
            / 1e9
            / bw
            for where, row in cases
            for name in WEIGHT_ONLY
        }
        worst = min(shares, key=shares.get)
        met = shares[worst] >= goal
        out.append(
            f"- {label} (goal >= {goal}% of {bw:.1f} GB/s): **{'met' if met else 'NOT met'}**"
            f" (lowest: {worst} {shares[worst]:.0f}%)"
        )
    return out


def _peer_report(rng: np.random.Generator) -> str:
    """torchao beside lowbit: linear K = N = PEER_SIZE at every M, and the MLP anchor.

    Measured twice: in this process with every core, and in a subprocess with one thread on
    each side (lowbit's pool, XLA's own ops, torch), which a loaded machine distorts less.
    """
    from benchmarks import _torchao

    if _torchao.load() is None:
        return (
            "\n### Against torchao\n\nSkipped: torch / torchao are not importable here"
            " (`make bench` installs them in .venv-bench).\n"
        )
    threads = os.cpu_count() or 1
    runs = {f"{threads} threads": _peer_measure(rng)}
    load_all = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    one = _peer_measure_single_thread()
    if one is not None:
        runs["1 thread"] = one
    load_one = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    k = PEER_SIZE
    d, f, layers, tokens = MLP
    lines = [
        "",
        f"### Against torchao ({_torchao.version()})",
        "",
        "lowbit and torchao timed back to back for each cell in one process; load average"
        f" after the {threads}-thread run: {load_all}, after the 1-thread run: {load_one}."
        " torchao models are `torch.compile`d; its int4 and int8 weight-only CPU paths take"
        " bfloat16 activations, w8a8 and float32 take float32. Cells: lowbit ms / torchao ms"
        " (torchao time / lowbit time: above 1 means lowbit is faster). On a loaded machine"
        " torch's OpenMP regions wait for descheduled threads at every barrier while lowbit's"
        " workers claim chunks dynamically, which widens the multi-thread gap in lowbit's"
        " favour; the 1-thread tables have no barriers and are the fairer comparison there."
        " torchao's int8-activation x int4-weight CPU kernel (`da8w4_linear_cpu`) is not"
        " built into its wheel, so lowbit's w4a8 has no torchao row.",
    ]
    for run_name, res in runs.items():
        linear, mlp = res["linear"], res["mlp"]
        lines += [
            "",
            f"Linear {k} x {k}, {run_name}:",
            "",
            "| lowbit vs torchao | " + " | ".join(f"M = {m}" for m in BATCHES) + " |",
            "|---" * (len(BATCHES) + 1) + "|",
        ]
        for label in res["labels"]:
            cells = []
            for m in BATCHES:
                ours, theirs = linear[f"{label}|{m}"]
                cells.append(f"{ours * 1e3:.3f} / {theirs * 1e3:.3f} ({theirs / ours:.2f}x)")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += [
            "",
            f"{layers}-layer MLP (d = {d}, ffn = {f}, SiLU; weights only, no norms), {run_name}:"
            f" decode is one token per call (M = 1), prefill {tokens} tokens per call."
            " Tokens per second.",
            "",
            "| weights | lowbit decode | torchao decode | ratio | lowbit prefill |"
            " torchao prefill | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, (dec, tdec, pre, tpre) in mlp.items():
            if tdec is None:
                lines.append(f"| {label} | {1 / dec:.0f} | n/a | | {tokens / pre:.0f} | n/a | |")
                continue
            lines.append(
                f"| {label} | {1 / dec:.0f} | {1 / tdec:.0f} | {tdec / dec:.2f}x"
                f" | {tokens / pre:.0f} | {tokens / tpre:.0f} | {tpre / pre:.2f}x |"
            )
        lines += ["", f"Peer targets, {run_name}:", ""]
        i4 = linear["int4 g128 weight-only|1"]
        q8m = linear[f"w8a8 (dynamic int8 activations)|{BATCHES[-1]}"]
        mlp4 = mlp["int4 g128"]
        for text, ok in (
            (f"int4 g128 GEMV {k}^2 M=1 <= torchao's time: {i4[1] / i4[0]:.2f}x", i4[0] <= i4[1]),
            (f"MLP int4 decode >= torchao's tok/s: {mlp4[1] / mlp4[0]:.2f}x", mlp4[0] <= mlp4[1]),
            (f"w8a8 M={BATCHES[-1]} >= 1.0x torchao: {q8m[1] / q8m[0]:.2f}x", q8m[0] <= q8m[1]),
        ):
            lines.append(f"- {text}: **{'met' if ok else 'NOT met'}**")
    return "\n".join(lines) + "\n"


def _peer_measure_single_thread() -> dict | None:
    """`_peer_measure` in a subprocess with one thread for lowbit, XLA and torch."""
    env = dict(
        os.environ,
        LOWBIT_NUM_THREADS="1",
        OMP_NUM_THREADS="1",
        XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
            " intra_op_parallelism_threads=1"
        ).strip(),
    )
    code = (
        "import json, numpy as np; from benchmarks import kernels;"
        " print('PEERS ' + json.dumps(kernels._peer_measure(np.random.default_rng(1))))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
    )
    for line in out.stdout.splitlines():
        if line.startswith("PEERS "):
            return json.loads(line[len("PEERS ") :])
    print(f"[kernels] 1-thread peer run failed:\n{out.stderr[-2000:]}", flush=True)
    return None


def _peer_measure(rng: np.random.Generator) -> dict:
    """{"labels": [...], "linear": {"label|M": (lowbit s, torchao s)}, "mlp": {...}}."""
    from benchmarks import _torchao

    _torchao.load()
    k = PEER_SIZE
    lowbit_w = _weights(k, k, rng, names=("int8", "int4 g128", "w8a8"))
    wf = jnp.asarray(rng.standard_normal((k, k), dtype=np.float32))
    dot = jax.jit(jnp.dot)
    wo = jax.jit(kernels.weight_only_linear)
    q8 = jax.jit(kernels.w8a8_linear)
    # (label, lowbit fn(x), lowbit activation dtype, torchao peer)
    pairs = [
        ("float32", lambda x: dot(x, wf), jnp.float32, "torch f32"),
        (
            "int4 g128 weight-only",
            lambda x: wo(x, lowbit_w["int4 g128"]),
            jnp.float32,
            "torchao int4 g128",
        ),
        (
            "int4 g128 weight-only, bf16 in/out",
            lambda x: wo(x, lowbit_w["int4 g128"]),
            jnp.bfloat16,
            "torchao int4 g128",
        ),
        ("int8 weight-only", lambda x: wo(x, lowbit_w["int8"]), jnp.float32, "torchao int8"),
        (
            "w8a8 (dynamic int8 activations)",
            lambda x: q8(x, lowbit_w["w8a8"]),
            jnp.float32,
            "torchao w8a8",
        ),
    ]
    peers = {p: _torchao.build(p, [(k, k)]) for p in {pair[3] for pair in pairs}}
    linear: dict[str, tuple[float, float]] = {}
    for m in BATCHES:
        for label, fn, dtype, peer in pairs:
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(dtype)
            tfn, tin = peers[peer]
            tx = tin(m)
            ours = _time(lambda fn=fn, x=x: fn(x))
            theirs = _time(lambda tfn=tfn, tx=tx: tfn(tx))
            linear[f"{label}|{m}"] = (ours, theirs)
            print(
                f"[kernels] torchao K=N={k} M={m} {label}: lowbit {ours * 1e3:.3f} ms,"
                f" {peer} {theirs * 1e3:.3f} ms",
                flush=True,
            )
    return {"labels": [p[0] for p in pairs], "linear": linear, "mlp": _mlp_rows(rng)}


def _mlp_rows(rng: np.random.Generator) -> dict[str, tuple]:
    """(lowbit decode s, torchao decode s, lowbit prefill s, torchao prefill s) per weight type
    (torchao None where it has no peer)."""
    from benchmarks import _torchao

    d, f, layers, tokens = MLP
    widths = [(d, f), (f, d)] * layers
    setups = {
        "float32": ("f32", "torch f32", jnp.float32),
        "int4 g128": ("int4 g128", "torchao int4 g128", jnp.float32),
        "int8 weight-only": ("int8", "torchao int8", jnp.float32),
        "w8a8": ("w8a8", "torchao w8a8", jnp.float32),
        "w4a8 g128": (W4A8, None, jnp.float32),
    }
    out = {}
    for label, (name, peer, dtype) in setups.items():
        ws = []
        for k, n in widths:
            if name == "f32":
                ws.append(jnp.asarray(rng.standard_normal((k, n), dtype=np.float32) / k**0.5))
            elif name == "w8a8":
                codes = jnp.asarray(rng.integers(-127, 128, (k, n), dtype=np.int8))
                scale = jnp.full((1, n), 0.01, jnp.float32)
                ws.append(kernels.pack("w8a8", codes, scale))
            else:
                ws.append(_weights(k, n, rng, names=(name,))[name])

        def mlp(x, ws=ws, name=name):
            for i, w in enumerate(ws):
                if i:
                    x = jax.nn.silu(x)
                if name == "f32":
                    x = jnp.dot(x, w)
                elif name == "w8a8":
                    x = kernels.w8a8_linear(x, w)
                elif name == W4A8:
                    x = kernels.w4a8_linear(x, w)
                else:
                    x = kernels.weight_only_linear(x, w)
            return x

        fn = jax.jit(mlp)
        tfn, tin = _torchao.build(peer, widths) if peer else (None, None)
        times = []
        for m in (1, tokens):
            x = jnp.asarray(rng.standard_normal((m, d), dtype=np.float32)).astype(dtype)
            times.append(_time(lambda x=x, fn=fn: fn(x)))
            if tfn is None:
                times.append(None)
                continue
            tx = tin(m)
            times.append(_time(lambda tx=tx, tfn=tfn: tfn(tx)))
        out[label] = tuple(times)
        print(f"[kernels] MLP {label}: {times}", flush=True)
    return out
