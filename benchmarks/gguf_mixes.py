"""Benchmark section: llama.cpp's own K-quant mixes, run by lowbit and by llama.cpp.

SmolLM2's float weights (the bundled asset dequantized) are exported as an F16 GGUF file, and
llama.cpp's quantizer (`llama_model_quantize`, llama-cpp-python) makes Q2_K, Q3_K_M, Q4_K_M,
Q5_K_M, Q6_K and Q8_0 files from it: the files people download, each a mix of types (Q4_K_M:
Q4_K, Q6_K and, where a row is not whole 256-blocks, Q5_0 / Q8_0). Each file is loaded the way
`lowbit generate FILE` loads it (`load_model`, recipe `gguf`: every quantized tensor kept as
its blocks, run by its own type's kernel) and decoded greedily, batch 1 and 8, beside
llama.cpp on the same file in the same process, interleaved (`generate.engine_seconds`).

Perplexity: each file scored by lowbit (both arithmetics) and by llama.cpp on the same token
ids (`PPL_TOKENS` tokens of the default speeches, windows of 512, no BOS; llama.cpp through
`benchmarks.gguf._llama_ppl`, logits of every position).

Rows: lowbit as `lowbit generate FILE` runs it (every quantized tensor on int8 activations in
llama.cpp's Q8_0 / Q8_K blocks, as llama.cpp multiplies it: the block types, and the Q4_0 /
Q4_1 / Q8_0 tensors imported as int4 / uint4 / int8 weights in groups of 32), the same with
float activations everywhere (`with_int8_activations(params, enabled=False)`), and llama.cpp.
"""

from __future__ import annotations

import collections
import os
import tempfile
import time

from flax import nnx

from benchmarks._machine import cpu_model, xla_flags_note

MIXES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
BATCHES = (1, 8)
PROMPT = {1: 128, 8: 32}
PPL_TOKENS = 4096


def make_mixes(directory: str, mixes=MIXES) -> dict[str, str]:
    """{mix: path} of SmolLM2 GGUF files made by llama.cpp's quantizer from an F16 export."""
    from benchmarks.mixes import quantize_llama_cpp
    from lowbit.io import export_gguf
    from lowbit.models import smollm2_gguf_path
    from lowbit.serving import load_model

    loaded = load_model("smollm2")
    pure = nnx.to_pure_dict(nnx.split(loaded.model)[1])
    f16 = os.path.join(directory, "smollm2-f16.gguf")
    export_gguf(
        pure, f16, config=loaded.model.config, type="F16", source=str(smollm2_gguf_path()), log=None
    )
    paths = {}
    for mix in mixes:
        paths[mix] = os.path.join(directory, f"smollm2-{mix}.gguf")
        quantize_llama_cpp(f16, paths[mix], mix)
    return paths


def _types(path: str) -> str:
    from lowbit.gguf import read_gguf

    counts = collections.Counter(t.ggml_type.name for t in read_gguf(path).tensors.values())
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


def run() -> str | None:
    """Markdown: decode tok/s of lowbit and llama.cpp on each mix, batch 1 and 8."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from benchmarks import generate as g
    from benchmarks import gguf as round_trip
    from lowbit import kernels
    from lowbit.eval._session import ModelSession
    from lowbit.models import has_smollm2
    from lowbit.ops import with_int8_activations
    from lowbit.serving import apply_recipe, load_model

    if not has_smollm2():
        return None
    g.PROMPT = PROMPT
    lines = ["## llama.cpp's K-quant mixes of SmolLM2-135M, lowbit against llama.cpp", ""]
    rows, ppl = [], []
    round_trip.MAX_TOKENS = PPL_TOKENS
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for mix, path in make_mixes(tmp).items():
            loaded = load_model(path)
            params = apply_recipe(loaded, nnx.split(loaded.model)[1], "gguf")[0]
            engines = {
                "lowbit": g._Lowbit(loaded.model, params),
                "lowbit, float act.": g._Lowbit(
                    loaded.model, with_int8_activations(params, enabled=False)
                ),
                "llama.cpp": g._LlamaCpp(path, max(BATCHES), max(PROMPT.values()) + g.DECODE + 8),
            }
            for batch in BATCHES:
                prompts = g._prompts(loaded.tokenizer, batch, PROMPT[batch])
                for name, (pre, dec) in g.engine_seconds(engines, prompts).items():
                    rows.append((mix, name, batch, prompts.size / pre, batch * g.DECODE / dec))
            engines["llama.cpp"].close()
            rows.append((mix, "types", 0, _types(path), os.path.getsize(path)))
            session = ModelSession(loaded, context=round_trip.CONTEXT, max_tokens=PPL_TOKENS)
            ppl.append(
                (
                    mix,
                    session.quality(engines["lowbit"].params)[0],
                    session.quality(engines["lowbit, float act."].params)[0],
                    round_trip._llama_ppl(path, session.tokens()),
                )
            )
            del engines, params, loaded
    load = os.getloadavg()
    lines += [
        f"- Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_model()}, {os.cpu_count()} cores; "
        f"{kernels.status()}; load average at the end {', '.join(f'{x:.1f}' for x in load)}"
        + xla_flags_note()
        + ".",
        f"- Peer: llama.cpp (llama-cpp-python {llama_cpp.__version__}, {g.THREADS} threads; its "
        f"CPU build: {g._llama_features(llama_cpp)}).",
        f"- Prompts: batch 1 x {PROMPT[1]}, batch 8 x {PROMPT[8]} tokens; then {g.DECODE} greedy "
        f"tokens a row; best of {g.REPS} interleaved runs. `python -m benchmarks gguf_mixes`.",
        "",
        "| file | engine | batch | prefill tok/s | x llama.cpp | decode tok/s | x llama.cpp |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    peer = {(m, b): (p, d) for m, name, b, p, d in rows if name == "llama.cpp"}
    types = {m: (p, d) for m, name, b, p, d in rows if name == "types"}
    for m, name, b, p, d in rows:
        if name == "types":
            continue
        rp, rd = peer[(m, b)]
        lines.append(f"| {m} | {name} | {b} | {p:.0f} | {p / rp:.2f}x | {d:.1f} | {d / rd:.2f}x |")
    lines += [
        "",
        f"Perplexity on {PPL_TOKENS} tokens of the default speeches (windows of "
        f"{round_trip.CONTEXT}, the same token ids in both; llama.cpp fed one token a call):",
        "",
        "| file | lowbit | lowbit, float act. | llama.cpp | lowbit / llama.cpp |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {m} | {a:.3f} | {f:.3f} | {r:.3f} | {a / r - 1:+.2%} |" for m, a, f, r in ppl]
    lines += ["", "Tensor types of each file (llama.cpp's quantizer):", ""]
    lines += [f"- {m} ({size / 2**20:.1f} MiB): {t}" for m, (t, size) in types.items()]
    lines += ["", f"Section time: {time.perf_counter() - begin:.0f} s.", ""]
    return "\n".join(lines)


def not_measured() -> str:
    return "llama-cpp-python is not importable: run in the bench environment (`make bench-env`)."
