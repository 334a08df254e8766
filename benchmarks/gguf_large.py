"""Benchmark section: GGUF files of 1.5B and 8B shapes, lowbit against llama.cpp, with memory.

The files are llama.cpp's own: `benchmarks._big_gguf` writes an F16 file of the shape (random
N(0, 0.02^2) weights) and llama.cpp's quantizer makes each mix of it (Q4_K_M, Q5_K_M, Q6_K,
Q8_0, Q3_K_M, Q2_K: every per-tensor block type and every block's fit is llama.cpp's), as a user
downloads them. Each engine runs in a process of
its own, so its peak RSS is its own: load the file, prefill a prompt, decode greedily at batch 1
and batch 8. lowbit runs the path of `lowbit generate FILE` (recipe `gguf`: no float copy of the
model, the blocks multiplied on int8 activations as llama.cpp does), and the same with float
activations; llama.cpp (llama-cpp-python) through its C API (`generate._LlamaCpp`).

Streaming share: weight bytes read a token (the file's tensor bytes) x batch-1 tokens/s, against
the float32 GEMV's rate on weights larger than the L3 (`bandwidth.stream_gbps`), measured in the
same process right after its decode (its peak RSS read before), so the two rates share the
machine's conditions: on this shared machine the GEMV alone read 41 to 64 GB/s from one run to
the next.

Files: `LOWBIT_GGUF_LARGE=qwen2-1.5b,llama3-8b` (default: the 1.5B shape only; the 8B Q4_K_M
file is 4.6 GB, its F16 source 16 GB, and its runs take several minutes); a size is a Q4_K_M
file, `SIZE:MIX` another of `benchmarks.gguf_mixes.MIXES` (`qwen2-1.5b:Q6_K`), and
`SIZE:MIX:random` one of `_big_gguf.MIXES` written as random blocks with no F16 source and no
quantizer (quicker; the same block types, not llama.cpp's fits). Engines:
`LOWBIT_GGUF_LARGE_ENGINES`, separated by commas, or by ";" to name "lowbit, float act."
(default all of `ENGINES`; lowbit on float activations is the slow one).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from benchmarks._machine import cpu_model, xla_flags_note

PROMPT = 64
DECODE = 32
BATCHES = (1, 8)
# Each engine's process runs this many times, the engines in turn: on a shared machine whose
# speed moves over minutes, one slow phase then cannot fall on one engine's only run.
ROUNDS = 2
ENGINES = ("lowbit", "lowbit, float act.", "llama.cpp")


def _child(engine: str, path: str) -> None:
    """Runs in the measured process: prints one JSON line of tok/s per batch."""
    import numpy as np

    from benchmarks import generate as g

    g.DECODE = DECODE
    g.REPS = 2
    out: dict[str, object] = {}
    start = time.perf_counter()
    if engine.startswith("lowbit"):
        from flax import nnx

        from lowbit.ops import with_int8_activations
        from lowbit.serving import apply_recipe, load_model

        loaded = load_model(path, float_weights=False)
        params = apply_recipe(loaded, nnx.split(loaded.model)[1], "gguf")[0]
        if engine.endswith("float act."):
            params = with_int8_activations(params, enabled=False)
        runner = g._Lowbit(loaded.model, params)
        vocab = loaded.model.config.vocab_size
    else:
        runner = g._LlamaCpp(path, max(BATCHES), PROMPT + DECODE + 8)
        vocab = runner.n_vocab
    out["load_s"] = time.perf_counter() - start
    out["load_rss_mib"] = _peak_mib()  # the load's own peak, before any program is compiled
    rng = np.random.default_rng(0)
    for batch in BATCHES:
        prompts = rng.integers(100, min(vocab, 40000), (batch, PROMPT)).astype(np.int32)
        pre, dec = g.engine_seconds({"e": runner}, prompts)["e"]
        out[f"prefill_{batch}"] = batch * PROMPT / pre
        out[f"decode_{batch}"] = batch * DECODE / dec
    out["rss_mib"] = _peak_mib()
    from benchmarks import bandwidth

    out["stream_gbps"] = bandwidth.stream_gbps()
    print("RESULT " + json.dumps(out), flush=True)


def _peak_mib() -> float:
    """The process's own peak RSS so far (VmHWM), MiB: `ru_maxrss` from wait4 would also count
    the parent's memory at the fork, which Linux carries over into the child."""
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    return int(hwm.split()[1]) / 1024


