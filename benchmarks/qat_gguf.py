"""Benchmark section: `lowbit finetune --qat gguf:MIX` against llama.cpp's own quantizer.

SmolLM2's float weights (the bundled asset dequantized) are exported by lowbit as an F32 GGUF
file; llama.cpp's quantizer (`llama_model_quantize`, llama-cpp-python) makes each mix from it
(its PTQ, no importance matrix), and lowbit's QAT (`lowbit.eval.qat_gguf`: the same per-tensor
types, block by block then end to end, distilled from the float model on training speeches)
is exported with its trained blocks written as they are. Both files are scored on held-out
text (the evaluation speeches, which the training text leaves out): llama.cpp's perplexity
(`PPL_TOKENS` tokens, windows of 512), and lowbit's perplexity and KL divergence from the float
model as ``lowbit eval FILE --against F32`` reports them (the file's own blocks on the CPU
kernels, activations in llama.cpp's Q8 blocks as llama.cpp runs them), on the same token ids.

Settings: ``LOWBIT_QAT_MIXES`` (default ``Q2_K``), ``LOWBIT_QAT_SETTINGS`` as
``windows,seq_len,batch,block_steps,e2e_steps[,e2e_weights]`` (default: `QatGGUFSettings`'s;
a 1 after them trains the weights end to end as well; other than the defaults, the table
says so), ``LOWBIT_QAT_PPL_TOKENS`` (default 4096).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

from benchmarks._machine import cpu_model

MIXES = tuple(os.environ.get("LOWBIT_QAT_MIXES", "Q2_K").split(","))
# None: `QatGGUFSettings()`'s defaults.
SETTINGS = os.environ.get("LOWBIT_QAT_SETTINGS")
# The `QatGGUFSettings` fields ``LOWBIT_QAT_SETTINGS`` lists, in its order (the last optional).
_FIELDS = ("windows", "seq_len", "batch", "block_steps", "e2e_steps", "e2e_weights")
PPL_TOKENS = int(os.environ.get("LOWBIT_QAT_PPL_TOKENS", "4096"))
PPL_CONTEXT = 512
SPEED_PROMPT = 128


def _log(text: str) -> None:
    print(f"[qat_gguf] {text}", file=sys.stderr, flush=True)


def _kl(path: str, base_logits, tokens: np.ndarray):
    """(perplexity, KL divergence from the float model) of a GGUF file as ``lowbit eval FILE
    --against F32`` runs it: the file's own blocks read into the CPU kernels' layout, their
    activations in llama.cpp's Q8 blocks (recipe ``gguf``)."""
    import jax
    from flax import nnx

    from lowbit.api import run
    from lowbit.eval import divergence
    from lowbit.serving import apply_recipe, load_model

    loaded = load_model(path, float_weights=False)
    params, _ = apply_recipe(loaded, nnx.split(loaded.model)[1], "gguf")
    graphdef = nnx.graphdef(loaded.model)
    forward = jax.jit(run(lambda s, t: nnx.merge(graphdef, s)(t)))
    ppl, div = divergence(
        lambda t: forward(params, t),
        base_logits,
        tokens,
        context=PPL_CONTEXT,
        max_tokens=PPL_TOKENS,
    )
    return ppl.perplexity, div


def _settings(settings_type):
    """``LOWBIT_QAT_SETTINGS`` as a `QatGGUFSettings` (its defaults when unset)."""
    if SETTINGS is None:
        return settings_type()
    values = [int(x) for x in SETTINGS.split(",")]
    named = dict(zip(_FIELDS, values, strict=False))
    named["e2e_weights"] = bool(named.get("e2e_weights", 0))
    return settings_type(**named)


def _llama_cpp_speeds(ptq: str, qat: str, tokenizer) -> tuple[float, float]:
    """llama.cpp's batch-1 decode tok/s on its own file and on lowbit's (same types, so the
    same kernels: the exported blocks should cost nothing extra)."""
    from benchmarks import generate as g

    prompts = g._prompts(tokenizer, 1, SPEED_PROMPT)
    engines = {
        name: g._LlamaCpp(path, 1, SPEED_PROMPT + g.DECODE + 8)
        for name, path in (("ptq", ptq), ("qat", qat))
    }
    seconds = g.engine_seconds(engines, prompts)
    for engine in engines.values():
        engine.close()
    return tuple(g.DECODE / seconds[name][1] for name in ("ptq", "qat"))


