"""GGUF round trip with llama.cpp: export SmolLM2 from lowbit, run it in llama.cpp.

Rows: the same weights scored by `lowbit eval`'s perplexity (4096 tokens of the default
speeches, windows of 512, no BOS) and by llama.cpp (`llama_cpp.Llama`, same token ids, same
windows, logits of every position), for

  * ``float``: the float weights (lowbit only; the float baseline of the Δppl column);
  * ``gguf``: the original Q4_1 file (lowbit imports its blocks);
  * ``int8w`` and ``int4w_g32_asym``: lowbit recipes on the float model, exported with
    `lowbit.io.export_gguf` (``int4w_g32_asym`` maps onto Q4_1 directly; per-channel int8
    is requantized to Q8_0, so lowbit's row is the exported file imported back);
  * ``Q4_K_M (lowbit)``: the float weights exported as Q4_K_M by lowbit's encoders, and
    ``Q4_K_M (llama.cpp)``: the float weights exported as F32 and quantized by llama.cpp's
    own `llama_model_quantize`; lowbit scores each file by importing it.

Plus the encoders' weight error on the same float weights: per GGML type, relative RMS error of
lowbit's blocks and llama.cpp's blocks in the two Q4_K_M files, and the share of identical
blocks. Needs `llama_cpp` (the `.venv-bench` environment); without it the section says so.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import sys
import tempfile
import time

import numpy as np

from benchmarks._machine import cpu_model
from benchmarks.mixes import quantize_llama_cpp

CONTEXT = 512
MAX_TOKENS = 512  # 1 window: llama.cpp is fed one token per call (see _llama_ppl)


def _llama_ppl(path: str, tokens: np.ndarray) -> float:
    import llama_cpp

    # One token per decode call: the bench environment's llama.cpp build (-march=native)
    # crashes in multi-token batches on this machine; batch size does not change the logits
    # beyond float summation order.
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=CONTEXT,
        n_batch=1,
        n_ubatch=1,
        logits_all=True,
        n_threads=1,  # OpenMP spinning threads crawl on a shared, loaded machine
        verbose=False,
    )
    nll, count = 0.0, 0
    for start in range(0, MAX_TOKENS, CONTEXT):
        window = tokens[start : start + CONTEXT + 1]
        if len(window) < CONTEXT + 1:
            break
        llm.reset()
        llm.eval(window[:-1].tolist())
        logits = np.asarray(llm.scores[:CONTEXT], np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= logp[np.arange(CONTEXT), window[1:]].sum()
        count += CONTEXT
    llm.close()
    print(f"[gguf] llama.cpp ppl {math.exp(nll / count):.4f} ({path})", file=sys.stderr, flush=True)
    return math.exp(nll / count)


def _weight_errors(ours: str, theirs: str, float_params, config) -> list[tuple]:
    """Per GGML type: (type, tensors, rel RMSE lowbit, rel RMSE llama.cpp, identical blocks)."""
    from lowbit.gguf import read_gguf
    from lowbit.io._gguf_export import _lookup, _permute_rope_rows
    from lowbit.models import gguf_param_map

    a, b = read_gguf(ours), read_gguf(theirs)
    mapping = gguf_param_map(config)
    stats: dict[str, list] = {}
    for name, where in mapping.items():
        ta, tb = a.tensors[name], b.tensors[name]
        if ta.ggml_type != tb.ggml_type or ta.type_name in ("F32", "F16"):
            continue
        ref = np.asarray(_lookup(float_params, tuple(where.path)), np.float32)
        ref = ref.T if where.transpose else ref
        if where.unpermute_heads is not None:
            ref = _permute_rope_rows(ref, where.unpermute_heads)
        ea = float(((ta.dequantize() - ref) ** 2).sum())
        eb = float(((tb.dequantize() - ref) ** 2).sum())
        same = (ta.blocks() == tb.blocks()).all(-1)
        s = stats.setdefault(ta.type_name, [0, 0.0, 0.0, 0.0, 0, 0])
        s[0] += 1
        s[1] += ea
        s[2] += eb
        s[3] += float((ref**2).sum())
        s[4] += int(same.sum())
        s[5] += same.size
    return [
        (t, s[0], math.sqrt(s[1] / s[3]), math.sqrt(s[2] / s[3]), s[4] / s[5])
        for t, s in sorted(stats.items())
    ]


def run() -> str:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "## GGUF round trip with llama.cpp\n\nSkipped: `llama_cpp` is not installed.\n"
    from flax import nnx

    from lowbit.eval import quantize_variant
    from lowbit.eval._session import ModelSession
    from lowbit.io import export_gguf, import_gguf
    from lowbit.models import gguf_param_map
    from lowbit.serving import load_model

    loaded = load_model("smollm2")
    config = loaded.model.config
    session = ModelSession(loaded, context=CONTEXT, max_tokens=MAX_TOKENS)
    tokens = session.tokens()
    float_params, _ = quantize_variant(loaded, nnx.split(loaded.model)[1], "float")
    mapping = gguf_param_map(config)
    source = str(loaded.gguf_path)

    def lowbit_ppl(params) -> float:
        value = session.quality(params)[0]
        print(f"[gguf] lowbit ppl {value:.4f}", file=sys.stderr, flush=True)
        return value

    def imported(path):
        return import_gguf(path, name_map=mapping.get)[0]

    rows = []
    timings = {}
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        start = time.perf_counter()
        export_gguf(float_params, f32, config=config, type="F32", source=source, log=None)
        timings["F32 export"] = time.perf_counter() - start
        ppl_float = lowbit_ppl(float_params)
        rows.append(("float", ppl_float, math.nan))
        rows.append(
            ("gguf (original Q4_1 file)", lowbit_ppl(imported(source)), _llama_ppl(source, tokens))
        )
        for recipe in ("int8w", "int4w_g32_asym"):
            params, _ = quantize_variant(loaded, nnx.split(loaded.model)[1], recipe)
            out = os.path.join(tmp, f"{recipe}.gguf")
            start = time.perf_counter()
            report = export_gguf(params, out, config=config, source=source, log=None)
            timings[f"{recipe} export"] = time.perf_counter() - start
            direct = sum(n.how == "direct" for n in report.tensors)
            label = f"{recipe} ({direct} direct)"
            rows.append((label + ", lowbit weights", lowbit_ppl(params), _llama_ppl(out, tokens)))
            rows.append((label + ", exported file", lowbit_ppl(imported(out)), math.nan))
        ours = os.path.join(tmp, "q4km-lowbit.gguf")
        start = time.perf_counter()
        export_gguf(float_params, ours, config=config, type="Q4_K_M", source=source, log=None)
        timings["Q4_K_M export"] = time.perf_counter() - start
        theirs = os.path.join(tmp, "q4km-llama.gguf")
        timings["llama.cpp Q4_K_M quantize"] = quantize_llama_cpp(f32, theirs, "Q4_K_M")
        rows.append(
            ("Q4_K_M (lowbit encoders)", lowbit_ppl(imported(ours)), _llama_ppl(ours, tokens))
        )
        rows.append(
            (
                "Q4_K_M (llama.cpp quantize)",
                lowbit_ppl(imported(theirs)),
                _llama_ppl(theirs, tokens),
            )
        )
        errors = _weight_errors(ours, theirs, float_params, config)
    load = os.getloadavg()
    lines = [
        "## GGUF round trip with llama.cpp",
        "",
        f"{datetime.date.today()}, {cpu_model()}, {os.cpu_count()} cores, {platform.machine()}; "
        f"load average {load[0]:.1f}. `python -m benchmarks gguf` in `.venv-bench` (llama_cpp "
        f"{__import__('llama_cpp').__version__}). SmolLM2-135M, perplexity on {MAX_TOKENS} "
        f"tokens of the default speeches, windows of {CONTEXT}, same token ids in both "
        "(llama.cpp fed one token per decode call).",
        "",
        "| weights | lowbit ppl | llama.cpp ppl | llama.cpp / lowbit | llama.cpp Δppl vs float |",
        "|---|---:|---:|---:|---:|",
    ]
    float_ppl = rows[0][1]  # lowbit's float weights (the float baseline of both tools)
    for label, ours_ppl, llama_ppl in rows:
        ratio = f"{llama_ppl / ours_ppl - 1:+.3%}" if not math.isnan(llama_ppl) else "-"
        llama_txt = f"{llama_ppl:.3f}" if not math.isnan(llama_ppl) else "-"
        delta = f"{llama_ppl - float_ppl:+.3f}" if not math.isnan(llama_ppl) else "-"
        lines.append(f"| {label} | {ours_ppl:.3f} | {llama_txt} | {ratio} | {delta} |")
    lines += [
        "",
        "Weight error of the two Q4_K_M files against the float weights (per GGML type, over "
        "the tensors both files store in that type):",
        "",
        "| type | tensors | rel. RMS error lowbit | rel. RMS error llama.cpp | identical blocks |",
        "|---|---:|---:|---:|---:|",
    ]
    for t, n, ea, eb, same in errors:
        lines.append(f"| {t} | {n} | {ea:.5f} | {eb:.5f} | {same:.1%} |")
    lines += [
        "",
        "Export / quantize wall times (s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in timings.items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