def _measure(engine: str, path: str) -> dict:
    """Runs `_child` in its own process; its result, with that process's peak RSS (MiB)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from benchmarks.gguf_large import _child; _child({engine!r}, {path!r})",
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": root, "LOWBIT_COMPILATION_CACHE": "0"},
    )
    stdout, _ = proc.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}"}
    return json.loads(lines[-1][len("RESULT ") :])


def _best(runs: list[dict], weights: int) -> dict:
    """The fastest rates and load of an engine's runs, the highest peak RSS, and the streaming
    share of the run with the fastest batch-1 decode (against its own process's GEMV)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    best = {k: max(r[k] for r in runs) for k in runs[0]}
    best["load_s"] = min(r["load_s"] for r in runs)
    fastest = max(runs, key=lambda r: r["decode_1"])
    best["share"] = weights * fastest["decode_1"] / (fastest["stream_gbps"] * 1e9)
    best["streams"] = [r["stream_gbps"] for r in runs]
    return best


def _weight_bytes(path: str) -> int:
    from lowbit.gguf import read_gguf

    return sum(t.raw.nbytes for t in read_gguf(path).tensors.values())


def _file_entry(entry: str) -> tuple[str, str, str]:
    """`SIZE[:MIX[:random]]` -> (shape, mix, who makes the file: "llama.cpp" or "random")."""
    shape, mix, source = (*entry.split(":"), None, None)[:3]
    return shape, mix or "Q4_K_M", source or "llama.cpp"


def run() -> str | None:
    """Markdown: decode / prefill tok/s and peak RSS of each engine on each file."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from benchmarks._big_gguf import MIXES, SHAPES, write_gguf
    from benchmarks.gguf_mixes import MIXES as QUANTIZER_MIXES
    from benchmarks.mixes import quantize_llama_cpp
    from lowbit import kernels

    files = [
        _file_entry(entry) for entry in os.environ.get("LOWBIT_GGUF_LARGE", "qwen2-1.5b").split(",")
    ]
    for shape, mix, source in files:
        known = QUANTIZER_MIXES if source == "llama.cpp" else MIXES
        if shape not in SHAPES or source not in ("llama.cpp", "random") or mix not in known:
            raise ValueError(
                f"LOWBIT_GGUF_LARGE: {shape}:{mix}:{source}: SIZE[:MIX[:random]] with SIZE one "
                f"of {', '.join(SHAPES)} and MIX one of {', '.join(known)}"
            )
    # "lowbit, float act." holds a comma: a list naming it is separated by ";".
    raw = os.environ.get("LOWBIT_GGUF_LARGE_ENGINES")
    engines = ENGINES if raw is None else tuple(raw.split(";" if ";" in raw else ","))
    if set(engines) - set(ENGINES) or "llama.cpp" not in engines:
        raise ValueError(f"LOWBIT_GGUF_LARGE_ENGINES: some of {ENGINES}, llama.cpp included")
    mixes = " / ".join(dict.fromkeys(mix for _, mix, _ in files))
    sizes = " / ".join(dict.fromkeys(shape for shape, _, _ in files))
    lines = [f"## {mixes} files of {sizes} shapes: lowbit against llama.cpp, with peak memory"]
    lines.append("")
    rows = []
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        sources: dict[str, str] = {}  # shape -> its F16 file, written once
        for i, (shape, mix, source) in enumerate(files):
            path = os.path.join(tmp, f"{shape}-{mix}.gguf")
            if source == "random":
                write_gguf(path, shape, mix)
            else:
                if shape not in sources:
                    f16 = os.path.join(tmp, f"{shape}-F16.gguf")
                    sources[shape] = write_gguf(f16, shape, "F16")
                quantize_llama_cpp(sources[shape], path, mix)
                if all(s != shape or src == "random" for s, _, src in files[i + 1 :]):
                    os.remove(sources[shape])  # no later file is made from it
            size = os.path.getsize(path)
            weights = _weight_bytes(path)
            runs = {engine: [] for engine in engines}
            for _ in range(ROUNDS):
                for engine in engines:
                    runs[engine].append(_measure(engine, path))
            for engine in engines:
                name = f"{shape} {mix}" + (" (random blocks)" if source == "random" else "")
                rows.append((name, size, weights, engine, _best(runs[engine], weights)))
            os.remove(path)
    streams = [g for *_, r in rows for g in r.get("streams", ())]
    lines += [
        f"- Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_model()}, {os.cpu_count()} cores; "
        f"{kernels.status()}; llama-cpp-python {llama_cpp.__version__} (its CPU build: "
        f"{__import__('benchmarks.generate', fromlist=['x'])._llama_features(llama_cpp)})"
        + xla_flags_note()
        + ".",
        f"- Prompt {PROMPT} random tokens a row, then {DECODE} greedy tokens; best of 2 runs after "
        "a warm-up, each engine in its own process (peak RSS is that process's, loading "
        f"included), the engines' processes in turn {ROUNDS} times (the best rates of them, "
        "the highest peak RSS; load peak: the peak once the file is loaded and laid out, before "
        "any program is compiled). Stream share: the fastest batch-1 run's weight bytes a token x "
        "tokens/s over the float32 GEMV's rate (weights beyond the L3) measured in the same "
        "process right after it; the GEMV read "
        f"{min(streams, default=0):.1f}-{max(streams, default=0):.1f} GB/s over the run's "
        "processes. `"
        + "".join(
            f"{k}={shlex.quote(os.environ[k])} "
            for k in ("LOWBIT_GGUF_LARGE", "LOWBIT_GGUF_LARGE_ENGINES")
            if k in os.environ
        )
        + "python -m benchmarks gguf_large`.",
        "",
        "| file | engine | load s | prefill tok/s | decode b1 tok/s | x llama.cpp | stream share "
        "| decode b8 tok/s | x llama.cpp | load peak MiB | peak RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    peer = {s: r for s, _, _, e, r in rows if e == "llama.cpp"}
    for shape, size, _weights, engine, r in rows:
        if "error" in r:
            lines.append(f"| {shape} ({size / 2**30:.2f} GiB) | {engine} | {r['error']} ||||||||")
            continue
        p = peer.get(shape, {})

        def ratio(key: str, r=r, p=p) -> str:
            return f"{r[key] / p[key]:.2f}x" if key in p else "-"

        share = r["share"]
        lines.append(
            f"| {shape} ({size / 2**30:.2f} GiB) | {engine} | {r['load_s']:.1f} | "
            f"{r['prefill_1']:.1f} | {r['decode_1']:.2f} | {ratio('decode_1')} | {share:.0%} | "
            f"{r['decode_8']:.2f} | {ratio('decode_8')} | {r['load_rss_mib']:.0f} | "
            f"{r['rss_mib']:.0f} |"
        )
    lines += ["", f"Section time: {time.perf_counter() - begin:.0f} s.", ""]
    return "\n".join(lines)


def not_measured() -> str:
    return "llama-cpp-python is not importable: run in the bench environment (`make bench-env`)."
