"""Benchmark section: lowbit's size-budgeted plans against llama.cpp's own mixes, at equal size.

SmolLM2's float weights (the asset dequantized) are exported as an F16 GGUF file. llama.cpp's
`llama_model_quantize` (llama-cpp-python) makes Q2_K, Q3_K_M, Q4_K_M and Q5_K_M from it. For each,
lowbit chooses a plan from the GGML types it encodes (`lowbit.api.plan_within`, candidates
measured once on the calibration set) with llama.cpp's file size as its budget (`--max-bytes`:
every byte of the file counted, `lowbit.io.gguf_plan_bytes`), and exports it (`export_gguf`,
each weight as its chosen type). Every
file is scored by llama.cpp's perplexity on the same evaluation text.

Caveat: the SmolLM2 asset is itself a Q4_1 file (210 weights Q4_1, the embedding Q8_0), so its
"float" weights already lie on Q4_1 grids: a Q4_1 candidate (`q4_1`) reproduces them almost
exactly, which llama.cpp's K-quant mixes (built on other grids) cannot. The comparison is fair
only with float weights that were never quantized (e.g. a Hugging Face safetensors checkpoint).

Columns: file bytes, bits per weight of the quantized tensors, perplexity and its change over
the F16 file, and the seconds each file took (llama.cpp: quantizing; lowbit: choosing the plan
from the shared measurements, quantizing and writing). The shared measuring time (calibration
capture and every candidate on every weight) is reported once, beside the time GPTQ's own
calibration and rounding take on the same data (`int4w_g64_gptq`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
from flax import nnx

from benchmarks._machine import cpu_model

MIXES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M")
TARGET_RATIO = {"Q2_K": 0.5, "Q3_K_M": 0.6, "Q4_K_M": 0.75, "Q5_K_M": 0.75}
# GPTQ-rounded 32-blocks (Q4_0 / Q4_1 / Q8_0 store lowbit's int4 / uint4 / int8 g32 codes
# directly) beside llama.cpp's reference quantizers of every other type.
CANDIDATES = "q8_0,q6_k,q5_k,q5_1,q5_0,q4_k,q4_1,q4_0,iq4_nl,q3_k,q2_k,q4_0:gptq,q4_1:gptq"
SEQUENCES = int(os.environ.get("LOWBIT_MIXES_SEQUENCES", "64"))
PPL_CONTEXT = 512
PPL_TOKENS = int(os.environ.get("LOWBIT_MIXES_PPL_TOKENS", "8192"))


def _log(text: str) -> None:
    print(f"[mixes] {text}", file=sys.stderr, flush=True)


def quantize_llama_cpp(source: str, out: str, mix: str) -> float:
    """llama.cpp's quantizer from `source` to `out` as `mix`; returns the seconds taken."""
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{mix}")
    params.nthread = os.cpu_count() or 1
    start = time.perf_counter()
    if L.llama_model_quantize(source.encode(), out.encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize to {mix} failed")
    return time.perf_counter() - start


def _weight_bytes(path: str) -> tuple[int, int]:
    """(bytes, elements) of a GGUF file's tensors with 2+ dimensions (the quantized ones)."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = [t for t in reader.tensors if len(t.shape) >= 2]
    return sum(int(t.n_bytes) for t in tensors), sum(int(t.n_elements) for t in tensors)


def _llama_cpp_perplexity(path: str, tokens: np.ndarray) -> float:
    from benchmarks.architectures import _llama_cpp_logits
    from benchmarks.generate import _LlamaCpp
    from lowbit.eval import perplexity

    llama = _LlamaCpp(path, 1, PPL_CONTEXT + 8)
    try:
        logits = _llama_cpp_logits(llama)
        return perplexity(logits, tokens, context=PPL_CONTEXT, max_tokens=PPL_TOKENS).perplexity
    finally:
        llama.close()


def run() -> str | None:
    """Markdown: per llama.cpp mix, its file against lowbit's plan at the same size."""
    from lowbit.api import AlgorithmOptions, measure_candidates, plan_within, quantize_params
    from lowbit.eval import calibrator, default_text
    from lowbit.io import export_gguf, gguf_plan_bytes
    from lowbit.models import has_smollm2, smollm2_gguf_path
    from lowbit.recipes import parse_candidates
    from lowbit.serving import apply_recipe, load_model

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    if not has_smollm2():
        return None
    loaded = load_model("smollm2")
    config = loaded.model.config
    pure = nnx.to_pure_dict(nnx.split(loaded.model)[1])
    tokens = np.asarray(loaded.tokenizer.encode(default_text()).ids, np.int32)
    source = str(smollm2_gguf_path())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        f16 = os.path.join(tmp, "smollm2-f16.gguf")
        export_gguf(pure, f16, config=config, type="F16", source=source, log=None)
        base = _llama_cpp_perplexity(f16, tokens)
        _log(f"F16 file: perplexity {base:.3f}")
        rows.append(("F16 (lowbit export)", os.path.getsize(f16), *_weight_bytes(f16), base, 0.0))

        candidates = parse_candidates(CANDIDATES)
        from lowbit.api._budget import planned_weights

        paths = tuple(planned_weights(pure, candidates))
        start = time.perf_counter()
        statistics = calibrator(None, SEQUENCES)(loaded, pure, paths, 0)
        capture_s = time.perf_counter() - start
        start = time.perf_counter()
        file = gguf_plan_bytes(pure, paths, config=config, source=source)
        measurements = measure_candidates(
            pure, statistics, candidates=candidates, target="gguf", file=file
        )
        measure_s = time.perf_counter() - start
        _log(f"measured: capture {capture_s:.0f} s, candidates {measure_s:.0f} s")

        # GPTQ's own time on the same data, for the "≤ 2x GPTQ calibration" target.
        start = time.perf_counter()
        apply_recipe(
            loaded,
            nnx.split(loaded.model)[1],
            "int4w_g64_gptq",
            calibrate=calibrator(None, SEQUENCES),
        )
        gptq_s = time.perf_counter() - start
        _log(f"int4w_g64_gptq on the same data: {gptq_s:.0f} s")

        results = {}
        for mix in MIXES:
            theirs = os.path.join(tmp, f"llama-{mix}.gguf")
            seconds = quantize_llama_cpp(f16, theirs, mix)
            budget = os.path.getsize(theirs)  # the whole file: header, tokenizer, norms too
            their_bytes, elements = _weight_bytes(theirs)
            ppl = _llama_cpp_perplexity(theirs, tokens)
            rows.append(
                (f"llama.cpp {mix}", os.path.getsize(theirs), their_bytes, elements, ppl, seconds)
            )
            start = time.perf_counter()
            plan = plan_within(measurements, max_bytes=budget, name=f"plan-{mix}")
            options = AlgorithmOptions(statistics=statistics)
            params = quantize_params(pure, plan.recipe, algorithm_options=options)
            ours = os.path.join(tmp, f"lowbit-{mix}.gguf")
            export_gguf(params, ours, config=config, source=source, log=None)
            seconds = time.perf_counter() - start
            mine_bytes, mine_elements = _weight_bytes(ours)
            ppl_ours = _llama_cpp_perplexity(ours, tokens)
            rows.append(
                (
                    f"lowbit plan at {mix}",
                    os.path.getsize(ours),
                    mine_bytes,
                    mine_elements,
                    ppl_ours,
                    seconds,
                )
            )
            counts: dict[str, int] = {}
            for t in plan.tensors:
                counts[t.chosen.candidate.name] = counts.get(t.chosen.candidate.name, 0) + 1
            results[mix] = (ppl - base, ppl_ours - base, counts)
            _log(f"{mix}: llama.cpp {ppl:.3f}, lowbit {ppl_ours:.3f} ({budget} / {mine_bytes} B)")
    lines = [
        "## Size-budgeted plans against llama.cpp's mixes",
        "",
        f"SmolLM2-135M, {cpu_model()}, {time.strftime('%Y-%m-%d')}; perplexity by llama.cpp "
        f"(llama-cpp-python) on the evaluation text, windows of {PPL_CONTEXT}, up to "
        f"{PPL_TOKENS} tokens; lowbit calibrated on {SEQUENCES} sequences of 512 tokens. The "
        "float weights are the asset's Q4_1 / Q8_0 blocks decoded: lowbit's q4_1 candidate "
        "reproduces them (see the module docstring), so lowbit's advantage is overstated.",
        "",
        "| file | bytes | weight bytes | bits/weight | perplexity | Δppl | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, size, wbytes, elements, ppl, seconds in rows:
        lines.append(
            f"| {label} | {size} | {wbytes} | {8 * wbytes / elements:.3f} | {ppl:.3f} | "
            f"{ppl - base:+.3f} | {seconds:.1f} |"
        )
    lines += [
        "",
        "| mix | llama.cpp Δppl | lowbit Δppl | ratio | target | lowbit's types |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for mix, (theirs, ours, counts) in results.items():
        ratio = ours / theirs if theirs > 0 else float("nan")
        types = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        lines.append(
            f"| {mix} | {theirs:+.3f} | {ours:+.3f} | {ratio:.2f} | ≤ {TARGET_RATIO[mix]} | "
            f"{types} |"
        )
    lines += [
        "",
        f"Measuring once for all plans: calibration capture {capture_s:.0f} s, candidates on "
        f"every weight {measure_s:.0f} s; `int4w_g64_gptq` (capture and GPTQ) on the same data: "
        f"{gptq_s:.0f} s.",
    ]
    return "\n".join(lines)


def not_measured() -> str:
    return "Not measured: needs llama-cpp-python (bench environment) and the SmolLM2 asset."