def run() -> str | None:
    """Markdown: per mix, llama.cpp's PTQ file against lowbit's QAT file."""
    import jax
    from flax import nnx

    # llama.cpp's perplexity (`benchmarks.mixes`) on as many tokens as lowbit's KL.
    os.environ.setdefault("LOWBIT_MIXES_PPL_TOKENS", str(PPL_TOKENS))
    from benchmarks.mixes import _llama_cpp_perplexity, quantize_llama_cpp
    from lowbit.eval import QatGGUFSettings, default_text, default_training_text, qat_gguf
    from lowbit.io import export_gguf
    from lowbit.models import has_smollm2, smollm2_gguf_path
    from lowbit.serving import load_model

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    if not has_smollm2():
        return None
    settings = _settings(QatGGUFSettings)
    loaded = load_model("smollm2")
    config = loaded.model.config
    graphdef, state = nnx.split(loaded.model)
    pure = state.to_pure_dict()
    encode = lambda text: np.asarray(loaded.tokenizer.encode(text).ids, np.int32)  # noqa: E731
    train, held_out = encode(default_training_text()), encode(default_text())
    source = str(smollm2_gguf_path())
    float_forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    base_logits = lambda t: float_forward(pure, t)  # noqa: E731
    rows, speeds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "smollm2-f32.gguf")
        export_gguf(pure, f32, config=config, type="F32", source=source, log=None)
        base = _llama_cpp_perplexity(f32, held_out)
        _log(f"F32: llama.cpp perplexity {base:.3f}")
        rows.append(("F32 (lowbit export)", "-", os.path.getsize(f32), base, None, None))
        for mix in MIXES:
            ptq = os.path.join(tmp, f"ptq-{mix}.gguf")
            seconds = quantize_llama_cpp(f32, ptq, mix)
            ppl = _llama_cpp_perplexity(ptq, held_out)
            own, div = _kl(ptq, base_logits, held_out)
            _log(f"{mix} llama.cpp: ppl {ppl:.3f}, lowbit ppl {own:.3f}, KL {div.kld_mean:.4f}")
            rows.append((f"{mix} llama.cpp quantizer", f"{seconds:.0f} s", os.path.getsize(ptq),
                         ppl, div, own))  # fmt: skip
            result = qat_gguf(loaded.model, train, mix, settings)
            _log(f"{mix} QAT: {result.seconds:.0f} s, train KL {result.kl_before:.4f} -> "
                 f"{result.kl_after:.4f}")  # fmt: skip
            qat = os.path.join(tmp, f"qat-{mix}.gguf")
            export_gguf(result.served(), qat, config=config, source=source, log=None)
            ppl_qat = _llama_cpp_perplexity(qat, held_out)
            lowbit_ppl, div = _kl(qat, base_logits, held_out)
            _log(f"{mix} QAT: llama.cpp ppl {ppl_qat:.3f}, lowbit ppl {lowbit_ppl:.3f}")
            speeds.append((mix, *_llama_cpp_speeds(ptq, qat, loaded.tokenizer)))
            rows.append((f"{mix} lowbit QAT", f"{result.seconds:.0f} s", os.path.getsize(qat),
                         ppl_qat, div, lowbit_ppl))  # fmt: skip
    full = settings == QatGGUFSettings()
    named = ",".join(str(int(getattr(settings, f))) for f in _FIELDS)
    lines = [
        "## QAT onto llama.cpp mixes (`lowbit finetune --qat gguf:MIX`) vs llama.cpp's quantizer",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; one run. "
        f"Command: `LOWBIT_QAT_MIXES={','.join(MIXES)} LOWBIT_QAT_SETTINGS={named} "
        f"LOWBIT_QAT_PPL_TOKENS={PPL_TOKENS} python -m benchmarks qat_gguf`.",
        f"SmolLM2-135M. QAT settings: {settings.windows} windows x {settings.seq_len} tokens, "
        f"batch {settings.batch}, {settings.block_steps} steps per layer, "
        f"{settings.e2e_steps} end-to-end steps"
        + (" (weights included)" if settings.e2e_weights else "")
        + ("" if full else " (not the default settings)")
        + f". Held-out scoring: {PPL_TOKENS} tokens of the evaluation speeches, windows of "
        f"{PPL_CONTEXT}; lowbit ppl and KL (lowbit's mean KL divergence from the float model, "
        "nats/token) as `lowbit eval FILE --against F32` runs the file: its own blocks, "
        "activations in llama.cpp's Q8 blocks.",
        "",
        "| file | time to make | bytes | llama.cpp ppl | KL vs float | top-1 | lowbit ppl |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, took, size, ppl, div, own in rows:
        kl = "-" if div is None else f"{div.kld_mean:.4f} ± {div.kld_ci95:.4f}"
        top1 = "-" if div is None else f"{100 * div.top1:.1f}%"
        lines.append(
            f"| {name} | {took} | {size:,} | {ppl:.3f} | {kl} | {top1} | "
            + ("-" if own is None else f"{own:.3f}")
            + " |"
        )
    lines += ["", *_ratios(rows), ""]
    lines += [
        f"llama.cpp's decode speed of each pair (batch 1, a {SPEED_PROMPT}-token prompt, then "
        "64 greedy tokens; best of 4 interleaved runs): "
        + "; ".join(
            f"{m} {p:.1f} tok/s its own file, {q:.1f} lowbit's ({q / p:.2f}x)" for m, p, q in speeds
        )  # fmt: skip
        + " (target: the same speed).",
    ]
    return "\n".join(lines)


# Issue targets: lowbit's QAT against llama.cpp's file of the same mix, as (Δppl, KLD) ratios.
TARGETS = {"Q3_K_M": (0.5, 0.5), "Q2_K": (0.4, 0.4), "Q4_0": (0.5, None)}


def _ratios(rows: list) -> list[str]:
    """One line per mix: Δppl (llama.cpp's perplexity over the F32 file's) and KLD of
    lowbit's QAT file over llama.cpp's, against the targets, and lowbit's own perplexity of
    the QAT file against llama.cpp's."""
    base = rows[0][3]
    out = []
    for ptq, qat in zip(rows[1::2], rows[2::2], strict=True):
        mix = ptq[0].split()[0]
        dppl = (qat[3] - base) / (ptq[3] - base)
        dkl = qat[4].kld_mean / ptq[4].kld_mean
        goal = TARGETS.get(mix, (None, None))
        said = [
            f"Δppl {qat[3] - base:+.3f} against {ptq[3] - base:+.3f}: **{dppl:.2f}x**"
            + (f" (target ≤ {goal[0]}x)" if goal[0] else ""),
            f"KLD **{dkl:.2f}x**" + (f" (target ≤ {goal[1]}x)" if goal[1] else ""),
            f"lowbit's perplexity of the QAT file {100 * (qat[5] / qat[3] - 1):+.2f}% from "
            "llama.cpp's (target within 0.5%)",
        ]
        out.append(f"- {mix}: " + "; ".join(said) + ".")
    return out
